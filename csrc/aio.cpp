// O_DIRECT asynchronous file I/O for infinity: requests (submit, wait, result).
//
// One global worker pool serves every handle. A request (pread/pwrite of host memory at a file
// offset) is split into chunks; workers take chunks in FIFO order, so one large request keeps
// every worker busy (queue depth on the device == number of workers) and many small requests run
// side by side. Completion records the bytes transferred or the error with the lowest failing
// offset (errno + offset + message). Python waits with inf_aio_wait (ctypes drops the GIL).
//
// Alignment: O_DIRECT needs buffer address, file offset and length aligned to 4096.
//   * offset and buffer aligned: the 4096-multiple body goes through the O_DIRECT fd, the
//     (< 4096 byte) tail through a second, plain fd on the same file;
//   * offset aligned, buffer not: body through a per-worker aligned bounce buffer, tail plain;
//   * offset not aligned: the whole request through the plain fd (page cache).
// The kernel keeps O_DIRECT and buffered I/O on one file coherent (direct I/O flushes and
// invalidates the cached range first).
//
// Files of the engine: aio_engine.h (its state), aio_pool.cpp (worker pool, chunk transfers,
// completion), aio_uring.cpp (io_uring backend), aio_config.cpp, aio_handles.cpp, aio_fault.cpp
// (test-only fault injection); beside it aio_mem.cpp (aligned host memory) and aio_crc32c.cpp
// (CRC32C).
//
// No Python or torch headers here: plain C ABI, loaded through ctypes.
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <unistd.h>

#include "aio_engine.h"
#include "aio_pool.h"
#include "common.h"

using namespace inf_aio;

// op: 0 read (file -> buf), 1 write (buf -> file). fsync: fdatasync after the last chunk, before
// completion (writes only). The buffer must stay valid until the request completes.
// Returns a request id > 0, or -errno (EBADF closed handle, EINVAL bad arguments).
INF_API int64_t inf_aio_submit_ex(int64_t handle, int op, void* buf, int64_t nbytes,
                                  int64_t offset, int flags);

INF_API int64_t inf_aio_submit(int64_t handle, int op, void* buf, int64_t nbytes, int64_t offset,
                               int fsync) {
  return inf_aio_submit_ex(handle, op, buf, nbytes, offset, fsync ? 1 : 0);
}

// flags: bit 0 fsync (writes), bit 1 CRC32C of the transferred bytes, computed by the workers
// chunk by chunk (overlapping the I/O) and combined at completion; read it with inf_aio_crc.
// Bit 2 urgent: queued behind the other urgent requests but ahead of every request that is
// not, whose chunks not yet handed out then wait (a fetch compute is about to wait for goes
// before bulk traffic such as optimizer states).
INF_API int64_t inf_aio_submit_ex(int64_t handle, int op, void* buf, int64_t nbytes,
                                  int64_t offset, int flags) {
  const int fsync = flags & 1;
  if ((op != kRead && op != kWrite) || nbytes < 0 || offset < 0 || (buf == nullptr && nbytes > 0))
    return -EINVAL;
  Engine* e = E();
  auto h = get_handle(handle);
  if (!h) return -EBADF;
  auto r = std::make_shared<Request>();
  r->h = h;
  r->op = op;
  r->buf = static_cast<char*>(buf);
  r->n = static_cast<uint64_t>(nbytes);
  r->off = offset;
  r->fsync = fsync != 0;
  r->want_crc = (flags & 2) != 0;
  r->urgent = (flags & 4) != 0;
  r->t_submit = mono_ns();
  {
    std::lock_guard<std::mutex> g(e->cfg_m);
    r->chunk = e->cfg.chunk_bytes;
    r->crc_async = r->want_crc && e->cfg.crc_threads > 0;
    ensure_pool_locked();
  }
  bool off_aligned = (static_cast<uint64_t>(offset) & (kAlign - 1)) == 0;
  bool buf_aligned = (reinterpret_cast<uintptr_t>(buf) & (kAlign - 1)) == 0;
  if (h->direct && off_aligned && r->n >= kAlign) {
    r->mode = buf_aligned ? kModeDirect : kModeBounce;
    r->body = r->n & ~(kAlign - 1);
    r->nbody = (r->body + r->chunk - 1) / r->chunk;
    r->nchunks = r->nbody + (r->n > r->body ? 1 : 0);
  } else {
    r->mode = kModePlain;
    r->body = 0;
    r->nbody = 0;
    r->nchunks = (r->n + r->chunk - 1) / r->chunk;
  }
  {
    std::lock_guard<std::mutex> g(h->m);
    if (h->closed) return -EBADF;
    h->inflight++;
  }
  {
    std::lock_guard<std::mutex> g(e->map_m);
    r->id = e->next_req++;
    e->reqs[r->id] = r;
  }
  if (r->want_crc) r->chunk_crc.assign(r->nchunks, 0);
  if (r->nchunks == 0) {  // zero bytes: complete at once (fsync still honoured)
    r->remaining = 0;
    finish_request(r.get());
    return r->id;
  }
  r->remaining = r->nchunks * (r->crc_async ? 2 : 1);  // I/O (+ checksum) of every chunk
  // the ring threads (when running) take direct-mode requests whose checksums, if any, go to
  // the CRC threads; the workers take everything else
  const bool ring_ok = r->mode == kModeDirect && (!r->want_crc || r->crc_async);
  bool to_ring;
  {
    std::unique_lock<std::mutex> lk(e->qm);
    e->qspace.wait(lk, [&] {
      const auto& dq = (ring_ok && e->ring_on) ? e->uq : e->q;
      return static_cast<int>(dq.size()) < e->cfg.queue_depth;
    });
    to_ring = ring_ok && e->ring_on;
    auto& dq = to_ring ? e->uq : e->q;
    if (r->urgent) {
      auto it = dq.begin();
      while (it != dq.end() && (*it)->urgent) ++it;
      dq.insert(it, r);
    } else {
      dq.push_back(r);
    }
    if (to_ring && e->ring_waiting > 0 && e->ring_evfd >= 0) {
      uint64_t one = 1;
      ssize_t w = ::write(e->ring_evfd, &one, sizeof(one));  // EAGAIN: already signalled
      (void)w;
    }
  }
  if (to_ring && r->nchunks == 1) e->ucv.notify_one();
  else if (to_ring) e->ucv.notify_all();
  else if (r->nchunks == 1) e->qcv.notify_one();
  else e->qcv.notify_all();
  return r->id;
}

