"""Layer-major accumulation: k micro-batches through each layer before the next, each block
fetched twice per optimizer step whatever k is (driver.py; the chain of layers: chain.py; the
layer inputs kept between forward and backward: boundary.py)."""
