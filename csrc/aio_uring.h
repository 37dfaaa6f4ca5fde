// The I/O engine's io_uring backend (aio_uring.cpp). Internal to the library. No Python or
// torch headers.
#pragma once

namespace inf_aio {

// 0 when an io_uring can be set up here, else -errno (-ENOSYS when built without
// <linux/io_uring.h>).
int uring_probe();

// Starts the ring threads when the io_uring backend is selected. A ring that cannot be set up
// now (it could when the backend was chosen) leaves the thread pool in charge. Caller holds cfg_m.
void start_ring_locked();

// Stops the ring threads after they finished every queued and in-flight chunk. Caller holds cfg_m.
void stop_ring_locked();

}  // namespace inf_aio
