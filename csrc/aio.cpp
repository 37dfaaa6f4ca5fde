// O_DIRECT asynchronous file I/O, aligned host memory and CRC32C for infinity.
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
// No Python or torch headers here: plain C ABI, loaded through ctypes.
#include "common.h"

#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fcntl.h>
#include <memory>
#include <mutex>
#include <string>
#include <sys/mman.h>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>
#include <unordered_map>
#include <vector>
#include <atomic>
#include <chrono>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>

#if defined(__linux__) && __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#define INF_HAVE_IO_URING 1
#endif

namespace {

constexpr uint64_t kAlign = 4096;
constexpr int kRead = 0;
constexpr int kWrite = 1;

enum Mode { kModeDirect = 0, kModeBounce = 1, kModePlain = 2 };

// Defined with the CRC32C code below.
uint32_t crc32c_bytes(const void* data, uint64_t nbytes);
}  // namespace
// csrc/crc32c_fold.cpp
bool inf_crc_fold_supported();
uint32_t inf_crc_fold(uint32_t crc, const unsigned char* p, size_t n);
namespace {
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

// CLOCK_MONOTONIC in ns (the clock of Python's time.perf_counter/monotonic on Linux).
int64_t mono_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000ll + ts.tv_nsec;
}

struct Handle {
  int fd_plain = -1;
  int fd_direct = -1;
  bool direct = false;
  std::string path;
  std::mutex m;
  std::condition_variable cv;
  int inflight = 0;
  bool closed = false;
};

struct Request {
  int64_t id = 0;
  std::shared_ptr<Handle> h;
  int op = kRead;
  char* buf = nullptr;
  uint64_t n = 0;
  int64_t off = 0;
  bool fsync = false;
  bool want_crc = false;            // CRC32C of the transferred bytes, per chunk, in the workers
  bool urgent = false;  // queued ahead of the requests that are not (parameter fetches)
  bool crc_async = false;           // ... by the CRC threads, beside the I/O (else inline)
  std::vector<uint32_t> chunk_crc;  // one per chunk (written by the worker that ran it)
  uint32_t crc = 0;                 // the whole request's CRC32C (combined at completion)
  int mode = kModePlain;
  uint64_t body = 0;    // bytes served through the direct fd (or the bounce buffer)
  uint64_t chunk = 0;   // chunk size for this request
  uint64_t nbody = 0;   // number of body chunks
  uint64_t nchunks = 0; // body chunks + tail chunks
  uint64_t next = 0;    // next chunk to hand out (guarded by the queue mutex)

  std::mutex m;
  std::condition_variable cv;
  uint64_t remaining = 0;
  uint64_t done_bytes = 0;
  int err = 0;
  int64_t err_off = 0;
  bool short_read = false;
  bool done = false;
  std::string msg;
  // timing (CLOCK_MONOTONIC ns): submitted, first chunk taken by a worker, completed; and the
  // worker time spent on CRC32C (summed over chunks; guarded by m)
  int64_t t_submit = 0;
  int64_t t_first = 0;
  int64_t t_done = 0;
  int64_t crc_ns = 0;
};

struct Config {
  int num_threads = 16;
  uint64_t chunk_bytes = 8ull << 20;
  int queue_depth = 256;
  int crc_threads = 2;  // 0: the I/O worker checksums its chunk itself (inline)
  int backend = 0;      // 0 thread pool only, 1 io_uring ring thread(s) for direct requests
};

struct CrcTask {
  std::shared_ptr<Request> req;
  uint64_t idx;
};

struct Engine {
  std::mutex qm;
  std::condition_variable qcv;     // work available / stop
  std::condition_variable qspace;  // room in the queue
  std::deque<std::shared_ptr<Request>> q;
  std::vector<std::thread> workers;
  bool stop = false;
  // CRC threads: checksum chunks off the I/O workers, so a worker goes on with the next
  // chunk's I/O at once (the disk keeps its queue depth while the CPU checksums)
  std::mutex cm;
  std::condition_variable ccv;
  std::deque<CrcTask> cq;
  std::vector<std::thread> crc_workers;
  bool cstop = false;
  // io_uring: ring threads serve direct-mode requests (guarded by qm, like q)
  std::deque<std::shared_ptr<Request>> uq;
  std::condition_variable ucv;  // ring work available / stop
  std::vector<std::thread> ring_threads;
  bool ring_on = false;    // the ring threads run and take new direct requests
  bool ring_stop = false;
  int ring_error = 0;      // errno of the last failed io_uring setup (0: none)
  int ring_waiting = 0;       // ring threads waiting in io_uring_enter with free slots
  int ring_evfd = -1;         // eventfd it polls through the ring: a submit wakes it
  std::atomic<uint64_t> ring_chunks{0};  // chunks submitted through io_uring (ever)
  Config cfg;
  std::mutex cfg_m;  // serialises configure() / pool start

  std::mutex map_m;
  std::unordered_map<int64_t, std::shared_ptr<Request>> reqs;
  std::unordered_map<int64_t, std::shared_ptr<Handle>> handles;
  int64_t next_req = 1;
  int64_t next_handle = 1;

  std::mutex fault_m;
  int fault_op = -1;  // -1 none, 0 read, 1 write, 2 both
  int fault_errno = 0;
  uint64_t fault_left = 0;
  int open_fault_errno = 0;  // O_DIRECT opens fail with this errno (EINVAL: as on a filesystem
                             // without O_DIRECT support)
};

