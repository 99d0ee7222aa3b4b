"""One job at a time per output folder, or per shard of it: file locks held for the whole run.

`flock` locks belong to the process: the kernel drops them when it dies, however it dies, so a
killed run never blocks its own resume.  An unsharded run holds `.eagle_extract.lock` alone; each
`--shard` job shares it with the other shards and holds its own `.eagle_extract.I-of-N.lock`; a
`--dp` parent holds the main lock for its replicas, which hold their shards'.  The lock files stay (empty while unheld):
removing one would let a second run lock a new file while a first holds the old one.  flock works
on local filesystems and NFSv4; on other network filesystems run one job per output.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

from .errors import ExtractError

MAIN = ".eagle_extract.lock"
REPLICA_ENV = "EAGLE_EXTRACT_REPLICA_OF"  # set by a --dp parent for its replicas, which share its lock


def shard_lock(shard: tuple[int, int]) -> str:
    return f".eagle_extract.{shard[0]}-of-{shard[1]}.lock"


def _holder(path: Path) -> str:
    try:
        said = path.read_text().strip()
    except OSError:
        said = ""
    return said or "one or more --shard jobs"


@contextmanager
def _flock(path: Path, exclusive: bool, output: Path):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ExtractError(
            f"--output {output} is being written by another eagle-extract run ({_holder(path)}); "
            "wait for it to finish, or stop it and rerun this command to resume"
        ) from None
    try:
        if exclusive:
            os.ftruncate(fd, 0)
            started = time.strftime("%Y-%m-%d %H:%M:%S")
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {started}: {' '.join(sys.argv)}".encode())
        yield
    finally:
        if exclusive:
            os.ftruncate(fd, 0)  # an unheld lock names nobody
        os.close(fd)


@contextmanager
def holding(output: Path, shard: tuple[int, int] | None = None):
    """Hold `output`'s locks for the block: the whole folder's (an unsharded run, a --dp parent), or a shard's."""
    output = Path(output)
    with ExitStack() as stack:
        if shard is None or os.environ.get(REPLICA_ENV) is None:
            stack.enter_context(_flock(output / MAIN, shard is None, output))
        if shard is not None:
            stack.enter_context(_flock(output / shard_lock(shard), True, output))
        yield
