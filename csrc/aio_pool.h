// The I/O engine's worker pool (aio_pool.cpp): chunked transfers, completion, pool start/stop
// and the id maps. Internal to the library. No Python or torch headers.
#pragma once
#include "aio_engine.h"

#include <cstdint>
#include <memory>

namespace inf_aio {

// Outcome of one transfer: bytes moved, or the errno and file offset of the failure.
struct IoRes {
  uint64_t done = 0;
  int err = 0;
  int64_t err_off = 0;
  bool short_read = false;
};

// Transfers len bytes, retrying EINTR and partial transfers. A partial O_DIRECT transfer that
// leaves the position misaligned continues through the plain fd.
IoRes io_loop(Handle* h, int op, bool use_direct, char* buf, uint64_t len, int64_t off);

// The buffer range [start, start + len) that chunk idx of a request covers.
void chunk_range(const Request* r, uint64_t idx, uint64_t* start, uint64_t* len);

// Completes a request (combined CRC, fdatasync, message) and wakes its waiters.
void finish_request(Request* r);

// Hands chunk idx of req to the CRC threads.
void enqueue_crc(const std::shared_ptr<Request>& req, uint64_t idx);

// Records one chunk's outcome (bytes, the error with the lowest offset, CRC time) and retires
// ``events`` of the request's pending events; the last one completes the request.
void account_chunk(Request* req, const IoRes& res, int64_t crc_ns, uint64_t events);

// Starts the pool (CRC threads, ring threads, workers) if needed. Caller holds cfg_m.
void ensure_pool_locked();
// Stops every thread of the pool after it finished what is queued. Caller holds cfg_m.
void stop_pool_locked();

std::shared_ptr<Handle> get_handle(int64_t id);
std::shared_ptr<Request> get_request(int64_t id);

}  // namespace inf_aio
