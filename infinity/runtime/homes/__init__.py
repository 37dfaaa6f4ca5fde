"""Where a flat buffer's parameters live between uses: one home per tier, quantized and sharded homes, sources."""
