"""The NVMe tier: one swap file per key under a private directory of the user's nvme_path."""

from __future__ import annotations

import errno as errno_mod
import fcntl
import functools
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import torch

from .. import io as inf_io
from .extents import RangeSet

logger = logging.getLogger(__name__)

IOResult = Union["inf_io.IOFuture", "PieceFutures"]

_DIR_PREFIX = "infinity-swap-"
_LOCK_NAME = ".lock"  # held (flock, exclusive) by the live store owning the directory
_STALE_GRACE_S = 60.0  # a directory without a lock file younger than this is being created
# flock errors meaning "this filesystem cannot lock", as opposed to "someone holds it"
_NOLOCK_ERRNOS = frozenset(
    {errno_mod.ENOLCK, errno_mod.EOPNOTSUPP, errno_mod.ENOTSUP, errno_mod.ENOSYS, errno_mod.EINVAL}
)
_nolock_logged = False
# Freed ranges of a file whose extents the caller allocates stay allocated on disk, for the
# next extents, up to this many times the file's largest extent; beyond, the ranges nearest the
# file's end are given back (punched) down to one largest extent. See SwapStore.release. 3: the
# units the NVMe step has in flight with its default pipeline of 3 buffer sets, i.e. the free
# space of the state file after a step, so a steady step neither punches nor fallocates.
KEEP_FREED_EXTENTS = 3


class SwapCorruptionError(RuntimeError):
    """A swap file's content does not match the checksum recorded when it was written."""


