// Test-only fault injection for the I/O engine: failing transfers after a byte budget, failing
// O_DIRECT opens. The worker pool and the io_uring backend ask fault_check before each
// transfer. No Python or torch headers.
#include "aio_fault.h"

#include <cerrno>
#include <cstdint>
#include <mutex>

#include "common.h"

namespace inf_aio {
namespace {

struct Faults {
  std::mutex m;
  int op = -1;  // -1 none, 0 read, 1 write, 2 both
  int err = 0;
  uint64_t left = 0;
  int open_err = 0;  // O_DIRECT opens fail with this errno (EINVAL: as on a filesystem
                     // without O_DIRECT support)
};

// Leaked on purpose, like the engine: worker threads may check it during process exit.
Faults* F() {
  static Faults* f = new Faults();
  return f;
}

}  // namespace

int fault_check(int op, size_t* len, size_t align) {
  Faults* f = F();
  std::lock_guard<std::mutex> g(f->m);
  if (f->op < 0 || !(f->op == 2 || f->op == op)) return 0;
  if (f->left == 0) return f->err;
  if (*len > f->left) {
    size_t allowed = f->left & ~(align - 1);
    if (allowed == 0) {
      f->left = 0;
      return f->err;
    }
    *len = allowed;
  }
  f->left -= *len;
  return 0;
}

int open_fault_errno() {
  Faults* f = F();
  std::lock_guard<std::mutex> g(f->m);
  return f->open_err;
}

}  // namespace inf_aio

// op: 0 reads, 1 writes, 2 both. After after_bytes more bytes of that kind, every transfer fails
// with err until inf_aio_clear_faults(). op 3: every O_DIRECT open fails with err (EINVAL
// simulates a filesystem without O_DIRECT; after_bytes is ignored).
INF_API int inf_aio_inject_fault(int op, int err, int64_t after_bytes) {
  if (op < 0 || op > 3 || err <= 0 || after_bytes < 0) return -EINVAL;
  inf_aio::Faults* f = inf_aio::F();
  std::lock_guard<std::mutex> g(f->m);
  if (op == 3) {
    f->open_err = err;
    return 0;
  }
  f->op = op;
  f->err = err;
  f->left = static_cast<uint64_t>(after_bytes);
  return 0;
}

INF_API void inf_aio_clear_faults(void) {
  inf_aio::Faults* f = inf_aio::F();
  std::lock_guard<std::mutex> g(f->m);
  f->op = -1;
  f->err = 0;
  f->left = 0;
  f->open_err = 0;
}
