"""Where a block's gradients go: the sink, one store per tier, norms, reads and held buffers."""
