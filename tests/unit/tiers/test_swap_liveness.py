"""Swap-directory liveness: a SwapStore's directory is kept while its owner holds its lock,
wherever the owner runs (another process, another PID namespace), and removed once the owner
is dead, whatever PID its name carries."""
import errno
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from infinity.tiers import swap_store
from infinity.tiers.swap_store import SwapStore

# Opens a store on argv[1], optionally writes a key, prints its directory, then waits (or dies).
HOLDER = textwrap.dedent("""
    import os, signal, sys, time, torch
    from infinity.tiers.swap_store import SwapStore
    s = SwapStore(sys.argv[1])
    s.create("k", 4096)
    s.write_sync("k", torch.zeros(1024, dtype=torch.float32))
    print(os.getpid(), s.directory, flush=True)
    if sys.argv[2] == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
""")


def _start_holder(base, mode="live", prefix=()):
    proc = subprocess.Popen([*prefix, sys.executable, "-c", HOLDER, str(base), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready else ""
    if not line:
        _stop(proc)
        raise AssertionError(f"holder did not start: {proc.stderr.read()[-2000:]}")
    pid, directory = line.split()
    return proc, int(pid), directory


def _stop(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    for f in (proc.stdout, proc.stderr):
        f.close()


def _dead_pid():
    """A PID no process can have: pid_max itself is never handed out."""
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read())


def _reopen_and_close(base):
    """Opens (and thereby cleans up) and closes a store on ``base`` in this process."""
    SwapStore(str(base)).close()


def _assert_owned_dir_intact(directory):
    assert os.path.isdir(directory)
    assert sorted(os.listdir(directory)) == [".lock", "k.swp"]


def test_live_store_of_another_process_is_kept_even_with_colliding_pid_names(tmp_path):
    proc, _, directory = _start_holder(tmp_path)
    try:
        _reopen_and_close(tmp_path)
        _assert_owned_dir_intact(directory)
        # the name carries this process's PID (a PID reused across namespaces or hosts)
        mine = str(tmp_path / f"infinity-swap-{os.getpid()}-collide0")
        os.rename(directory, mine)
        _reopen_and_close(tmp_path)
        _assert_owned_dir_intact(mine)
        # the name carries a dead PID: the old PID check deleted this live directory
        dead = str(tmp_path / f"infinity-swap-{_dead_pid()}-collide1")
        os.rename(mine, dead)
        _reopen_and_close(tmp_path)
        _assert_owned_dir_intact(dead)
        assert proc.poll() is None
    finally:
        _stop(proc)


def test_directory_of_sigkilled_process_is_removed(tmp_path):
    proc, _, directory = _start_holder(tmp_path, mode="die")
    proc.wait(timeout=30)
    _stop(proc)
    assert proc.returncode == -signal.SIGKILL
    # the crash left it behind, under a PID that may be reused by now
    _assert_owned_dir_intact(directory)
    store = SwapStore(str(tmp_path))
    try:
        assert not os.path.exists(directory)
        assert os.listdir(tmp_path) == [os.path.basename(store.directory)]
    finally:
        store.close()
    assert not os.listdir(tmp_path)


def _unshare_works():
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    if os.geteuid() != 0:
        return "creating a PID namespace needs root"
    try:
        r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare failed: {e}"
    if r.returncode != 0:
        return f"unshare --pid --fork --mount-proc does not work here: {r.stderr.strip()}"
    return None


def test_live_store_in_another_pid_namespace_is_kept(tmp_path):
    reason = _unshare_works()
    if reason:
        pytest.skip(reason)
    proc, ns_pid, directory = _start_holder(
        tmp_path, prefix=("unshare", "--pid", "--fork", "--kill-child", "--mount-proc"))
    try:
        assert ns_pid == 1  # its own PID namespace: its PID means nothing here
        _reopen_and_close(tmp_path)
        _assert_owned_dir_intact(directory)
        dead = str(tmp_path / f"infinity-swap-{_dead_pid()}-nspace00")
        os.rename(directory, dead)
        _reopen_and_close(tmp_path)
        _assert_owned_dir_intact(dead)
    finally:
        _stop(proc)
    # its owner is gone now (the namespace's init may finish exiting after unshare is reaped)
    deadline = time.monotonic() + 10
    while True:
        _reopen_and_close(tmp_path)
        if not os.listdir(tmp_path) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not os.listdir(tmp_path)


def test_fresh_directory_without_lock_file_is_kept_old_one_removed(tmp_path):
    fresh = tmp_path / f"infinity-swap-{_dead_pid()}-fresh000"  # being created right now
    fresh.mkdir()
    (fresh / "x.swp").write_bytes(b"\0" * 4096)
    old = tmp_path / f"infinity-swap-{_dead_pid()}-old00000"  # crashed before locking, long ago
    old.mkdir()
    past = time.time() - 10 * swap_store._STALE_GRACE_S
    os.utime(old, (past, past))
    unrelated = tmp_path / "infinity-swap-not-a-dir"
    unrelated.write_text("user file")
    _reopen_and_close(tmp_path)
    assert fresh.is_dir() and (fresh / "x.swp").exists()
    assert not old.exists()
    assert unrelated.read_text() == "user file"


def test_two_stores_in_one_process_keep_each_other(tmp_path):
    a = SwapStore(str(tmp_path))
    b = SwapStore(str(tmp_path))
    try:
        assert os.path.isdir(a.directory) and os.path.isdir(b.directory)
        a.create("k", 4096)
        a.write_sync("k", torch.ones(1024))
        SwapStore(str(tmp_path)).close()
        out = torch.empty(1024)
        a.read_sync("k", out)
        assert torch.equal(out, torch.ones(1024))
    finally:
        a.close()
        b.close()
    assert not os.listdir(tmp_path)


def test_abandoned_lock_file_is_removed(tmp_path):
    gone = tmp_path / f"infinity-swap-{os.getpid()}-abandon0"  # our own PID, but not ours
    gone.mkdir()
    (gone / ".lock").touch()
    _reopen_and_close(tmp_path)
    assert not gone.exists()


def test_filesystem_without_locks_deletes_nothing_and_logs_once(tmp_path, monkeypatch,
                                                                   caplog):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(swap_store.fcntl, "flock", no_locks)
    monkeypatch.setattr(swap_store, "_nolock_logged", False)
    abandoned = tmp_path / f"infinity-swap-{_dead_pid()}-abandon1"
    abandoned.mkdir()
    (abandoned / ".lock").touch()
    lockless = tmp_path / f"infinity-swap-{_dead_pid()}-lockless"
    lockless.mkdir()
    past = time.time() - 10 * swap_store._STALE_GRACE_S
    os.utime(lockless, (past, past))
    with caplog.at_level(logging.WARNING, logger=swap_store.__name__):
        a = SwapStore(str(tmp_path))
        b = SwapStore(str(tmp_path))
    try:
        assert abandoned.is_dir() and lockless.is_dir()
        warnings = [r for r in caplog.records if "cannot take file locks" in r.getMessage()]
        assert len(warnings) == 1
        a.create("k", 4096)  # the store itself works unlocked
        a.write_sync("k", torch.full((1024,), 2.0))
        out = torch.empty(1024)
        a.read_sync("k", out)
        assert torch.equal(out, torch.full((1024,), 2.0))
    finally:
        a.close()
        b.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([abandoned.name, lockless.name])


def test_forked_child_does_not_remove_the_parents_directory(tmp_path):
    store = SwapStore(str(tmp_path))
    try:
        pid = os.fork()
        if pid == 0:  # child: dropping its copy must leave the parent's directory and lock
            try:
                store.close()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert os.path.isdir(store.directory)
        SwapStore(str(tmp_path)).close()  # the parent still holds the lock
        assert os.path.isdir(store.directory)
    finally:
        store.close()
    assert not os.listdir(tmp_path)
