"""What one optimizer step works on: the shard record, its state layout and formats, sub-chunks, kernels."""
