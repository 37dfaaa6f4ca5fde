// State of the native I/O engine (csrc/aio*.cpp): handles, requests, configuration and the
// queues its threads share. Internal to the library (hidden symbols); the C ABI is in aio.cpp,
// aio_config.cpp and aio_handles.cpp. No Python or torch headers.
#pragma once
#include "common.h"

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <time.h>
#include <unordered_map>
#include <vector>

namespace inf_aio {

constexpr uint64_t kAlign = 4096;
constexpr int kRead = 0;
constexpr int kWrite = 1;

enum Mode { kModeDirect = 0, kModeBounce = 1, kModePlain = 2 };

// CLOCK_MONOTONIC in ns (the clock of Python's time.perf_counter/monotonic on Linux).
inline int64_t mono_ns() {
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
};

// The one engine of the process. Leaked on purpose: worker threads may outlive static
// destruction at process exit.
Engine* E();

}  // namespace inf_aio