// Leaked on purpose: worker threads may outlive static destruction at process exit.
Engine* E() {
  static Engine* e = new Engine();
  return e;
}

// Fault injection: returns an errno to fail with now, or 0 (and may shorten *len). With
// O_DIRECT (``align`` > 1) a shortened length is rounded down to the alignment, so the fault
// is the injected errno and never an EINVAL from an unaligned transfer.
int fault_check(int op, size_t* len, size_t align) {
  Engine* e = E();
  std::lock_guard<std::mutex> g(e->fault_m);
  if (e->fault_op < 0 || !(e->fault_op == 2 || e->fault_op == op)) return 0;
  if (e->fault_left == 0) return e->fault_errno;
  if (*len > e->fault_left) {
    size_t allowed = e->fault_left & ~(align - 1);
    if (allowed == 0) {
      e->fault_left = 0;
      return e->fault_errno;
    }
    *len = allowed;
  }
  e->fault_left -= *len;
  return 0;
}

struct IoRes {
  uint64_t done = 0;
  int err = 0;
  int64_t err_off = 0;
  bool short_read = false;
};

// Transfers len bytes, retrying EINTR and partial transfers. A partial O_DIRECT transfer that
// leaves the position misaligned continues through the plain fd.
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

// The buffer range [start, start + len) that chunk idx of a request covers.
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

// Records one chunk's outcome (bytes, the error with the lowest offset, CRC time) and retires
// ``events`` of the request's pending events; the last one completes the request.
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

// ---------------------------------------------------------------------------------------------
// io_uring backend: ring threads (four by default, $INFINITY_IO_URING_THREADS), each with its own
// ring, keep up to num_threads chunks of direct-mode requests in flight together through
// IORING_OP_READV/WRITEV (raw syscalls, no liburing). Same semantics as the
// worker path: a partial transfer is finished synchronously with io_loop (which moves to the
// plain fd when the position is no longer aligned: short reads at end of file), EINTR/EAGAIN
// completions are resubmitted, errors carry the failing offset, checksums go to the CRC threads
// (a write's before its transfer is submitted: the bytes it sends) and fault injection is
// checked once per chunk before submission (the synchronous remainder checks it again).
// Everything else (bounce and plain modes, inline checksums) stays on the worker threads.
// ---------------------------------------------------------------------------------------------
#ifdef INF_HAVE_IO_URING
int sys_uring_setup(unsigned entries, io_uring_params* p) {
  return static_cast<int>(::syscall(__NR_io_uring_setup, entries, p));
}

int sys_uring_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
  return static_cast<int>(
      ::syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0));
}

struct Ring {
  int fd = -1;
  void* sq_ptr = MAP_FAILED;
  size_t sq_sz = 0;
  void* cq_ptr = MAP_FAILED;
  size_t cq_sz = 0;
  void* sqe_ptr = MAP_FAILED;
  size_t sqe_sz = 0;
  unsigned* sq_tail = nullptr;
  unsigned sq_mask = 0;
  unsigned* sq_array = nullptr;
  io_uring_sqe* sqes = nullptr;
  unsigned* cq_head = nullptr;
  unsigned* cq_tail = nullptr;
  unsigned cq_mask = 0;
  io_uring_cqe* cqes = nullptr;
  unsigned entries = 0;

  Ring() = default;
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;
  ~Ring() {
    if (sqe_ptr != MAP_FAILED) ::munmap(sqe_ptr, sqe_sz);
    if (cq_ptr != MAP_FAILED && cq_ptr != sq_ptr) ::munmap(cq_ptr, cq_sz);
    if (sq_ptr != MAP_FAILED) ::munmap(sq_ptr, sq_sz);
    if (fd >= 0) ::close(fd);
  }

