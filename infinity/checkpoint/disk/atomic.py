"""Atomic checkpoint directories: everything is written into a temporary sibling directory and
renamed into place only once complete and fsynced.

Design notes: docs/modules.md, checkpoint/disk/atomic.py."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid
from typing import Iterator

from .files import fsync_dir
from .manifest import MANIFEST, CheckpointError

logger = logging.getLogger(__name__)


def aside_path(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.old")


def _tmp_prefix(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.tmp-")


def _is_checkpoint(path: str, marker: str = MANIFEST) -> bool:
    """Whether ``path`` is a complete checkpoint: it holds ``marker``, the file written last
    (infinity's manifest; ``.metadata`` for a torch.distributed.checkpoint directory)."""
    return os.path.isfile(os.path.join(path, marker))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(path: str) -> None:
    """Deletes temporary directories left by saves to ``path`` whose process is gone."""
    head = os.path.dirname(path) or "."
    prefix = os.path.basename(_tmp_prefix(path))
    for entry in os.listdir(head):
        if not entry.startswith(prefix):
            continue
        try:
            pid = int(entry[len(prefix) :].split("-", 1)[0])
        except ValueError:
            continue
        if pid == os.getpid() or not _pid_alive(pid):
            logger.info(
                "infinity: removing %s, left by an interrupted checkpoint save",
                os.path.join(head, entry),
            )
            shutil.rmtree(os.path.join(head, entry), ignore_errors=True)


def resolve(path: str) -> str:
    """The directory to read the checkpoint ``path`` from: ``path`` itself, or the previous
    checkpoint kept aside when a save crashed while replacing it. Clear errors otherwise."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isfile(path):
        raise CheckpointError(
            f"{path} is a file, not an infinity checkpoint (a directory "
            "written by infinity.save_checkpoint)"
        )
    if _is_checkpoint(path):
        return path
    aside = aside_path(path)
    if _is_checkpoint(aside):
        logger.warning(
            "infinity: %s is missing (a save was interrupted while replacing it); "
            "loading the previous checkpoint kept at %s",
            path,
            aside,
        )
        return aside
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path}: the path does not exist")
    raise CheckpointError(
        f"{path} is not an infinity checkpoint: it has no {MANIFEST} "
        "(write one with infinity.save_checkpoint)"
    )


def staging_name(path: str, token: int) -> str:
    """The temporary sibling directory of ``path`` named by ``token`` (``pid << 30 | random``:
    the pid lets a later save see that its writer is gone)."""
    return f"{_tmp_prefix(os.path.abspath(path))}{token >> 30}-{token & ((1 << 30) - 1):08x}"


def new_token() -> int:
    """A staging token for this process: below 2**52, so it survives a float64 all-reduce
    (how the ranks of a sharded save agree on one directory)."""
    return (os.getpid() & ((1 << 22) - 1)) << 30 | (uuid.uuid4().int & ((1 << 30) - 1))


def prepare_staging(path: str, token: int, marker: str = MANIFEST) -> str:
    """Checks that ``path`` may be replaced, removes temporaries of dead saves and creates the
    staging directory for ``token``. Returns it. ``marker``: see :func:`_is_checkpoint`."""
    path = os.path.abspath(os.fspath(path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.isfile(path):
        raise CheckpointError(f"refusing to replace {path}: it is a file, not a checkpoint")
    if os.path.isdir(path) and not _is_checkpoint(path, marker) and os.listdir(path):
        what = "an infinity checkpoint" if marker == MANIFEST else f"a checkpoint (no {marker})"
        raise CheckpointError(
            f"refusing to replace {path}: it is a non-empty directory that is not {what}"
        )
    remove_stale_temporaries(path)
    tmp = staging_name(path, token)
    os.mkdir(tmp)
    return tmp


def commit_staging(tmp: str, path: str, marker: str = MANIFEST) -> None:
    """fsyncs everything under ``tmp`` and renames it to ``path`` (the previous checkpoint is
    kept aside until the rename is durable)."""
    for root, _, _ in os.walk(tmp):
        fsync_dir(root)
    _commit(tmp, os.path.abspath(os.fspath(path)), marker)


@contextlib.contextmanager
def staged_directory(path: str, marker: str = MANIFEST) -> Iterator[str]:
    """Yields a new temporary directory next to ``path``; when the block ends without an
    exception it becomes ``path`` (replacing a previous checkpoint atomically), otherwise it is
    deleted and ``path`` is left as it was. ``marker``: see :func:`_is_checkpoint`."""
    path = os.path.abspath(os.fspath(path))
    tmp = prepare_staging(path, new_token(), marker)
    try:
        yield tmp
        commit_staging(tmp, path, marker)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _commit(tmp: str, path: str, marker: str = MANIFEST) -> None:
    parent = os.path.dirname(path)
    aside = aside_path(path)
    if os.path.isdir(path):
        if _is_checkpoint(path, marker):
            if os.path.exists(aside):  # stale: ``path`` is complete, so the aside copy is old
                shutil.rmtree(aside)
            os.rename(path, aside)
        else:
            os.rmdir(path)  # empty (checked by staged_directory)
        fsync_dir(parent)
    try:
        os.rename(tmp, path)
    except BaseException:
        if not os.path.exists(path) and os.path.isdir(aside):
            os.rename(aside, path)  # put the previous checkpoint back
        raise
    fsync_dir(parent)
    if os.path.exists(aside):
        shutil.rmtree(aside, ignore_errors=True)
        fsync_dir(parent)