// 1 when complete, 0 when not, -1 unknown request.
INF_API int inf_aio_poll(int64_t req) {
  auto r = get_request(req);
  if (!r) return -1;
  std::lock_guard<std::mutex> g(r->m);
  return r->done ? 1 : 0;
}

// Blocks until complete or timeout_ms (< 0: forever). 1 complete, 0 timed out, -1 unknown.
INF_API int inf_aio_wait(int64_t req, int64_t timeout_ms) {
  auto r = get_request(req);
  if (!r) return -1;
  std::unique_lock<std::mutex> lk(r->m);
  if (timeout_ms < 0) {
    r->cv.wait(lk, [&] { return r->done; });
    return 1;
  }
  return r->cv.wait_for(lk, std::chrono::milliseconds(timeout_ms), [&] { return r->done; }) ? 1
                                                                                             : 0;
}

// Result of a completed request: *bytes transferred, *err (0 or errno of the first failure),
// *err_offset (file offset of that failure) and a message. Returns 0 done, 1 not done, -1 unknown.
INF_API int inf_aio_result(int64_t req, int64_t* bytes, int* err, int64_t* err_offset, char* msg,
                           int msg_len) {
  auto r = get_request(req);
  if (!r) return -1;
  std::lock_guard<std::mutex> g(r->m);
  if (!r->done) return 1;
  if (bytes) *bytes = static_cast<int64_t>(r->done_bytes);
  if (err) *err = r->err;
  if (err_offset) *err_offset = r->err_off;
  if (msg && msg_len > 0) {
    std::snprintf(msg, static_cast<size_t>(msg_len), "%s", r->msg.c_str());
  }
  return 0;
}

// CRC32C (seed 0) of a completed request submitted with the CRC flag: 0 and *crc set; 1 not
// done; -1 unknown request; -2 submitted without the flag or failed.
INF_API int inf_aio_crc(int64_t req, uint32_t* crc) {
  auto r = get_request(req);
  if (!r) return -1;
  std::lock_guard<std::mutex> g(r->m);
  if (!r->done) return 1;
  if (!r->want_crc || r->err != 0) return -2;
  if (crc) *crc = r->crc;
  return 0;
}

// Timing of a completed request, CLOCK_MONOTONIC ns: out[0] submitted, out[1] first chunk
// taken by a worker (0: none), out[2] completed, out[3] worker time spent on CRC32C.
// Returns 0 done, 1 not done, -1 unknown request.
INF_API int inf_aio_timing(int64_t req, int64_t* out) {
  auto r = get_request(req);
  if (!r) return -1;
  std::lock_guard<std::mutex> g(r->m);
  if (!r->done) return 1;
  if (out) {
    out[0] = r->t_submit;
    out[1] = r->t_first;
    out[2] = r->t_done;
    out[3] = r->crc_ns;
  }
  return 0;
}

// Forgets a request id (its memory goes when the last worker lets go of it). The caller must
// keep the buffer alive until the request completed.
INF_API void inf_aio_release(int64_t req) {
  Engine* e = E();
  std::lock_guard<std::mutex> g(e->map_m);
  e->reqs.erase(req);
}