  // 0, or -errno (ENOSYS: kernel without io_uring; EPERM: io_uring_disabled / seccomp).
  int init(unsigned want) {
    io_uring_params p;
    std::memset(&p, 0, sizeof(p));
    fd = sys_uring_setup(want, &p);
    if (fd < 0) return -errno;
    entries = p.sq_entries;
    sq_sz = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    cq_sz = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    const bool single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single) sq_sz = cq_sz = (sq_sz > cq_sz ? sq_sz : cq_sz);
    sq_ptr = ::mmap(nullptr, sq_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                    IORING_OFF_SQ_RING);
    if (sq_ptr == MAP_FAILED) return -errno;
    if (single) {
      cq_ptr = sq_ptr;
    } else {
      cq_ptr = ::mmap(nullptr, cq_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                      IORING_OFF_CQ_RING);
      if (cq_ptr == MAP_FAILED) return -errno;
    }
    sqe_sz = p.sq_entries * sizeof(io_uring_sqe);
    sqe_ptr = ::mmap(nullptr, sqe_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                     IORING_OFF_SQES);
    if (sqe_ptr == MAP_FAILED) return -errno;
    char* sq = static_cast<char*>(sq_ptr);
    char* cq = static_cast<char*>(cq_ptr);
    sq_tail = reinterpret_cast<unsigned*>(sq + p.sq_off.tail);
    sq_mask = *reinterpret_cast<unsigned*>(sq + p.sq_off.ring_mask);
    sq_array = reinterpret_cast<unsigned*>(sq + p.sq_off.array);
    sqes = static_cast<io_uring_sqe*>(sqe_ptr);
    cq_head = reinterpret_cast<unsigned*>(cq + p.cq_off.head);
    cq_tail = reinterpret_cast<unsigned*>(cq + p.cq_off.tail);
    cq_mask = *reinterpret_cast<unsigned*>(cq + p.cq_off.ring_mask);
    cqes = reinterpret_cast<io_uring_cqe*>(cq + p.cq_off.cqes);
    return 0;
  }

  // Lets io_uring's kernel workers run up to n blocking transfers at once (requests the
  // filesystem cannot start without blocking, e.g. ext4 O_DIRECT writes into unwritten extents,
  // are handed to them; their default cap, 4 per CPU, would cut the queue depth on small
  // machines). IORING_REGISTER_IOWQ_MAX_WORKERS (19) is Linux >= 5.15; older kernels keep the
  // default. Best effort.
  void set_max_workers(unsigned n) {
    unsigned vals[2] = {n, 0};  // bounded (regular files), unbounded: unchanged
    (void)::syscall(__NR_io_uring_register, fd, 19u, vals, 2u);
  }

  // Queues one SQE (the caller keeps at most `entries` unsubmitted).
  void push(uint8_t opcode, int fd_io, const iovec* iov, int64_t off, uint64_t user_data) {
    unsigned tail = *sq_tail;  // only this thread writes the tail
    unsigned idx = tail & sq_mask;
    io_uring_sqe* sqe = &sqes[idx];
    std::memset(sqe, 0, sizeof(*sqe));
    sqe->opcode = opcode;
    sqe->fd = fd_io;
    sqe->addr = reinterpret_cast<uint64_t>(iov);
    sqe->len = 1;
    sqe->off = static_cast<uint64_t>(off);
    sqe->user_data = user_data;
    sq_array[idx] = idx;
    __atomic_store_n(sq_tail, tail + 1, __ATOMIC_RELEASE);
  }
};

// One chunk in flight on the ring.
struct RingSlot {
  std::shared_ptr<Request> req;
  uint64_t idx = 0;
  char* buf = nullptr;
  uint64_t len = 0;   // the whole chunk
  uint64_t sent = 0;  // bytes asked of the kernel (len, or less when a fault shortened it)
  int64_t off = 0;
  bool direct = false;
  iovec iov{};
};

// The chunk's outcome after the kernel transferred r bytes (or failed with -r): a partial
// transfer is completed synchronously.
IoRes ring_outcome(RingSlot* s, int r) {
  IoRes res;
  Request* req = s->req.get();
  if (r < 0) {
    res.err = -r;
    res.err_off = s->off;
    return res;
  }
  if (r == 0 && s->sent > 0) {
    res.err = req->op == kRead ? ENODATA : EIO;
    res.short_read = req->op == kRead;
    res.err_off = s->off;
    return res;
  }
  res.done = static_cast<uint64_t>(r);
  if (res.done < s->len) {
    IoRes rest = io_loop(req->h.get(), req->op, s->direct, s->buf + res.done, s->len - res.done,
                         s->off + static_cast<int64_t>(res.done));
    res.done += rest.done;
    res.err = rest.err;
    res.err_off = rest.err_off;
    res.short_read = rest.short_read;
  }
  return res;
}

void ring_retire(RingSlot* s, const IoRes& res) {
  Request* req = s->req.get();
  uint64_t events = 1;
  if (req->crc_async && req->op == kRead) {
    if (res.err == 0) enqueue_crc(s->req, s->idx); else events = 2;  // no checksum to wait for
  }
  account_chunk(req, res, 0, events);
  s->req.reset();
}

constexpr uint64_t kPollTag = ~0ull;  // user_data of the eventfd poll

void arm_poll(Ring* ring, int evfd, std::vector<int>* unsent) {
  ring->push(IORING_OP_POLL_ADD, evfd, nullptr, 0, kPollTag);
  io_uring_sqe* sqe = &ring->sqes[(*ring->sq_tail - 1) & ring->sq_mask];
  sqe->len = 0;
  sqe->poll_events = POLLIN;
  unsent->push_back(-1);
}

