"""Forward and backward of a wrapped model: the per-step state machine, its hooks, the block group and its transfers."""
