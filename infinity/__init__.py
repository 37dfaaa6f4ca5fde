"""infinity: heterogeneous GPU/CPU/NVMe offload engine for PyTorch training."""
__version__ = "0.1.0"