void ring_main(Ring* ring, int depth, int evfd) {
  Engine* e = E();
  std::vector<RingSlot> slots(static_cast<size_t>(depth));
  std::vector<int> free_slots;
  for (int i = depth - 1; i >= 0; --i) free_slots.push_back(i);
  std::vector<std::pair<std::shared_ptr<Request>, uint64_t>> taken;
  std::vector<int> unsent;  // slots queued in the SQ ring, not yet accepted by io_uring_enter
  int inflight = 0;         // slots in use (queued or in the kernel)
  bool broken = false;      // io_uring_enter failed hard: finish everything synchronously
  // While the thread waits for completions with free slots, a new request wakes it through
  // the eventfd polled on the ring (else it would wait for the next completion).
  if (evfd >= 0) arm_poll(ring, evfd, &unsent);
  for (;;) {
    taken.clear();
    {
      std::unique_lock<std::mutex> lk(e->qm);
      if (inflight == 0) {
        e->ucv.wait(lk, [&] { return e->ring_stop || !e->uq.empty(); });
        if (e->uq.empty()) break;  // stop requested and nothing left
      }
      while (taken.size() < free_slots.size() && !e->uq.empty()) {
        std::shared_ptr<Request> req = e->uq.front();
        uint64_t idx = req->next++;
        if (idx == 0) req->t_first = mono_ns();
        if (req->next >= req->nchunks) {
          e->uq.pop_front();
          e->qspace.notify_all();
        }
        taken.emplace_back(std::move(req), idx);
      }
    }
    for (auto& t : taken) {
      Request* req = t.first.get();
      uint64_t idx = t.second;
      bool skip;
      {
        std::lock_guard<std::mutex> g(req->m);
        skip = req->err != 0;  // an earlier chunk failed: do not touch more of the file
      }
      if (skip) {
        account_chunk(req, IoRes(), 0, req->crc_async ? 2 : 1);
        continue;
      }
      if (req->crc_async && req->op == kWrite) enqueue_crc(t.first, idx);
      int si = free_slots.back();
      free_slots.pop_back();
      RingSlot& s = slots[static_cast<size_t>(si)];
      s.req = t.first;
      s.idx = idx;
      uint64_t start = 0;
      chunk_range(req, idx, &start, &s.len);
      s.buf = req->buf + start;
      s.off = req->off + static_cast<int64_t>(start);
      s.direct = idx < req->nbody;  // the tail (< 4096 bytes) goes through the plain fd
      size_t want = static_cast<size_t>(s.len);
      int ferr = fault_check(req->op, &want, s.direct ? kAlign : 1);
      if (ferr != 0 || broken) {
        IoRes res;
        if (ferr != 0) {
          res.err = ferr;
          res.err_off = s.off;
        } else {
          res = io_loop(req->h.get(), req->op, s.direct, s.buf, s.len, s.off);
        }
        ring_retire(&s, res);
        free_slots.push_back(si);
        continue;
      }
      s.sent = want;
      s.iov.iov_base = s.buf;
      s.iov.iov_len = want;
      ring->push(req->op == kRead ? IORING_OP_READV : IORING_OP_WRITEV,
                 s.direct ? req->h->fd_direct : req->h->fd_plain, &s.iov, s.off,
                 static_cast<uint64_t>(si));
      unsent.push_back(si);
      ++inflight;
      e->ring_chunks.fetch_add(1, std::memory_order_relaxed);
    }
    if (inflight == 0) continue;
    // Submit what is queued; wait for a completion when no more work can be taken now.
    bool more_work, waiting;
    {
      std::lock_guard<std::mutex> g(e->qm);
      more_work = !e->uq.empty() && !free_slots.empty();
      waiting = !more_work && !free_slots.empty() && evfd >= 0 && !broken;
      if (waiting) ++e->ring_waiting;
    }
    unsigned min_complete = more_work ? 0 : 1;
    int rc = sys_uring_enter(ring->fd, static_cast<unsigned>(unsent.size()), min_complete,
                             min_complete ? IORING_ENTER_GETEVENTS : 0);
    if (waiting) {
      std::lock_guard<std::mutex> g(e->qm);
      --e->ring_waiting;
    }
    if (rc < 0) {
      int err = errno;
      if (err != EINTR && err != EAGAIN && err != EBUSY) {
        // The ring is unusable: finish the chunks it never accepted synchronously and stop
        // submitting (the accepted ones still complete through the CQ ring).
        broken = true;
        for (int si : unsent) {
          if (si < 0) continue;  // the eventfd poll
          RingSlot& s = slots[static_cast<size_t>(si)];
          Request* req = s.req.get();
          ring_retire(&s, io_loop(req->h.get(), req->op, s.direct, s.buf, s.len, s.off));
          free_slots.push_back(si);
          --inflight;
        }
        unsent.clear();
        if (inflight > 0 && sys_uring_enter(ring->fd, 0, 1, IORING_ENTER_GETEVENTS) < 0 &&
            errno != EINTR) {
          // cannot even reap: fail what is left rather than hang (the kernel may still own
          // these buffers, so the caller sees an error, never success)
          for (size_t i = 0; i < slots.size(); ++i) {
            RingSlot& s = slots[i];
            if (!s.req) continue;
            IoRes res;
            res.err = err;
            res.err_off = s.off;
            ring_retire(&s, res);
            free_slots.push_back(static_cast<int>(i));
            --inflight;
          }
        }
      }
    } else {
      unsent.erase(unsent.begin(), unsent.begin() + rc);
    }
    // Reap completions.
    unsigned head = *ring->cq_head;
    unsigned tail = __atomic_load_n(ring->cq_tail, __ATOMIC_ACQUIRE);
    std::vector<std::pair<int, int>> done;  // (slot, res)
    bool rearm = false;
    while (head != tail) {
      const io_uring_cqe* cqe = &ring->cqes[head & ring->cq_mask];
      if (cqe->user_data == kPollTag) rearm = true;
      else done.emplace_back(static_cast<int>(cqe->user_data), cqe->res);
      ++head;
    }
    __atomic_store_n(ring->cq_head, head, __ATOMIC_RELEASE);
    if (rearm) {
      uint64_t v;
      while (::read(evfd, &v, sizeof(v)) == static_cast<ssize_t>(sizeof(v))) {
      }
      if (!broken) arm_poll(ring, evfd, &unsent);
    }
    for (auto& d : done) {
      RingSlot& s = slots[static_cast<size_t>(d.first)];
      if (!s.req) continue;  // already failed above
      if ((d.second == -EINTR || d.second == -EAGAIN) && !broken) {
        Request* req = s.req.get();
        ring->push(req->op == kRead ? IORING_OP_READV : IORING_OP_WRITEV,
                   s.direct ? req->h->fd_direct : req->h->fd_plain, &s.iov, s.off,
                   static_cast<uint64_t>(d.first));
        unsent.push_back(d.first);
        continue;
      }
      // EINVAL / EOPNOTSUPP: an operation this kernel or filesystem does not take through
      // io_uring (where pread/pwrite may still work): the chunk again, synchronously; a real
      // EINVAL comes back from there
      const bool sync = d.second == -EINTR || d.second == -EAGAIN || d.second == -EINVAL ||
                        d.second == -EOPNOTSUPP;
      IoRes res = sync ? io_loop(s.req->h.get(), s.req->op, s.direct, s.buf, s.len, s.off)
                       : ring_outcome(&s, d.second);
      ring_retire(&s, res);
      free_slots.push_back(d.first);
      --inflight;
    }
  }
  delete ring;
}

