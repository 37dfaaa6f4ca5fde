// io_uring backend: ring threads (four by default, $INFINITY_IO_URING_THREADS), each with its own
// ring, keep up to num_threads chunks of direct-mode requests in flight together through
// IORING_OP_READV/WRITEV (raw syscalls, no liburing). Same semantics as the
// worker path: a partial transfer is finished synchronously with io_loop (which moves to the
// plain fd when the position is no longer aligned: short reads at end of file), EINTR/EAGAIN
// completions are resubmitted, errors carry the failing offset, checksums go to the CRC threads
// (a write's before its transfer is submitted: the bytes it sends) and fault injection is
// checked once per chunk before submission (the synchronous remainder checks it again).
// Everything else (bounce and plain modes, inline checksums) stays on the worker threads.
// No Python or torch headers.
#include "aio_uring.h"

#include <cerrno>
#include <unistd.h>

#include "aio_engine.h"

#if defined(__linux__) && __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#define INF_HAVE_IO_URING 1
#endif

#ifdef INF_HAVE_IO_URING
#include <cstdlib>
#include <cstring>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <utility>

#include "aio_fault.h"
#include "aio_pool.h"
#endif

namespace inf_aio {

#ifdef INF_HAVE_IO_URING
namespace {

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

// Ring threads (each with its own ring; together num_threads chunks in flight):
// $INFINITY_IO_URING_THREADS, default 4, at most num_threads. One ring thread lost to the
// thread pool in every NVMe-step pair on the 2-core test VM (submission and completion work
// of every chunk on one thread competing with Adam and the CRC threads for the CPU); four did
// not (2026-11-29/30, `INFINITY_IO_BACKEND=io_uring INFINITY_IO_URING_THREADS=N
// OMP_NUM_THREADS=2 python benchmarks/bench_nvme_step.py --rounds 2 --formats fp32`;
// benchmarks/RESULTS.md).
int ring_thread_count(int num_threads) {
  int n = 4;
  if (const char* env = std::getenv("INFINITY_IO_URING_THREADS")) {
    int v = std::atoi(env);
    if (v >= 1 && v <= 64) n = v;
  }
  return n < num_threads ? n : num_threads;
}

}  // namespace

int uring_probe() {
  Ring r;
  return r.init(4);
}

#else
int uring_probe() { return -ENOSYS; }
#endif

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

}  // namespace inf_aio
