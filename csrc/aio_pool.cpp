// The I/O engine's worker pool: chunked pread/pwrite with O_DIRECT, bounce buffers and the plain
// fd (the modes are described in aio.cpp), checksums inline or on the CRC threads, completion of
// requests, pool start and stop. No Python or torch headers.
#include "aio_pool.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unistd.h>

#include "aio_crc32c.h"
#include "aio_fault.h"
#include "aio_uring.h"

namespace inf_aio {

Engine* E() {
  static Engine* e = new Engine();
  return e;
}

IoRes io_loop(Handle* h, int op, bool use_direct, char* buf, uint64_t len, int64_t off) {
  IoRes res;
  int fd = use_direct ? h->fd_direct : h->fd_plain;
  while (res.done < len) {
    if (use_direct && (((off + res.done) & (kAlign - 1)) ||
                       (reinterpret_cast<uintptr_t>(buf + res.done) & (kAlign - 1)) ||
                       ((len - res.done) & (kAlign - 1)))) {
      fd = h->fd_plain;
      use_direct = false;
    }
    size_t want = static_cast<size_t>(len - res.done);
    if (want > (1ull << 30)) want = 1ull << 30;
    if (use_direct) want &= ~(kAlign - 1);
    ssize_t r;
    int ferr = fault_check(op, &want, use_direct ? kAlign : 1);
    if (ferr != 0) {
      errno = ferr;
      r = -1;
    } else if (op == kRead) {
      r = ::pread(fd, buf + res.done, want, static_cast<off_t>(off + res.done));
    } else {
      r = ::pwrite(fd, buf + res.done, want, static_cast<off_t>(off + res.done));
    }
    if (r < 0) {
      if (errno == EINTR) continue;
      res.err = errno;
      res.err_off = off + static_cast<int64_t>(res.done);
      return res;
    }
    if (r == 0) {
      res.err = (op == kRead) ? ENODATA : EIO;
      res.short_read = (op == kRead);
      res.err_off = off + static_cast<int64_t>(res.done);
      return res;
    }
    res.done += static_cast<uint64_t>(r);
  }
  return res;
}

namespace {

// Per-worker aligned bounce buffer for misaligned user buffers.
char* bounce(uint64_t need) {
  thread_local char* buf = nullptr;
  thread_local uint64_t cap = 0;
  if (cap < need) {
    std::free(buf);
    buf = nullptr;
    cap = 0;
    void* p = nullptr;
    if (posix_memalign(&p, kAlign, need) != 0) return nullptr;
    buf = static_cast<char*>(p);
    cap = need;
  }
  return buf;
}

}  // namespace

void chunk_range(const Request* r, uint64_t idx, uint64_t* start, uint64_t* len) {
  if (idx < r->nbody) {
    *start = idx * r->chunk;
    *len = r->body - *start < r->chunk ? r->body - *start : r->chunk;
  } else if (r->mode == kModePlain) {
    *start = (idx - r->nbody) * r->chunk;
    *len = r->n - *start < r->chunk ? r->n - *start : r->chunk;
  } else {
    *start = r->body;
    *len = r->n - r->body;
  }
}

namespace {

void chunk_checksum(Request* r, uint64_t idx) {
  uint64_t start = 0, len = 0;
  chunk_range(r, idx, &start, &len);
  r->chunk_crc[idx] = crc32c_bytes(r->buf + start, len);
}

IoRes run_chunk(Request* r, uint64_t idx) {
  Handle* h = r->h.get();
  if (idx < r->nbody) {
    uint64_t start = idx * r->chunk;
    uint64_t len = r->body - start < r->chunk ? r->body - start : r->chunk;
    int64_t off = r->off + static_cast<int64_t>(start);
    if (r->mode == kModeDirect) return io_loop(h, r->op, true, r->buf + start, len, off);
    // bounce
    char* b = bounce(r->chunk);
    if (b == nullptr) {  // no memory for a bounce buffer: go through the page cache instead
      return io_loop(h, r->op, false, r->buf + start, len, off);
    }
    if (r->op == kWrite) {
      std::memcpy(b, r->buf + start, len);
      return io_loop(h, r->op, true, b, len, off);
    }
    IoRes res = io_loop(h, r->op, true, b, len, off);
    std::memcpy(r->buf + start, b, res.done);
    return res;
  }
  // tail (or the whole request in plain mode, split like the body)
  if (r->mode == kModePlain) {
    uint64_t start = (idx - r->nbody) * r->chunk;
    uint64_t len = r->n - start < r->chunk ? r->n - start : r->chunk;
    return io_loop(h, r->op, false, r->buf + start, len, r->off + static_cast<int64_t>(start));
  }
  return io_loop(h, r->op, false, r->buf + r->body, r->n - r->body,
                 r->off + static_cast<int64_t>(r->body));
}

std::string errname(int err) {
  char buf[128];
  // GNU strerror_r returns char*
  const char* s = strerror_r(err, buf, sizeof(buf));
  return std::string(s ? s : "unknown error");
}

}  // namespace

void finish_request(Request* r) {
  Handle* h = r->h.get();
  {
    std::unique_lock<std::mutex> lk(r->m);
    if (r->want_crc && r->err == 0) {
      uint32_t crc = 0;
      for (uint64_t i = 0; i < r->nchunks; ++i) {
        uint64_t start = 0, len = 0;
        chunk_range(r, i, &start, &len);
        crc = i == 0 ? r->chunk_crc[0] : crc32c_combine(crc, r->chunk_crc[i], len);
      }
      r->crc = crc;
    }
    if (r->err == 0 && r->fsync && r->op == kWrite) {
      int rc;
      do {
        rc = ::fdatasync(h->fd_plain);
      } while (rc != 0 && errno == EINTR);
      if (rc != 0) {
        r->err = errno;
        r->err_off = r->off;
        r->msg = "fdatasync failed: " + errname(r->err);
      }
    }
    if (r->err != 0 && r->msg.empty()) {
      char m[320];
      if (r->short_read) {
        std::snprintf(m, sizeof(m),
                      "short read: got %llu of %llu bytes at offset %lld (end of file at offset %lld)",
                      static_cast<unsigned long long>(r->done_bytes),
                      static_cast<unsigned long long>(r->n), static_cast<long long>(r->off),
                      static_cast<long long>(r->err_off));
      } else {
        std::snprintf(m, sizeof(m), "%s failed at offset %lld after %llu of %llu bytes: %s",
                      r->op == kRead ? "read" : "write", static_cast<long long>(r->err_off),
                      static_cast<unsigned long long>(r->done_bytes),
                      static_cast<unsigned long long>(r->n), errname(r->err).c_str());
      }
      r->msg = m;
    }
    r->t_done = mono_ns();
    r->done = true;
  }
  r->cv.notify_all();
  {
    std::lock_guard<std::mutex> g(h->m);
    h->inflight--;
  }
  h->cv.notify_all();
}

void enqueue_crc(const std::shared_ptr<Request>& req, uint64_t idx) {
  Engine* e = E();
  {
    std::lock_guard<std::mutex> g(e->cm);
    e->cq.push_back(CrcTask{req, idx});
  }
  e->ccv.notify_one();
}

void account_chunk(Request* req, const IoRes& res, int64_t crc_ns, uint64_t events) {
  bool last;
  {
    std::lock_guard<std::mutex> g(req->m);
    req->crc_ns += crc_ns;
    req->done_bytes += res.done;
    if (res.err != 0 && (req->err == 0 || res.err_off < req->err_off)) {
      req->err = res.err;
      req->err_off = res.err_off;
      req->short_read = res.short_read;
    }
    req->remaining -= events;
    last = (req->remaining == 0);
  }
  if (last) finish_request(req);
}

namespace {

void worker_main() {
  Engine* e = E();
  for (;;) {
    std::shared_ptr<Request> req;
    uint64_t idx = 0;
    {
      std::unique_lock<std::mutex> lk(e->qm);
      e->qcv.wait(lk, [&] { return e->stop || !e->q.empty(); });
      if (e->q.empty()) return;  // stop requested and nothing left
      req = e->q.front();
      idx = req->next++;
      if (idx == 0) req->t_first = mono_ns();
      if (req->next >= req->nchunks) {
        e->q.pop_front();
        e->qspace.notify_all();  // waiters for q and for uq share the condition variable
      }
    }
    bool skip;
    {
      std::lock_guard<std::mutex> g(req->m);
      skip = req->err != 0;  // an earlier chunk failed: do not touch more of the file
    }
    IoRes res;
    int64_t crc_ns = 0;
    uint64_t events = 1;  // this chunk's I/O
    if (!skip && req->crc_async) {
      // a write's checksum is of the bytes it sends (the buffer must not change while the
      // request is in flight): computed beside the transfer; a read's after it
      if (req->op == kWrite) enqueue_crc(req, idx);
      res = run_chunk(req.get(), idx);
      if (req->op == kRead) {
        if (res.err == 0) enqueue_crc(req, idx); else events = 2;  // no checksum to wait for
      }
    } else if (!skip) {
      // a write's checksum is of the bytes it sends; a read's of the bytes it received
      if (req->want_crc && req->op == kWrite) {
        int64_t t0 = mono_ns();
        chunk_checksum(req.get(), idx);
        crc_ns += mono_ns() - t0;
      }
      res = run_chunk(req.get(), idx);
      if (req->want_crc && req->op == kRead && res.err == 0) {
        int64_t t0 = mono_ns();
        chunk_checksum(req.get(), idx);
        crc_ns += mono_ns() - t0;
      }
    } else if (req->crc_async) {
      events = 2;  // skipped: neither I/O nor checksum
    }
    account_chunk(req.get(), res, crc_ns, events);
  }
}

void crc_main() {
  Engine* e = E();
  for (;;) {
    CrcTask task;
    {
      std::unique_lock<std::mutex> lk(e->cm);
      e->ccv.wait(lk, [&] { return e->cstop || !e->cq.empty(); });
      if (e->cq.empty()) return;  // stop requested and nothing left
      task = std::move(e->cq.front());
      e->cq.pop_front();
    }
    Request* r = task.req.get();
    int64_t t0 = mono_ns();
    chunk_checksum(r, task.idx);
    int64_t dt = mono_ns() - t0;
    bool last;
    {
      std::lock_guard<std::mutex> g(r->m);
      r->crc_ns += dt;
      last = (--r->remaining == 0);
    }
    if (last) finish_request(r);
  }
}

}  // namespace

void ensure_pool_locked() {
  Engine* e = E();
  if (e->crc_workers.empty())
    for (int i = 0; i < e->cfg.crc_threads; ++i) e->crc_workers.emplace_back(crc_main);
  start_ring_locked();
  if (!e->workers.empty()) return;
  for (int i = 0; i < e->cfg.num_threads; ++i) e->workers.emplace_back(worker_main);
}

void stop_pool_locked() {
  Engine* e = E();
  stop_ring_locked();  // first: it queues checksums for the CRC threads
  {
    std::lock_guard<std::mutex> g(e->qm);
    e->stop = true;
  }
  e->qcv.notify_all();
  for (auto& t : e->workers) t.join();
  e->workers.clear();
  {
    std::lock_guard<std::mutex> g(e->qm);
    e->stop = false;
  }
  // no worker left to queue checksums: the CRC threads finish what is queued and stop
  {
    std::lock_guard<std::mutex> g(e->cm);
    e->cstop = true;
  }
  e->ccv.notify_all();
  for (auto& t : e->crc_workers) t.join();
  e->crc_workers.clear();
  std::lock_guard<std::mutex> g(e->cm);
  e->cstop = false;
}

std::shared_ptr<Handle> get_handle(int64_t id) {
  Engine* e = E();
  std::lock_guard<std::mutex> g(e->map_m);
  auto it = e->handles.find(id);
  return it == e->handles.end() ? nullptr : it->second;
}

std::shared_ptr<Request> get_request(int64_t id) {
  Engine* e = E();
  std::lock_guard<std::mutex> g(e->map_m);
  auto it = e->reqs.find(id);
  return it == e->reqs.end() ? nullptr : it->second;
}

}  // namespace inf_aio
