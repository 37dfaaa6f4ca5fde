// Test-only fault injection of the I/O engine (aio_fault.cpp). Internal to the library. No
// Python or torch headers.
#pragma once
#include <cstddef>

namespace inf_aio {

// Returns an errno to fail with now, or 0 (and may shorten *len). With O_DIRECT (``align`` > 1)
// a shortened length is rounded down to the alignment, so the fault is the injected errno and
// never an EINVAL from an unaligned transfer.
int fault_check(int op, size_t* len, size_t align);

// The errno every O_DIRECT open fails with (0: none).
int open_fault_errno();

}  // namespace inf_aio
