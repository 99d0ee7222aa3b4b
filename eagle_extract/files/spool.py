"""The server's spool: the state files speculators' trainer collects (and deletes), bounded in bytes, with
uncollected files removed after a TTL; and, at a server's start, the folders dead servers left in it."""

from __future__ import annotations

import errno
import fcntl
import itertools
import math
import os
import shutil
import socket
import threading
import time
from pathlib import Path

from ..errors import RequestError
from .rowfile import hidden_state_path

FOLDER_PREFIX = "eagle-extract-serve."
LOCK_NAME = "serve.lock"  # in each server's folder, flock'd for the server's life: a folder without a holder is dead
NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)  # a filesystem mounted without locks (NFS nolock, ...)


class Spool:
    """Our folder in the spool: state files the trainer collects (and deletes).  `reserve` waits while
    the files written and the rows in flight would pass `limit` bytes, or the filesystem's room for them; a file
    and its links (identical prompts) are one group, counted once.  `sweep` (the server's janitor; `waiting` at
    shutdown) sees which files the trainer took and removes those uncollected after `ttl` seconds; `clear`
    removes every file of ours.  `share`: this spool's part of its filesystem's free space, where several
    servers' spools (`--replicas`) write to one filesystem and each would otherwise count all of it."""

    def __init__(self, root: Path, limit: int, ttl: float, share: float = 1.0) -> None:
        self.root, self.limit, self.ttl, self.share = root, limit, ttl, share
        self._files: dict[Path, tuple[int, float]] = {}  # written, not yet seen gone: group, time written
        self._groups: dict[int, list[int]] = {}  # group -> [bytes, names of ours left]
        self._group_ids = itertools.count()
        self._bytes = 0  # of those files and of the rows in flight
        self._file_bytes = 0  # of those files alone
        self._waiting: list[object] = []  # requests waiting for room, first come first
        self._cond = threading.Condition()
        self._closed = False  # the server is stopping: nobody waits for room any more
        self.expired = 0

    def used(self) -> int:
        return self._bytes

    def waiting_for_room(self) -> int:
        return len(self._waiting)

    def admit(self, nbytes: int, give_up: threading.Event) -> None:
        """Refuse a row that could never be written (413), else wait for its room (`reserve`)."""
        if nbytes > self.limit:
            raise RequestError(
                f"the prompt's row file takes {nbytes:,} bytes, more than the spool's bound of {self.limit:,} "
                "(--spool-bytes); send a shorter prompt, or start the server with a larger --spool-bytes",
                status=413,
                param="prompt",
            )
        room = self._room()  # with every row of ours collected: nbytes is within the bound already
        if nbytes > room:
            mine = f" (this server's share of it: 1/{round(1 / self.share)}, --replicas)" if self.share < 1 else ""
            raise RequestError(
                f"the prompt's row file takes {nbytes:,} bytes, and the spool's filesystem has {room:,} free{mine} "
                f"even once every row of ours is collected ({self.root.parent}, --spool); free space there, or start "
                "the server with a --spool on a larger filesystem",
                status=413,
                param="prompt",
            )
        self.reserve(nbytes, give_up)

    def _room(self) -> int:
        """What our files and rows in flight may take: the bound, or less where the filesystem has less (rows in
        flight are not on the disk yet, so its free space alone would let concurrent rows overfill it), of which
        our share.  Looked at outside the lock: a slow filesystem holds up the request that looks, not the server."""
        ours = self._file_bytes  # read before the look: a file written between them errs low, counted in neither
        try:
            return min(self.limit, int(shutil.disk_usage(self.root).free * self.share) + ours)
        except OSError:  # a filesystem that fails one look (ESTALE, EIO): the bound, until the next look
            return self.limit

    def reserve(self, nbytes: int, give_up: threading.Event) -> None:
        """Wait for room, in the order the requests came (small rows must not starve a long one); raises a
        503 when `give_up` is set meanwhile (the client went away, or the server is stopping)."""
        ticket = object()
        with self._cond:
            self._waiting.append(ticket)
        try:
            while True:
                room = self._room()
                with self._cond:
                    if self._waiting[0] is ticket and not (self._bytes and self._bytes + nbytes > room):
                        self._bytes += nbytes
                        return
                    if give_up.is_set() or self._closed:
                        raise RequestError("the server is stopping, or the request was abandoned", status=503)
                    self._cond.wait(0.5)
        finally:
            with self._cond:
                self._waiting.remove(ticket)
                self._cond.notify_all()

    def written(self, paths: list[Path], reserved: int) -> None:
        """`paths[0]` is written and the rest are links to it, in place of `reserved` bytes held for them all:
        one group, its bytes counted once, until the last of its names is gone."""
        size = paths[0].stat().st_size
        with self._cond:
            group = next(self._group_ids)
            self._groups[group] = [size, len(paths)]
            self._bytes += size - reserved
            self._file_bytes += size
            now = time.monotonic()
            self._files.update((path, (group, now)) for path in paths)
            self._cond.notify_all()

    def hold(self, path: Path) -> None:
        """`path` is ours now, not the trainer's (going into the Mooncake store, which may make it wait for room
        past the TTL): it is never swept, and its bytes count until it is gone."""
        with self._cond:
            if path in self._files:
                self._files[path] = (self._files[path][0], math.inf)

    def remove(self, path: Path) -> None:
        """Remove a file nobody will read (its client went away); its bytes are free once no link holds them."""
        path.unlink(missing_ok=True)
        with self._cond:
            self._forget(path)
            self._cond.notify_all()

    def release(self, reserved: int) -> None:
        with self._cond:
            self._bytes -= reserved
            self._cond.notify_all()

    def _forget(self, path: Path) -> None:
        if path not in self._files:
            return
        group, _ = self._files.pop(path)
        counted = self._groups[group]
        counted[1] -= 1
        if not counted[1]:
            del self._groups[group]
            self._bytes -= counted[0]
            self._file_bytes -= counted[0]

    def sweep(self) -> None:
        """See which files the trainer took; remove those older than the TTL.  The `stat`s run outside the lock
        the requests and the engine thread need."""
        with self._cond:
            files = list(self._files.items())
        now = time.monotonic()
        gone = []
        for path, (_, at) in files:
            if now - at > self.ttl and path.exists():
                path.unlink(missing_ok=True)
                self.expired += 1
            if not path.exists():
                gone.append(path)
        if gone:
            with self._cond:
                for path in gone:
                    self._forget(path)
                self._cond.notify_all()

    def waiting(self) -> int:
        """Files written and not yet collected."""
        self.sweep()
        return len(self._files)

    def close(self) -> None:
        """The server is stopping: every request waiting for room gives up (503)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def clear(self) -> None:
        """Remove every state file of ours, written or half-written (the writer's temporary names)."""
        shutil.rmtree(hidden_state_path(self.root, 0).parent, ignore_errors=True)
        with self._cond:
            self._files.clear()
            self._groups.clear()
            self._bytes = self._file_bytes = 0
            self._cond.notify_all()


def folder_prefix() -> str:
    """Our folders' names start with this host's name: a spool on a shared filesystem holds several hosts' servers,
    and a lock is not seen across hosts on every filesystem."""
    return f"{FOLDER_PREFIX}{socket.gethostname()}."


def hold_folder(folder: Path) -> int | None:
    """Mark `folder` as a live server's for as long as the returned descriptor stays open (the process's life);
    None where the filesystem takes no locks."""
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in NO_LOCKS:
            return None
        raise
    return fd


def sweep_dead_servers(root: Path) -> tuple[int, int]:
    """Remove the row files that this host's servers which died without cleaning up (SIGKILL, a power cut) left
    in the spool `root`: in folders of ours by name, with a lock file nobody holds (their logs stay).  A live
    server's folder, another host's, one on a filesystem without locks, and anything else are left alone.
    Returns (folders, bytes) swept."""
    folders = removed = 0
    for folder in root.glob(f"{folder_prefix()}*"):
        rows, lock = hidden_state_path(folder, 0).parent, folder / LOCK_NAME
        if folder.is_symlink() or rows.is_symlink() or not rows.is_dir() or not lock.is_file():
            continue
        try:
            fd = os.open(lock, os.O_RDONLY)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: a live server's (or no locks here: nothing is known)
                continue
            size = _size(rows)
            shutil.rmtree(rows, ignore_errors=True)
            folders, removed = folders + 1, removed + size
        finally:
            os.close(fd)
    return folders, removed


def _size(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        try:
            total += path.lstat().st_size if path.is_file() and not path.is_symlink() else 0
        except OSError:  # gone meanwhile
            continue
    return total