@dataclass
class _Entry:
    """One swap file. Its bytes are checksummed in pieces of ``piece`` bytes (the last one may
    be shorter): one CRC32C per piece, so a byte range made of whole pieces can be written or
    read and verified on its own. A store whose callers always move the whole file creates
    its entries with one piece (the file): then nothing differs from one whole-file CRC."""

    handle: inf_io.FileHandle
    nbytes: int
    piece: int
    crcs: List[Optional[int]] = field(default_factory=list)
    # per piece: the write in flight whose CRC becomes crcs[i] once done
    pending: List[Optional[inf_io.IOFuture]] = field(default_factory=list)
    # per piece: (buffer address, future) of the latest read of it
    last_read: Dict[int, tuple] = field(default_factory=dict)

    def __post_init__(self) -> None:
        count = self.pieces
        self.crcs = [None] * count
        self.pending = [None] * count

    @property
    def pieces(self) -> int:
        return max(1, -(-self.nbytes // self.piece))

    def span(self, i: int) -> Tuple[int, int]:
        """Byte range [start, end) of piece ``i``."""
        return i * self.piece, min(self.nbytes, (i + 1) * self.piece)


class PieceFutures:
    """The requests of one ranged read or write that spans several pieces, as one future:
    ``wait`` waits for all of them (so no buffer is freed under a running transfer) and
    raises the first error; ``crc32c`` is the CRC of the whole range (combined)."""

    def __init__(self, futures: List[inf_io.IOFuture], op: str, nbytes: int) -> None:
        self._futures = futures
        self._op = op
        self._nbytes = nbytes

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        total = 0
        error: Optional[BaseException] = None
        for f in self._futures:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                total += f.wait(left)
            except TimeoutError:
                raise
            except Exception as exc:  # noqa: BLE001 - the others are waited for first
                error = error or exc
        if error is not None:
            raise error
        return total

    result = wait

    def crc32c(self) -> int:
        self.wait()
        crc = 0
        for f in self._futures:
            crc = inf_io.crc32c_combine(crc, f.crc32c(), f.nbytes)
        return crc

    def timing(self) -> Optional[Tuple[float, float, float, float]]:
        timings = [f.timing() for f in self._futures]
        if not timings or any(t is None for t in timings):
            return None
        return (
            min(t[0] for t in timings),
            min(t[1] for t in timings),
            max(t[2] for t in timings),
            sum(t[3] for t in timings),
        )

    @property
    def op(self) -> str:
        return self._op

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __repr__(self) -> str:
        return f"PieceFutures({self._op} {self._nbytes} bytes in {len(self._futures)} pieces)"


def _log_no_locking(path: str, err: OSError) -> None:
    """Says once per process that stale swap directories cannot be told from live ones."""
    global _nolock_logged
    if not _nolock_logged:
        _nolock_logged = True
        logger.warning(
            "infinity: the filesystem under %r cannot take file locks (%s); stale "
            "swap directories of dead processes are not removed automatically. "
            "Delete %s* directories there by hand when no infinity process uses it",
            path,
            os.strerror(err.errno or 0),
            _DIR_PREFIX,
        )


def _same_file(fd: int, path: str) -> bool:
    """True while ``path`` still names the file open as ``fd`` (not unlinked or replaced)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def validate_nvme_path(path: str) -> str:
    """Checks that ``path`` is an existing, writable directory; returns its absolute form."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"nvme_path must be a path string, got {type(path).__name__}")
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"nvme_path {path!r} does not exist; create the directory "
            "(on a local NVMe/SSD filesystem) or pass another path"
        )
    if not os.path.isdir(path):
        raise NotADirectoryError(f"nvme_path {path!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(
            f"nvme_path {path!r} is not writable by this process; "
            "fix its permissions or choose another directory"
        )
    return path


class SwapStore:
    """Deterministic file per key (``<nvme_path>/infinity-swap-<pid>-<id>/<key>.swp``).

    Every write records a CRC32C of the bytes; every read verifies it (``verify=True``), so a
    corrupted or truncated swap file raises SwapCorruptionError instead of feeding garbage to
    training. The checksums are computed by the I/O workers chunk by chunk while they move the
    data, so they overlap the transfer instead of costing the caller a pass.

    What nvme_path holds: one ``infinity-swap-<pid>-<id>/`` directory per live store (an
    engine's parameters, an optimizer's states), holding its swap files and a ``.lock`` file.
    Nothing else is written there. The directory is removed on close. Directories left by dead
    processes (killed mid-run) are removed when the next store opens under the same nvme_path;
    by hand, every ``infinity-swap-*`` directory is safe to delete when no infinity process
    (in any container, or on any host sharing the filesystem) uses nvme_path.

    Liveness is a lock, never a PID (the PID in the name is information only: a PID means
    nothing in another PID namespace or on another host, and a dead one may be reused). The
    store holds an exclusive ``fcntl.flock`` on its ``.lock`` for its lifetime, keeping the fd
    open; the kernel drops it when the process dies in any way, SIGKILL included. Another
    store removes a directory only if it can take that lock itself without blocking. Why flock:

    * flock locks belong to the open file description and are checked on the inode, so they
      conflict across PID namespaces (containers sharing a local disk) and between two stores
      of one process. POSIX ``fcntl``/``lockf`` record locks are owned by a *process*: a
      second store in this process would "take" the first one's lock, and closing its fd
      would silently drop it, so they are unusable for this.
    * On NFS, Linux (>= 2.6.12) implements flock as a whole-file ``fcntl`` byte-range lock,
      i.e. exactly what lockf uses (NLM for NFSv3, in-protocol for NFSv4), so it is visible to
      other hosts. An exclusive lock there needs the file open for writing, hence ``O_RDWR``.
      (Mounted with ``nolock``/``local_lock=flock`` the lock is local to the host.)
    * OFD locks (``F_OFD_SETLK``) behave like flock but need a platform-specific
      ``struct flock``; flock gives the same semantics portably.
    * A forked child shares the open file description, so the lock stays held while a fork
      (e.g. a DataLoader worker) lives; that errs on the side of keeping.

    If the filesystem cannot lock at all (ENOLCK, EOPNOTSUPP), the store works unlocked, never
    deletes other directories, and says so once in the log.
    """

    def __init__(
        self, nvme_path: str, *, require_direct: bool = False, verify: bool = True, tag: str = ""
    ):
        self._closed = True  # until set up: a half-built store's __del__ does nothing
        self._lock_fd: Optional[int] = None
        self._owner_pid = os.getpid()  # a forked child's copy must not remove the directory
        base = validate_nvme_path(nvme_path)
        self.directory, self._lock_fd = self._create_locked_directory(base, tag=tag)
        self.verify = verify
        self._require_direct = require_direct
        self._entries: Dict[str, _Entry] = {}
        self._unallocated: Set[str] = set()  # keys created lazily, not written yet
        self._lock = threading.Lock()
        # per key of a file of extents: freed ranges whose blocks are kept, its largest extent
        self._kept: Dict[str, RangeSet] = {}
        self._largest: Dict[str, int] = {}
        self._spare: Dict[str, int] = {}  # key -> freed bytes its owner wants kept (keep_spare)
        self._space_lock = threading.Lock()
        self.allocated_bytes = 0  # bytes of blocks reserved fresh (fallocate) so far
        self.released_bytes = 0  # bytes of blocks given back (punched) so far
        self._closed = False
        try:
            if self._lock_fd is not None:  # no lock on this filesystem: delete nothing
                self._cleanup_stale(base, own=self.directory)
            self.direct = self._probe_direct(require_direct)
        except BaseException:
            self._closed = True
            shutil.rmtree(self.directory, ignore_errors=True)
            self._release_lock()
            raise

    # ---- setup -------------------------------------------------------------------------
    @staticmethod
    def _create_locked_directory(
        base: str, attempts: int = 8, tag: str = ""
    ) -> tuple[str, Optional[int]]:
        """Creates this store's directory and its lock file and takes the lock. Returns the
        directory and the lock's fd (None where the filesystem cannot lock).

        Between creating the lock file and locking it, another store's cleanup may take the
        lock and delete the (young, still unlocked) directory; then the lock is either refused
        here or taken on an unlinked file, and a fresh directory is made."""
        for _ in range(attempts):
            # tag: "<host>-rank<k>-" for a ZeRO rank (ranks and nodes never collide)
            directory = os.path.join(
                base, f"{_DIR_PREFIX}{tag}{os.getpid()}-{uuid.uuid4().hex[:8]}"
            )
            os.mkdir(directory)
            lock_path = os.path.join(directory, _LOCK_NAME)
            try:
                fd = os.open(
                    lock_path,
                    os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                    0o644,
                )
            except FileNotFoundError:
                continue  # the directory vanished under us
            except BaseException:
                shutil.rmtree(directory, ignore_errors=True)
                raise
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in _NOLOCK_ERRNOS:
                    _log_no_locking(base, e)
                    return directory, None
                if e.errno in (errno_mod.EWOULDBLOCK, errno_mod.EAGAIN, errno_mod.EACCES):
                    continue  # a cleanup holds it and deletes this directory
                shutil.rmtree(directory, ignore_errors=True)
                raise
            except BaseException:
                os.close(fd)
                shutil.rmtree(directory, ignore_errors=True)
                raise
            if _same_file(fd, lock_path):
                return directory, fd
            os.close(fd)  # a cleanup deleted it before we locked
        raise OSError(
            errno_mod.EAGAIN,
            f"could not create a locked swap directory under "
            f"{base!r} after {attempts} attempts (another process keeps deleting it)",
        )

    @staticmethod
    def _cleanup_stale(base: str, own: Optional[str] = None) -> None:
        """Removes the ``infinity-swap-*`` directories of dead stores under ``base``.

        A directory is stale when its lock can be taken here without blocking (its owner is
        gone: the kernel released the lock). The lock is held while the directory is removed,
        so its owner cannot be racing to start. A directory without a lock file is left alone
        while younger than the grace period (it is being created right now); older ones were
        left by a crash between mkdir and locking, or by a version without locks."""
        now = time.time()
        try:
            names = sorted(os.listdir(base))
        except OSError:
            return
        for name in names:
            path = os.path.join(base, name)
            if not name.startswith(_DIR_PREFIX) or path == own:
                continue
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                continue
            lock_path = os.path.join(path, _LOCK_NAME)
            try:
                fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            except FileNotFoundError:
                if now - st.st_mtime > _STALE_GRACE_S:
                    logger.info(
                        "removing swap directory %s without a lock file (older than %.0f s)",
                        name,
                        _STALE_GRACE_S,
                    )
                    shutil.rmtree(path, ignore_errors=True)
                continue
            except OSError:
                continue  # not ours to open (permissions, a symlink): leave it
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as e:
                    if e.errno in _NOLOCK_ERRNOS:
                        _log_no_locking(base, e)
                        return  # cannot tell live from dead here: delete nothing
                    continue  # held (EWOULDBLOCK): its owner is alive
                if not _same_file(fd, lock_path):
                    continue  # another cleanup removed it meanwhile
                logger.info(
                    "removing stale swap directory %s (its owner no longer holds its lock)", name
                )
                shutil.rmtree(path, ignore_errors=True)
            finally:
                os.close(fd)  # releases the lock, after the removal

    def _release_lock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def _probe_direct(self, require_direct: bool) -> bool:
        direct = inf_io.supports_direct_io(self.directory)
        if not direct and require_direct:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise OSError(
                errno_mod.EINVAL,
                f"the filesystem under {self.directory!r} does not support O_DIRECT "
                "(tmpfs?); put nvme_path on a real disk, or pass "
                "require_direct_io=False to accept buffered I/O through the page cache",
            )
        if not direct:
            warnings.warn(
                f"infinity: the filesystem under {self.directory!r} does not support "
                "O_DIRECT; swap I/O goes through the page cache (slower, and it takes "
                "RAM). Put nvme_path on a real disk for full speed.",
                RuntimeWarning,
                stacklevel=4,
            )
        return direct

    # ---- keys ----------------------------------------------------------------------------
    def _path(self, key: str) -> str:
        safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in key)
        return os.path.join(self.directory, f"{safe}.swp")

    def create(
        self, key: str, nbytes: int, piece_bytes: Optional[int] = None, *, lazy: bool = False
    ) -> None:
        """Creates the key's file with ``nbytes`` preallocated (ENOSPC is raised here, up front).

        ``piece_bytes``: the unit of ranged I/O and of checksums (a multiple of the alignment;
        None: the whole file is one piece, and only whole-file reads and writes are allowed).
        ``lazy``: the file takes no disk until its first write, which preallocates it first
        (ENOSPC is raised by that write): for files a run may never write (gradients stepped
        from RAM)."""
        if self._closed:
            raise RuntimeError("SwapStore is closed")
        if key in self._entries:
            raise KeyError(f"swap key {key!r} already exists")
        if nbytes % inf_io.ALIGNMENT:
            raise ValueError(
                f"swap extent for {key!r} must be a multiple of "
                f"{inf_io.ALIGNMENT} bytes, got {nbytes}"
            )
        piece = self._piece_for(key, nbytes, piece_bytes)
        handle = inf_io.FileHandle(self._path(key), "w+", require_direct=self._require_direct)
        try:
            if not lazy:
                handle.allocate(nbytes)
        except BaseException:
            handle.close()
            raise
        self._entries[key] = _Entry(handle=handle, nbytes=nbytes, piece=piece)
        if lazy:
            self._unallocated.add(key)

    def _allocate_before_write(self, key: str, entry: _Entry) -> None:
        """A lazily created file's first write: its disk is preallocated now."""
        if key not in self._unallocated:
            return
        with self._lock:
            if key not in self._unallocated:
                return
            entry.handle.allocate(entry.nbytes)
            self._unallocated.discard(key)

    def drop_blocks(self, key: str) -> bool:
        """The key's file holds nothing anyone will read again (gradients a step in backward
        consumed): its disk goes back to the filesystem (truncated to 0 bytes) and, as a file
        created lazily, it takes disk again at its next write. A read before that write
        raises (a short read: the file holds no bytes). False when it held no disk. Writes of it still in
        flight are waited for first."""
        entry = self._entry(key)
        with self._lock:
            if key in self._unallocated:
                return False
            for i in range(len(entry.pending)):
                self._settle(entry, i)
            os.truncate(self._path(key), 0)
            entry.crcs = [None] * len(entry.crcs)
            entry.last_read.clear()
            self._unallocated.add(key)
        return True

    def allocated(self, key: str) -> bool:
        """Whether the key's file holds its disk (False: created lazily, never written)."""
        self._entry(key)
        return key not in self._unallocated

    @staticmethod
    def _piece_for(key: str, nbytes: int, piece_bytes: Optional[int]) -> int:
        if piece_bytes is None or piece_bytes >= nbytes:
            return max(nbytes, inf_io.ALIGNMENT)
        if piece_bytes <= 0 or piece_bytes % inf_io.ALIGNMENT:
            raise ValueError(
                f"swap pieces of {key!r} must be a positive multiple of "
                f"{inf_io.ALIGNMENT} bytes, got {piece_bytes}"
            )
        return piece_bytes

    def use_pieces(self, key: str, piece_bytes: Optional[int]) -> None:
        """Sets the key's unit of ranged I/O and checksums (see :meth:`create`) before its
        first write."""
        entry = self._entry(key)
        if any(c is not None for c in entry.crcs) or any(f is not None for f in entry.pending):
            raise RuntimeError(f"swap file {key!r} was written already: its pieces are fixed")
        self._entries[key] = _Entry(
            handle=entry.handle,
            nbytes=entry.nbytes,
            piece=self._piece_for(key, entry.nbytes, piece_bytes),
        )

    def piece_bytes(self, key: str) -> int:
        """The unit of the key's ranged I/O and checksums (its size when it is one piece)."""
        return self._entry(key).piece

    def nbytes(self, key: str) -> int:
        return self._entry(key).nbytes

    def _entry(self, key: str) -> _Entry:
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"no swap file for key {key!r}") from None

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    # ---- I/O -----------------------------------------------------------------------------
    @staticmethod
    def _bytes_of(buf: torch.Tensor) -> torch.Tensor:
        if not buf.is_contiguous():
            raise ValueError("swap I/O needs a contiguous buffer")
        return buf.reshape(-1).view(torch.uint8)

    def _check_range(self, key: str, entry: _Entry, offset: int, nbytes: int) -> None:
        """A ranged request must cover whole pieces: it starts at a piece boundary and ends at
        one or at the end of the file (its checksums are those of the pieces)."""
        end = offset + nbytes
        if (
            offset < 0
            or nbytes <= 0
            or end > entry.nbytes
            or offset % entry.piece
            or (end % entry.piece and end != entry.nbytes)
        ):
            raise ValueError(
                f"infinity: swap I/O of {key!r} must cover whole pieces of {entry.piece:,} "
                f"bytes within its {entry.nbytes:,} bytes (start at a multiple of the piece, "
                f"end at one or at the end of the file); got bytes [{offset:,}, {end:,})"
            )

    def _check_buffer(self, key: str, buf: torch.Tensor, entry: _Entry) -> None:
        nbytes = buf.numel() * buf.element_size()
        if nbytes != entry.nbytes:
            raise ValueError(
                f"swap buffer for {key!r} has {nbytes} bytes, the file holds {entry.nbytes}"
            )

    def _pieces_in(self, entry: _Entry, offset: int, nbytes: int) -> range:
        return range(offset // entry.piece, -(-(offset + nbytes) // entry.piece))

    def _submit(
        self, key: str, entry: _Entry, op: str, offset: int, buf: torch.Tensor, urgent: bool = False
    ) -> IOResult:
        """One request per piece of [offset, offset + len(buf)) (one in all for a one-piece
        file), each checksummed by the I/O workers."""
        raw = self._bytes_of(buf)
        nbytes = raw.numel()
        self._check_range(key, entry, offset, nbytes)
        if op == "write":
            self._allocate_before_write(key, entry)
        futures = []
        for i in self._pieces_in(entry, offset, nbytes):
            start, end = entry.span(i)
            part = raw[start - offset : end - offset]
            if op == "write":
                with self._lock:
                    entry.crcs[i] = None
                    entry.last_read.pop(i, None)
                future = entry.handle.pwrite(part, start, crc=self.verify)
                entry.pending[i] = future if self.verify else None
            else:
                self._settle(entry, i)
                future = entry.handle.pread(part, start, crc=self.verify, urgent=urgent)
                if self.verify:
                    entry.last_read[i] = (part.data_ptr(), future)
            futures.append(future)
        if len(futures) == 1:
            return futures[0]
        return PieceFutures(futures, op, nbytes)

    def write(self, key: str, buf: torch.Tensor) -> IOResult:
        """Starts writing ``buf`` (all of it) to the key's file; its CRCs (computed by the I/O
        workers) are recorded when the write completes."""
        entry = self._entry(key)
        self._check_buffer(key, buf, entry)
        return self._submit(key, entry, "write", 0, buf)

    def write_at(self, key: str, offset: int, buf: torch.Tensor) -> IOResult:
        """Starts writing ``buf`` over bytes [offset, offset + len(buf)) of the key's file
        (whole pieces: see :meth:`piece_bytes`); the other pieces keep their content."""
        return self._submit(key, self._entry(key), "write", offset, buf)

    def _settle(self, entry: _Entry, i: int) -> None:
        """Takes the checksum of piece ``i``'s last write (waits for it; a failed write leaves
        no valid checksum, so a later read of that content is refused)."""
        future, entry.pending[i] = entry.pending[i], None
        if future is not None:
            try:
                crc: Optional[int] = future.crc32c()
            except (OSError, RuntimeError):
                crc = None
            entry.crcs[i] = crc

    def write_sync(self, key: str, buf: torch.Tensor) -> None:
        self.write(key, buf).wait()

    def read(self, key: str, buf: torch.Tensor, urgent: bool = False) -> IOResult:
        """Starts reading the key's file into ``buf``. ``urgent``: ahead of queued requests
        that are not (a parameter fetch compute will wait for)."""
        entry = self._entry(key)
        self._check_buffer(key, buf, entry)
        return self._submit(key, entry, "read", 0, buf, urgent)

    def read_at(self, key: str, offset: int, buf: torch.Tensor, urgent: bool = False) -> IOResult:
        """Starts reading bytes [offset, offset + len(buf)) of the key's file (whole pieces)
        into ``buf``; check it with :meth:`verify_read_at` once complete."""
        return self._submit(key, self._entry(key), "read", offset, buf, urgent)

    def verify_read(self, key: str, buf: torch.Tensor) -> None:
        """Checks a completed read of ``key`` into ``buf`` against the recorded checksums."""
        entry = self._entry(key)
        self._check_buffer(key, buf, entry)
        self.verify_read_at(key, 0, buf)

    def verify_read_at(self, key: str, offset: int, buf: torch.Tensor) -> None:
        """Checks a completed :meth:`read_at` of ``key`` at ``offset`` into ``buf``, piece by
        piece; a piece that does not match is named (file and byte range)."""
        entry = self._entry(key)
        if not self.verify:
            return
        raw = self._bytes_of(buf)
        self._check_range(key, entry, offset, raw.numel())
        whole = entry.pieces == 1
        for i in self._pieces_in(entry, offset, raw.numel()):
            start, end = entry.span(i)
            where = "" if whole else f" (bytes {start:,}-{end:,}, piece {i} of {entry.pieces})"
            self._settle(entry, i)
            recorded = entry.crcs[i]
            if recorded is None:
                raise SwapCorruptionError(
                    f"swap file {self._path(key)!r}{where} holds no completed write (never "
                    "written, or its last write failed)"
                )
            part = raw[start - offset : end - offset]
            last = entry.last_read.pop(i, None)
            if last is not None and last[0] == part.data_ptr():
                crc = last[1].crc32c()  # computed by the I/O workers during the read
            else:
                crc = inf_io.crc32c(part)
            if crc != recorded:
                raise SwapCorruptionError(
                    f"swap file {self._path(key)!r} is corrupted{where}: CRC32C {crc:#010x} "
                    f"does not match {recorded:#010x} recorded when it was written. Either the "
                    "disk or another process changed it (training cannot continue from it; "
                    "restart from a checkpoint), or code wrote a wrapped parameter in place "
                    "through `p.data` outside forward, which infinity cannot see: write "
                    "through the parameter under torch.no_grad() instead, or call "
                    "infinity.parameters_changed(model) right after such writes"
                )

    def read_sync(self, key: str, buf: torch.Tensor, urgent: bool = False) -> None:
        self.read(key, buf, urgent=urgent).wait()
        self.verify_read(key, buf)

    def read_at_sync(self, key: str, offset: int, buf: torch.Tensor, urgent: bool = False) -> None:
        self.read_at(key, offset, buf, urgent=urgent).wait()
        self.verify_read_at(key, offset, buf)

    def recorded_crc(self, key: str) -> Optional[int]:
        """The CRC32C of the key's last completed write (waits for a write in flight); None
        without one (never written, a failed write, or verify=False)."""
        entry = self._entry(key)
        crc = 0
        for i in range(entry.pieces):
            self._settle(entry, i)
            piece = entry.crcs[i]
            if piece is None:
                return None
            start, end = entry.span(i)
            crc = piece if i == 0 else inf_io.crc32c_combine(crc, piece, end - start)
        return crc

    def rehash(self, key: str, scratch: torch.Tensor) -> None:
        """The key's file was changed outside this store (through a memory map of it): reads it
        piece by piece into ``scratch`` (aligned, at least one piece or the whole file) and
        records its checksums as the valid ones."""
        entry = self._entry(key)
        raw = self._bytes_of(scratch)
        if raw.numel() < min(entry.piece, entry.nbytes):
            raise ValueError(
                f"rehash of {key!r} needs a scratch buffer of at least "
                f"{min(entry.piece, entry.nbytes):,} bytes, got {raw.numel():,}"
            )
        for i in range(entry.pieces):
            self._settle(entry, i)
            start, end = entry.span(i)
            future = entry.handle.pread(raw[: end - start], start, crc=self.verify)
            future.wait()
            entry.last_read.pop(i, None)
            if self.verify:
                entry.crcs[i] = future.crc32c()

    # ---- spans of a one-piece extent, checksummed by the caller --------------------------
    # (the optimizer steps a large shard in element ranges whose page-aligned spans do not
    # follow pieces). The extent keeps its one CRC32C: the caller combines the spans' CRCs
    # (each computed by the I/O workers) into the extent's and records it with
    # :meth:`record_crc` once every span is written, or checks a combination of read spans
    # against :meth:`recorded_crc`.
    def _check_span(self, key: str, entry: _Entry, buf: torch.Tensor, offset: int) -> None:
        nbytes = buf.numel() * buf.element_size()
        align = inf_io.ALIGNMENT
        if entry.pieces != 1:
            raise ValueError(
                f"infinity: span I/O of {key!r} needs an extent checksummed whole "
                f"(one piece); it has {entry.pieces} pieces: use read_at/write_at"
            )
        if offset % align or nbytes % align or nbytes <= 0 or offset + nbytes > entry.nbytes:
            raise ValueError(
                f"swap span of {key!r} at offset {offset} with {nbytes} bytes: "
                f"both must be multiples of {align} inside the {entry.nbytes}-byte "
                "extent"
            )

    def read_span(self, key: str, buf: torch.Tensor, offset: int) -> inf_io.IOFuture:
        """Starts reading ``buf``'s size of the key's file at ``offset`` (CRC32C computed by
        the workers when the store verifies)."""
        entry = self._entry(key)
        self._check_span(key, entry, buf, offset)
        self._settle(entry, 0)  # a whole write in flight lands first
        return entry.handle.pread(self._bytes_of(buf), offset, crc=self.verify)

    def write_span(self, key: str, buf: torch.Tensor, offset: int) -> inf_io.IOFuture:
        """Starts writing ``buf`` at ``offset``. The extent has no valid checksum until
        :meth:`record_crc`, so a read that verifies it before then is refused."""
        entry = self._entry(key)
        self._check_span(key, entry, buf, offset)
        self._allocate_before_write(key, entry)
        self._settle(entry, 0)
        with self._lock:
            entry.crcs[0] = None
            entry.last_read.pop(0, None)
        return entry.handle.pwrite(self._bytes_of(buf), offset, crc=self.verify)

    def record_crc(self, key: str, crc: Optional[int]) -> None:
        """Records the CRC32C of the key's whole content after a write in spans (None: no
        valid checksum, e.g. a span failed)."""
        entry = self._entry(key)
        if entry.pieces != 1:
            raise ValueError(f"infinity: record_crc of {key!r} needs a one-piece extent")
        self._settle(entry, 0)
        entry.crcs[0] = crc if self.verify else None

    # ---- space of a file whose extents the caller allocates (see .extents) ---------------
    # A freed extent's blocks stay allocated (the range is *kept*) and serve the next extents
    # reserved over it: the NVMe step frees a unit's old extent and writes the next unit into
    # it, and giving the blocks back then allocating them again (fallocate per unit) cost more
    # than the disk time of the step (on a filesystem mounted with ``discard``, punching a
    # step's worth of extents cost more than the step's compute). The kept bytes are bounded:
    # beyond KEEP_FREED_EXTENTS times the file's largest extent, or the spare its owner says a
    # step reserves before it frees (:meth:`keep_spare`) if that is more, the kept ranges
    # nearest the file's end (those a first-fit allocator reuses last) are given back, down to
    # that spare or one largest extent. So the disk holds the live extents plus at most what a
    # step holds at its peak anyway; everything goes back on close (the directory is removed)
    # or with :meth:`give_back`.
    def reserve(self, key: str, offset: int, nbytes: int) -> None:
        """Reserves disk for bytes [offset, offset + nbytes) of the key's one-piece file
        (posix_fallocate of what is not kept from a freed extent: ENOSPC is raised here,
        before anything is written there), growing the file when they lie past its end."""
        entry = self._entry(key)
        if offset % inf_io.ALIGNMENT or nbytes <= 0 or nbytes % inf_io.ALIGNMENT:
            raise ValueError(
                f"swap reserve of {key!r}: offset {offset} and size {nbytes} must "
                f"be multiples of {inf_io.ALIGNMENT}"
            )
        if entry.pieces != 1:
            raise ValueError(f"infinity: reserve of {key!r} needs a one-piece extent")
        with self._space_lock:
            kept = self._kept.setdefault(key, RangeSet(f"swap file {key!r}"))
            gaps = kept.remove(offset, nbytes)
            self._largest[key] = max(self._largest.get(key, 0), nbytes)
        if gaps:
            try:
                fd = os.open(self._path(key), os.O_RDWR | os.O_CLOEXEC)
                try:
                    for start, size in gaps:
                        os.posix_fallocate(fd, start, size)
                finally:
                    os.close(fd)
            except BaseException:
                self._keep_again(key, offset, nbytes, gaps)
                raise
            with self._space_lock:
                self.allocated_bytes += sum(size for _, size in gaps)
        if offset + nbytes > entry.nbytes:
            with self._lock:
                crcs, pending = entry.crcs, entry.pending
                grown = _Entry(handle=entry.handle, nbytes=offset + nbytes, piece=offset + nbytes)
                grown.crcs, grown.pending = crcs, pending
                self._entries[key] = grown

    def _keep_again(self, key: str, offset: int, nbytes: int, gaps: List[Tuple[int, int]]) -> None:
        """A failed reserve: the kept parts of [offset, offset + nbytes) are kept again."""
        at = offset
        with self._space_lock:
            kept = self._kept[key]
            for start, size in gaps + [(offset + nbytes, 0)]:
                if start > at:
                    kept.add(at, start - at, verb="kept")
                at = start + size

    def release(self, key: str, offset: int, nbytes: int) -> bool:
        """Bytes [offset, offset + nbytes) of the key's file are free: their blocks are kept
        for the next :meth:`reserve` over them, and the kept ranges beyond the bound (see
        above) are given back to the filesystem (holes; the file keeps its size). True when
        blocks were given back by this call; False when everything is kept, or where the
        filesystem cannot punch holes (the blocks stay allocated and are reused)."""
        entry = self._entry(key)
        if offset < 0 or nbytes <= 0 or offset + nbytes > entry.nbytes:
            raise ValueError(
                f"swap release of {key!r}: [{offset}, {offset + nbytes}) is "
                f"outside its {entry.nbytes} bytes"
            )
        with self._space_lock:
            kept = self._kept.setdefault(key, RangeSet(f"swap file {key!r}"))
            kept.add(offset, nbytes, verb="released")
            largest = self._largest[key] = max(self._largest.get(key, 0), nbytes)
            spare = self._spare.get(key, 0)
            if kept.total <= max(KEEP_FREED_EXTENTS * largest, spare):
                return False
            return self._give_back(key, kept, max(0, kept.total - max(largest, spare)))

    def keep_spare(self, key: str, nbytes: int) -> None:
        """The key's file keeps up to ``nbytes`` of freed blocks (at least KEEP_FREED_EXTENTS
        largest extents) for the next extents: its owner reserves that many bytes again before
        it frees as many (the new extents a step writes before it commits them)."""
        self._entry(key)
        if nbytes < 0:
            raise ValueError(f"swap keep_spare of {key!r}: {nbytes} bytes")
        with self._space_lock:
            self._spare[key] = nbytes

    def give_back(self, key: str) -> bool:
        """Gives the blocks of every kept freed range of the key's file back to the filesystem
        (False when there were none, or the filesystem cannot punch holes)."""
        self._entry(key)
        with self._space_lock:
            kept = self._kept.get(key)
            if kept is None or not kept.total:
                return False
            return self._give_back(key, kept, kept.total)

    def kept_bytes(self, key: str) -> int:
        """Bytes of freed ranges of the key's file whose blocks are kept for reuse."""
        self._entry(key)
        with self._space_lock:
            kept = self._kept.get(key)
            return kept.total if kept is not None else 0

    def _give_back(self, key: str, kept: RangeSet, nbytes: int) -> bool:
        """Punches the last ``nbytes`` of the kept ranges (under the space lock). A range the
        filesystem cannot punch stays kept (its blocks are still allocated)."""
        path = self._path(key)
        taken = []
        while nbytes > 0 and kept.total:
            start, size = kept.take_last(nbytes)
            taken.append((start, size))
            nbytes -= size
        released = False
        for i, (start, size) in enumerate(taken):
            try:
                done = punch_hole(path, start, size)
            except OSError:
                for back in taken[i:]:
                    kept.add(*back, verb="kept")
                raise
            if not done:
                for back in taken[i:]:
                    kept.add(*back, verb="kept")
                break
            released = True
            self.released_bytes += size
        return released

    def disk_bytes(self, key: Optional[str] = None) -> int:
        """Bytes the filesystem holds for the key's file (all files without a key): its
        allocated blocks, holes left out."""
        keys = [key] if key is not None else list(self._entries)
        total = 0
        for k in keys:
            self._entry(k)
            try:
                total += os.stat(self._path(k)).st_blocks * 512
            except OSError:
                pass
        return total

    def path(self, key: str) -> str:
        self._entry(key)
        return self._path(key)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._owner_pid:
            # a forked child's copy: the parent owns the files, the directory and the lock
            # (closing the child's reference to the lock's file does not release it)
            self._release_lock()
            return
        try:
            for entry in self._entries.values():
                entry.handle.close()
            self._entries.clear()
            self._kept.clear()
            shutil.rmtree(self.directory, ignore_errors=True)
        finally:
            self._release_lock()  # after the removal, so no cleanup races a half-deleted one

    def __del__(self) -> None:  # best effort; Engine.close() is the real owner
        try:
            self.close()
        except Exception:
            pass


_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_punch_ok = True


@functools.lru_cache(maxsize=None)
def _fallocate() -> Any:
    """libc's fallocate(2) through ctypes (None where there is none)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return fn


def punch_hole(path: str, offset: int, nbytes: int) -> bool:
    """fallocate(PUNCH_HOLE | KEEP_SIZE) on ``path``: True when the blocks were released,
    False where the filesystem (or platform) cannot (said once in the log)."""
    global _punch_ok
    fallocate = _fallocate() if _punch_ok else None
    if fallocate is None:
        _punch_ok = False
        return False
    import ctypes

    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        if fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, nbytes) == 0:
            return True
        err = ctypes.get_errno()
    finally:
        os.close(fd)
    if err in (errno_mod.EOPNOTSUPP, errno_mod.ENOSYS, errno_mod.EINVAL):
        _punch_ok = False
        logger.info(
            "infinity: the filesystem under %r cannot punch holes (%s); freed swap "
            "extents keep their blocks until reused",
            path,
            os.strerror(err),
        )
        return False
    raise OSError(
        err, f"punching a hole in {path!r} at {offset} ({nbytes} bytes) failed: {os.strerror(err)}"
    )


def default_swap_root() -> str:
    return tempfile.gettempdir()
