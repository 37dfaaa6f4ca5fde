"""The records every part of the runtime stands on: flat buffers, blocks, residency, the schedule, counters."""
