// Aligned host memory for infinity's pinned and staging buffers (inf_mem_alloc / inf_mem_free).
// No Python or torch headers: plain C ABI, loaded through ctypes.
//
// Aligned host memory is mapped on its own (anonymous mmap), never taken from malloc's heap:
// the engine's buffers live for the whole run, and inside the heap they would sit between the
// short-lived temporaries of forward and backward, which then could not coalesce and would
// keep growing the heap (measured: RSS growth from 0.26x to 0.87-1.16x the model in some runs
// once glibc served those temporaries from the heap).
#include <cstddef>
#include <cstdint>
#include <sys/mman.h>
#include <unistd.h>

#include "common.h"

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

// The pages are zero until written, and not resident until touched. alignment: a power of two
// >= sizeof(void*); above the page size the mapping is over-sized and its ends unmapped.
// mlock'ed when lock != 0 and allowed (*locked reports it). NULL on failure.
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
