"""ZeRO over torch.distributed: each rank's part of every flat, its collectives and whole-model state dicts."""