// 0 when an io_uring can be set up here, else -errno.
int uring_probe() {
  Ring r;
  return r.init(4);
}
// Ring threads (each with its own ring; together num_threads chunks in flight):
// $INFINITY_IO_URING_THREADS, default 4, at most num_threads. One ring thread lost to the
// thread pool in every NVMe-step pair on the 2-core test VM (submission and completion work
// of every chunk on one thread competing with Adam and the CRC threads for the CPU); four did
// not (benchmarks/RESULTS.md, "io_uring backend").
int ring_thread_count(int num_threads) {
  int n = 4;
  if (const char* env = std::getenv("INFINITY_IO_URING_THREADS")) {
    int v = std::atoi(env);
    if (v >= 1 && v <= 64) n = v;
  }
  return n < num_threads ? n : num_threads;
}

#else
int uring_probe() { return -ENOSYS; }
#endif

// Starts the ring threads when the io_uring backend is selected. A ring that cannot be set up
// now (it could when the backend was chosen) leaves the thread pool in charge. Caller holds cfg_m.
void start_ring_locked() {
#ifdef INF_HAVE_IO_URING
  Engine* e = E();
  if (e->cfg.backend != 1 || !e->ring_threads.empty()) return;
  const int nrings = ring_thread_count(e->cfg.num_threads);
  std::vector<std::pair<Ring*, int>> rings;
  for (int i = 0; i < nrings; ++i) {
    int depth = e->cfg.num_threads / nrings + (i < e->cfg.num_threads % nrings ? 1 : 0);
    Ring* ring = new Ring();
    int rc = ring->init(static_cast<unsigned>(depth) + 1);  // + the eventfd poll
    if (rc != 0) {
      delete ring;
      if (rings.empty()) {
        e->cfg.backend = 0;
        e->ring_error = -rc;
        return;
      }
      break;  // fewer rings (fewer chunks in flight) rather than none
    }
    if (static_cast<unsigned>(depth) + 1 > ring->entries) depth = static_cast<int>(ring->entries) - 1;
    ring->set_max_workers(static_cast<unsigned>(depth));
    rings.emplace_back(ring, depth);
  }
  int evfd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);  // -1: no wake-ups, still correct
  {
    std::lock_guard<std::mutex> g(e->qm);
    e->ring_on = true;
    e->ring_stop = false;
    e->ring_evfd = evfd;
  }
  for (auto& r : rings) e->ring_threads.emplace_back(ring_main, r.first, r.second, evfd);
#endif
}

// Stops the ring threads after they finished every queued and in-flight chunk. Caller holds cfg_m.
void stop_ring_locked() {
  Engine* e = E();
  if (e->ring_threads.empty()) return;
  {
    std::lock_guard<std::mutex> g(e->qm);
    e->ring_on = false;  // new requests go to the workers from now on
    e->ring_stop = true;
  }
  e->ucv.notify_all();
  for (auto& t : e->ring_threads) t.join();
  e->ring_threads.clear();
  std::lock_guard<std::mutex> g(e->qm);
  e->ring_stop = false;
  e->ring_waiting = 0;
  if (e->ring_evfd >= 0) ::close(e->ring_evfd);  // under qm: submitters write it under qm
  e->ring_evfd = -1;
}

// Starts the pool if needed. Caller holds cfg_m.
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

}  // namespace

// ---------------------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// Handles
// ---------------------------------------------------------------------------------------------

