"""Activation offload: the tensors autograd saves, streamed to host RAM or NVMe, and their buffers."""
