"""One job at a time per output folder, or per shard of it: file locks held for the whole run.

`flock` locks belong to the open file: the kernel drops them when the last process holding it dies,
however it dies, so a killed run never blocks its own resume.  An unsharded run holds
`.eagle_extract.lock` alone; each `--shard` job shares it with the other shards and holds its own
`.eagle_extract.I-of-N.lock`; a `--dp` parent holds the main lock and hands it to its replicas
(which hold their shards'), so the folder stays locked while any of them lives.  A holder that is
alone on a lock file at the end removes it; whoever locks a file checks that it is still the one
at that path, so a removed file is never mistaken for the lock.  Filesystems without flock (some
NFS and Lustre mounts) get a warning and no lock: run one job per output there.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

from ..errors import ExtractError

MAIN = ".eagle_extract.lock"
REPLICA_ENV = "EAGLE_EXTRACT_REPLICA_OF"  # set by a --dp parent for its replicas, which share its lock
_NO_FLOCK = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)
_held: dict[str, int] = {}  # the locks this process holds: path -> fd, so a run inside a repair nests
_unlocked: set[str] = set()  # outputs already warned about


def shard_lock(shard: tuple[int, int]) -> str:
    return f".eagle_extract.{shard[0]}-of-{shard[1]}.lock"


def _holder(path: Path) -> str:
    try:
        said = path.read_text().strip()
    except OSError:
        said = ""
    return said or "one or more --shard jobs"


def _acquire(path: Path, exclusive: bool, output: Path) -> int | None:
    """The fd holding `path`'s lock; None where the filesystem has no flock."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ExtractError(
                f"--output {output} is being written by another eagle-extract run ({_holder(path)}); "
                "wait for it to finish, or stop it and rerun this command to resume"
            ) from None
        except OSError as exc:
            os.close(fd)
            if exc.errno not in _NO_FLOCK:
                raise
            if str(output) not in _unlocked:
                from ..runlog import terminal

                print(f"warning: {output}'s filesystem has no file locks; run one job per output", file=terminal())
                _unlocked.add(str(output))
            return None
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # its holder removed the file after we opened it: lock the one there now
    try:  # with a lock of its own a holder names itself; with a shared one, no named holder is alive
        os.ftruncate(fd, 0)
        if exclusive:
            started = time.strftime("%Y-%m-%d %H:%M:%S")
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {started}: {' '.join(sys.argv)}".encode())
    except OSError:  # the name is a courtesy; a full disk must not stop the run here
        pass
    return fd


def _release(path: Path, fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # alone on it (shards share the main lock)
        if os.path.samestat(os.fstat(fd), os.stat(path)):  # and it is still the file at that path
            path.unlink()
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def _flock(path: Path, exclusive: bool, output: Path):
    key = str(path.resolve())
    if key in _held:  # this process holds it already (a repair's run)
        yield _held[key]
        return
    fd = _acquire(path, exclusive, output)
    if fd is None:
        yield None
        return
    _held[key] = fd
    try:
        yield fd
    finally:
        del _held[key]
        _release(path, fd)


@contextmanager
def holding(output: Path, shard: tuple[int, int] | None = None):
    """Hold `output`'s locks for the block: the whole folder's (an unsharded run, a --dp parent, merge,
    repair), or a shard's; yields the main lock's fd (None for a replica or without flock)."""
    output = Path(output)
    with ExitStack() as stack:
        main = None
        if shard is None or os.environ.get(REPLICA_ENV) is None:
            main = stack.enter_context(_flock(output / MAIN, shard is None, output))
        if shard is not None:
            stack.enter_context(_flock(output / shard_lock(shard), True, output))
        yield main