// mode: 0 "r" (read only), 1 "r+" (read/write, must exist), 2 "w+" (read/write, create or
// truncate), 3 "c+" (read/write, create if missing, keep contents).
// want_direct: try O_DIRECT. *direct_out: 1 when the O_DIRECT fd is open, 0 when the
// filesystem refused it (EINVAL) or it was not asked for.
// Returns a handle id > 0, or -errno.
INF_API int64_t inf_aio_open(const char* path, int mode, int want_direct, int* direct_out) {
  if (direct_out) *direct_out = 0;
  if (path == nullptr) return -EINVAL;
  int flags;
  switch (mode) {
    case 0: flags = O_RDONLY; break;
    case 1: flags = O_RDWR; break;
    case 2: flags = O_RDWR | O_CREAT | O_TRUNC; break;
    case 3: flags = O_RDWR | O_CREAT; break;
    default: return -EINVAL;
  }
  int fd_plain;
  do {
    fd_plain = ::open(path, flags | O_CLOEXEC, 0644);
  } while (fd_plain < 0 && errno == EINTR);
  if (fd_plain < 0) return -errno;
  struct stat st;
  if (::fstat(fd_plain, &st) != 0) {
    int err = errno;
    ::close(fd_plain);
    return -err;
  }
  if (S_ISDIR(st.st_mode)) {
    ::close(fd_plain);
    return -EISDIR;
  }
  int fd_direct = -1;
  if (want_direct) {
    int dflags = (flags & ~(O_CREAT | O_TRUNC)) | O_DIRECT | O_CLOEXEC;
    int injected;
    {
      Engine* e = E();
      std::lock_guard<std::mutex> g(e->fault_m);
      injected = e->open_fault_errno;
    }
    if (injected != 0) {
      errno = injected;
    } else {
      do {
        fd_direct = ::open(path, dflags);
      } while (fd_direct < 0 && errno == EINTR);
    }
    if (fd_direct < 0 && errno != EINVAL) {  // EINVAL: filesystem without O_DIRECT -> buffered
      int err = errno;
      ::close(fd_plain);
      return -err;
    }
  }
  auto h = std::make_shared<Handle>();
  h->fd_plain = fd_plain;
  h->fd_direct = fd_direct;
  h->direct = fd_direct >= 0;
  h->path = path;
  if (direct_out) *direct_out = h->direct ? 1 : 0;
  Engine* e = E();
  std::lock_guard<std::mutex> g(e->map_m);
  int64_t id = e->next_handle++;
  e->handles[id] = h;
  return id;
}

// Waits for the handle's in-flight requests, then closes its fds. Double close: 0 (no-op).
// Returns 0, or -errno from close(2) (the data of completed requests is still on the file).
INF_API int inf_aio_close(int64_t handle) {
  Engine* e = E();
  std::shared_ptr<Handle> h;
  {
    std::lock_guard<std::mutex> g(e->map_m);
    auto it = e->handles.find(handle);
    if (it == e->handles.end()) return 0;
    h = it->second;
    e->handles.erase(it);
  }
  std::unique_lock<std::mutex> lk(h->m);
  if (h->closed) return 0;
  h->closed = true;
  h->cv.wait(lk, [&] { return h->inflight == 0; });
  int rc = 0;
  if (h->fd_direct >= 0 && ::close(h->fd_direct) != 0 && errno != EINTR) rc = -errno;
  if (h->fd_plain >= 0 && ::close(h->fd_plain) != 0 && errno != EINTR && rc == 0) rc = -errno;
  h->fd_direct = h->fd_plain = -1;
  return rc;
}

INF_API int inf_aio_is_direct(int64_t handle) {
  auto h = get_handle(handle);
  if (!h) return -EBADF;
  return h->direct ? 1 : 0;
}

// Number of requests of this handle that have not completed, or -EBADF.
INF_API int inf_aio_inflight(int64_t handle) {
  auto h = get_handle(handle);
  if (!h) return -EBADF;
  std::lock_guard<std::mutex> g(h->m);
  return h->inflight;
}

INF_API int64_t inf_aio_size(int64_t handle) {
  auto h = get_handle(handle);
  if (!h) return -EBADF;
  struct stat st;
  if (::fstat(h->fd_plain, &st) != 0) return -errno;
  return static_cast<int64_t>(st.st_size);
}

INF_API int inf_aio_fsync(int64_t handle) {
  auto h = get_handle(handle);
  if (!h) return -EBADF;
  int rc;
  do {
    rc = ::fsync(h->fd_plain);
  } while (rc != 0 && errno == EINTR);
  return rc == 0 ? 0 : -errno;
}

INF_API int inf_aio_truncate(int64_t handle, int64_t nbytes) {
  if (nbytes < 0) return -EINVAL;
  auto h = get_handle(handle);
  if (!h) return -EBADF;
  int rc;
  do {
    rc = ::ftruncate(h->fd_plain, static_cast<off_t>(nbytes));
  } while (rc != 0 && errno == EINTR);
  return rc == 0 ? 0 : -errno;
}

// Reserves nbytes of disk (posix_fallocate: ENOSPC now instead of during a later write) and
// sets the file size to exactly nbytes.
INF_API int inf_aio_allocate(int64_t handle, int64_t nbytes) {
  if (nbytes < 0) return -EINVAL;
  auto h = get_handle(handle);
  if (!h) return -EBADF;
  if (nbytes > 0) {
    int rc;
    do {
      rc = ::posix_fallocate(h->fd_plain, 0, static_cast<off_t>(nbytes));
    } while (rc == EINTR);
    if (rc != 0) return -rc;
  }
  int rc;
  do {
    rc = ::ftruncate(h->fd_plain, static_cast<off_t>(nbytes));
  } while (rc != 0 && errno == EINTR);
  return rc == 0 ? 0 : -errno;
}

// ---------------------------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// Test-only fault injection
// ---------------------------------------------------------------------------------------------

