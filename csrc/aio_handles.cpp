// File handles of the I/O engine: open (a plain fd, plus an O_DIRECT fd when the filesystem
// takes it), close after in-flight requests, size, fsync, truncate, allocate. C ABI, loaded
// through ctypes; no Python or torch headers.
#include <cerrno>
#include <cstdint>
#include <fcntl.h>
#include <memory>
#include <mutex>
#include <sys/stat.h>
#include <unistd.h>

#include "aio_engine.h"
#include "aio_fault.h"
#include "aio_pool.h"
#include "common.h"

using namespace inf_aio;

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
    int injected = open_fault_errno();
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
