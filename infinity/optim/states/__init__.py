"""Optimizer states per tier (host RAM, NVMe), the NVMe pipeline and the tier chosen per model."""