// op: 0 reads, 1 writes, 2 both. After after_bytes more bytes of that kind, every transfer fails
// with err until inf_aio_clear_faults(). op 3: every O_DIRECT open fails with err (EINVAL
// simulates a filesystem without O_DIRECT; after_bytes is ignored).
INF_API int inf_aio_inject_fault(int op, int err, int64_t after_bytes) {
  if (op < 0 || op > 3 || err <= 0 || after_bytes < 0) return -EINVAL;
  Engine* e = E();
  std::lock_guard<std::mutex> g(e->fault_m);
  if (op == 3) {
    e->open_fault_errno = err;
    return 0;
  }
  e->fault_op = op;
  e->fault_errno = err;
  e->fault_left = static_cast<uint64_t>(after_bytes);
  return 0;
}

INF_API void inf_aio_clear_faults(void) {
  Engine* e = E();
  std::lock_guard<std::mutex> g(e->fault_m);
  e->fault_op = -1;
  e->fault_errno = 0;
  e->fault_left = 0;
  e->open_fault_errno = 0;
}

// ---------------------------------------------------------------------------------------------
// Aligned host memory
// ---------------------------------------------------------------------------------------------

// Aligned host memory is mapped on its own (anonymous mmap), never taken from malloc's heap:
// the engine's buffers live for the whole run, and inside the heap they would sit between the
// short-lived temporaries of forward and backward, which then could not coalesce and would
// keep growing the heap (measured: RSS growth from 0.26x to 0.87-1.16x the model in some runs
// once glibc served those temporaries from the heap). The pages are zero until written, and
// not resident until touched. alignment: a power of two >= sizeof(void*); above the page size
// the mapping is over-sized and its ends unmapped. mlock'ed when lock != 0 and allowed
// (*locked reports it). NULL on failure.
namespace {
size_t page_size() {
  static const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return page;
}
size_t mapped_size(int64_t nbytes) {
  const size_t page = page_size();
  const size_t n = nbytes <= 0 ? 1 : static_cast<size_t>(nbytes);
  return (n + page - 1) / page * page;
}
}  // namespace

INF_API void* inf_mem_alloc(int64_t nbytes, int64_t alignment, int zero, int lock, int* locked) {
  (void)zero;  // anonymous mappings are zero-filled
  if (locked) *locked = 0;
  if (nbytes < 0 || alignment < static_cast<int64_t>(sizeof(void*)) ||
      (alignment & (alignment - 1)) != 0)
    return nullptr;
  const size_t n = mapped_size(nbytes);
  const size_t align = static_cast<size_t>(alignment);
  const size_t extra = align > page_size() ? align : 0;
  void* raw = ::mmap(nullptr, n + extra, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                     -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  char* p = static_cast<char*>(raw);
  if (extra) {
    const uintptr_t addr = reinterpret_cast<uintptr_t>(raw);
    char* aligned = p + ((align - addr % align) % align);
    const size_t head = static_cast<size_t>(aligned - p);
    if (head) ::munmap(p, head);
    const size_t tail = extra - head;
    if (tail) ::munmap(aligned + n, tail);
    p = aligned;
  }
  if (lock && ::mlock(p, n) == 0 && locked) *locked = 1;
  return p;
}

// nbytes: as given to inf_mem_alloc (the mapping's size is derived from it).
INF_API void inf_mem_free(void* ptr, int64_t nbytes, int locked) {
  if (ptr == nullptr) return;
  const size_t n = mapped_size(nbytes);
  if (locked) ::munlock(ptr, n);
  ::munmap(ptr, n);
}

// ---------------------------------------------------------------------------------------------
// CRC32C (Castagnoli, reflected 0x82F63B78; crc32c("123456789") == 0xE3069283)
// ---------------------------------------------------------------------------------------------
// Convention: crc32c(data, seed) continues a previous value, so
// crc32c(b, crc32c(a, 0)) == crc32c(a + b, 0). SSE4.2 path when the CPU has it (checked once at
// run time; no -march needed), slicing-by-8 tables otherwise.

namespace {

struct Crc32cTables {
  uint32_t t[8][256];
  Crc32cTables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  }
};

const Crc32cTables& crc_tables() {
  static const Crc32cTables* tables = new Crc32cTables();
  return *tables;
}

uint32_t crc32c_table(uint32_t crc, const unsigned char* p, size_t n) {
  const auto& T = crc_tables().t;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    crc = (crc >> 8) ^ T[0][(crc ^ *p++) & 0xFF];
    --n;
  }
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    v ^= crc;
    crc = T[7][v & 0xFF] ^ T[6][(v >> 8) & 0xFF] ^ T[5][(v >> 16) & 0xFF] ^
          T[4][(v >> 24) & 0xFF] ^ T[3][(v >> 32) & 0xFF] ^ T[2][(v >> 40) & 0xFF] ^
          T[1][(v >> 48) & 0xFF] ^ T[0][(v >> 56) & 0xFF];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ T[0][(crc ^ *p++) & 0xFF];
  return crc;
}

