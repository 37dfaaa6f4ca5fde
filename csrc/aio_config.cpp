// Configuration of the I/O engine: pool size, chunk size, queue depth, CRC threads and backend
// (thread pool or io_uring). C ABI, loaded through ctypes; no Python or torch headers.
#include <cerrno>
#include <cstdint>
#include <mutex>

#include "aio_engine.h"
#include "aio_pool.h"
#include "aio_uring.h"
#include "common.h"

using namespace inf_aio;

// Sets the pool size, chunk size (rounded up to 4096) and queue depth (max queued requests;
// submit blocks while the queue is full). Values <= 0 keep the current setting. Returns 0 or
// -EINVAL. Changing the thread count drains the queue and restarts the pool.
INF_API int inf_aio_configure(int num_threads, int64_t chunk_bytes, int queue_depth) {
  Engine* e = E();
  if (num_threads > 1024 || chunk_bytes > (1ll << 30) || queue_depth > (1 << 20)) return -EINVAL;
  std::lock_guard<std::mutex> g(e->cfg_m);
  if (chunk_bytes > 0) {
    std::lock_guard<std::mutex> q(e->qm);
    e->cfg.chunk_bytes = (static_cast<uint64_t>(chunk_bytes) + kAlign - 1) & ~(kAlign - 1);
  }
  if (queue_depth > 0) {
    std::lock_guard<std::mutex> q(e->qm);
    e->cfg.queue_depth = queue_depth;
  }
  e->qspace.notify_all();
  if (num_threads > 0 && num_threads != e->cfg.num_threads) {
    if (!e->workers.empty() || !e->ring_threads.empty()) stop_pool_locked();
    e->cfg.num_threads = num_threads;
  }
  return 0;
}

// Threads that checksum chunks beside the I/O workers (0: each I/O worker checksums its own
// chunk before taking the next). Waits for queued requests when the count changes.
INF_API int inf_aio_set_crc_threads(int n) {
  if (n < 0 || n > 64) return -EINVAL;
  Engine* e = E();
  std::lock_guard<std::mutex> g(e->cfg_m);
  if (n != e->cfg.crc_threads) {
    if (!e->workers.empty() || !e->crc_workers.empty() || !e->ring_threads.empty())
      stop_pool_locked();
    e->cfg.crc_threads = n;
  }
  return 0;
}

// backend: 0 thread pool, 1 io_uring ring thread(s) for direct-mode requests (the thread pool
// still serves the rest). Returns 0, -EINVAL, or -errno of a failed io_uring_setup (ENOSYS
// without kernel support or without <linux/io_uring.h> at build time, EPERM when disabled by
// kernel.io_uring_disabled or a seccomp filter); then the backend stays as it was. Switching
// waits for queued requests and restarts the pool.
INF_API int inf_aio_set_backend(int backend) {
  if (backend != 0 && backend != 1) return -EINVAL;
  Engine* e = E();
  std::lock_guard<std::mutex> g(e->cfg_m);
  if (backend == 1 && e->cfg.backend != 1) {
    int rc = uring_probe();
    if (rc != 0) {
      e->ring_error = -rc;
      return rc;
    }
  }
  if (backend != e->cfg.backend) {
    if (!e->workers.empty() || !e->crc_workers.empty() || !e->ring_threads.empty())
      stop_pool_locked();
    e->cfg.backend = backend;
  }
  return 0;
}

// The selected backend (0 thread pool, 1 io_uring); *err: errno of the last failed io_uring
// setup (0 none): a ring that failed to start at pool start turns the backend back to 0.
INF_API int inf_aio_get_backend(int* err) {
  Engine* e = E();
  std::lock_guard<std::mutex> g(e->cfg_m);
  if (err) *err = e->ring_error;
  return e->cfg.backend;
}

// Chunks submitted through io_uring since the process started (tests check the ring is used).
INF_API int64_t inf_aio_ring_chunks(void) {
  return static_cast<int64_t>(E()->ring_chunks.load(std::memory_order_relaxed));
}

INF_API int inf_aio_get_crc_threads(void) {
  Engine* e = E();
  std::lock_guard<std::mutex> g(e->cfg_m);
  return e->cfg.crc_threads;
}

INF_API void inf_aio_get_config(int* num_threads, int64_t* chunk_bytes, int* queue_depth) {
  Engine* e = E();
  std::lock_guard<std::mutex> g(e->cfg_m);
  if (num_threads) *num_threads = e->cfg.num_threads;
  if (chunk_bytes) *chunk_bytes = static_cast<int64_t>(e->cfg.chunk_bytes);
  if (queue_depth) *queue_depth = e->cfg.queue_depth;
}