// GF(2) polynomial arithmetic modulo the (reflected) CRC32C polynomial, to combine CRCs of
// adjacent stripes: raw(A || B, init) == shift(raw(A, init), |B|) ^ raw(B, 0).
uint32_t crc_multmodp(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, prod = 0;
  for (;;) {
    if (a & m) {
      prod ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ 0x82F63B78u : b >> 1;
  }
  return prod;
}

// x^(8 * nbytes) mod P: multiplying a raw CRC by it appends nbytes zero bytes.
uint32_t crc_shift_constant(uint64_t nbytes) {
  uint32_t x2n[64];
  uint32_t p = 1u << 30;  // x^1
  x2n[0] = p;
  for (int k = 1; k < 64; ++k) x2n[k] = p = crc_multmodp(p, p);
  uint32_t result = 1u << 31;  // x^0
  unsigned k = 3;               // 8 bits per byte
  for (uint64_t n = nbytes; n; n >>= 1, ++k)
    if (n & 1) result = crc_multmodp(x2n[k & 63], result);
  return result;
}

#if defined(__x86_64__) || defined(__i386__)
#define INF_HAVE_SSE42_PATH 1
__attribute__((target("sse4.2"))) uint64_t crc32c_sse42_words(uint64_t c, const unsigned char* p,
                                                               size_t words) {
  for (size_t i = 0; i < words; ++i) {
    uint64_t a;
    std::memcpy(&a, p + 8 * i, 8);
    c = __builtin_ia32_crc32di(c, a);
  }
  return c;
}

// The crc32 instruction has a latency of 3 cycles and a throughput of 1 per cycle: three
// independent chains over three stripes keep it busy, then the stripes are combined.
constexpr size_t kCrcStripe = 16384;

__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(uint32_t crc, const unsigned char* p,
                                                         size_t n) {
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    crc = __builtin_ia32_crc32qi(crc, *p++);
    --n;
  }
  uint64_t c = crc;
  if (n >= 3 * kCrcStripe) {
    static const uint32_t shift = crc_shift_constant(kCrcStripe);
    while (n >= 3 * kCrcStripe) {
      uint64_t c0 = c, c1 = 0, c2 = 0;
      const unsigned char* q = p;
      for (size_t i = 0; i < kCrcStripe; i += 8) {
        uint64_t a, b, d;
        std::memcpy(&a, q + i, 8);
        std::memcpy(&b, q + kCrcStripe + i, 8);
        std::memcpy(&d, q + 2 * kCrcStripe + i, 8);
        c0 = __builtin_ia32_crc32di(c0, a);
        c1 = __builtin_ia32_crc32di(c1, b);
        c2 = __builtin_ia32_crc32di(c2, d);
      }
      uint32_t r = crc_multmodp(shift, static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1);
      c = crc_multmodp(shift, r) ^ static_cast<uint32_t>(c2);
      p += 3 * kCrcStripe;
      n -= 3 * kCrcStripe;
    }
  }
  c = crc32c_sse42_words(c, p, n / 8);
  p += n / 8 * 8;
  n %= 8;
  crc = static_cast<uint32_t>(c);
  while (n--) crc = __builtin_ia32_crc32qi(crc, *p++);
  return crc;
}
#endif

int crc_impl() {  // 2 folding (VPCLMULQDQ), 1 sse4.2, 0 table
  static int impl = [] {
    const char* env = std::getenv("INFINITY_CRC32C_IMPL");
    if (env && std::strcmp(env, "table") == 0) return 0;
    bool no_fold = env && std::strcmp(env, "sse42") == 0;
    if (!no_fold && inf_crc_fold_supported()) return 2;
#ifdef INF_HAVE_SSE42_PATH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2")) return 1;
#endif
    return 0;
  }();
  return impl;
}

}  // namespace

// impl: -1 automatic (folding, else SSE4.2, when available; INFINITY_CRC32C_IMPL=table|sse42
// overrides), 0 table, 1 SSE4.2, 2 VPCLMULQDQ folding (each falls back to the next simpler
// path when the CPU lacks it).
INF_API uint32_t inf_crc_crc32c_impl(const void* data, int64_t nbytes, uint32_t seed, int impl) {
  if (data == nullptr || nbytes <= 0) return seed;
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t crc = ~seed;
  if (impl < 0) impl = crc_impl();
  if (impl == 2) {
    if (inf_crc_fold_supported()) return ~inf_crc_fold(crc, p, static_cast<size_t>(nbytes));
    impl = 1;
  }
#ifdef INF_HAVE_SSE42_PATH
  if (impl == 1 && __builtin_cpu_supports("sse4.2"))
    return ~crc32c_sse42(crc, p, static_cast<size_t>(nbytes));
#endif
  return ~crc32c_table(crc, p, static_cast<size_t>(nbytes));
}

INF_API uint32_t inf_crc_crc32c(const void* data, int64_t nbytes, uint32_t seed) {
  return inf_crc_crc32c_impl(data, nbytes, seed, -1);
}

// Which path inf_crc_crc32c uses: 2 VPCLMULQDQ folding, 1 SSE4.2, 0 table.
INF_API int inf_crc_impl(void) { return crc_impl(); }

namespace {
uint32_t crc32c_bytes(const void* data, uint64_t nbytes) {
  return inf_crc_crc32c(data, static_cast<int64_t>(nbytes), 0);
}

// crc32c(A || B) from crc32c(A), crc32c(B) and |B| (the identity zlib's crc32_combine uses).
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  return crc_multmodp(crc_shift_constant(len_b), crc_a) ^ crc_b;
}
}  // namespace
