"""The engine's guard: a small process that outlives its parent and stops the engine processes the parent
started when the parent dies without stopping them (SIGKILL, the kernel's OOM killer), so no engine keeps
its GPUs and memory after its server or run is gone.

Run as a script (no import of the package or vLLM): `python guard.py PARENT_PID IGNORED_PID...`.  While
the parent lives it notes, every SCAN_S, the parent's descendants that are not the ones named (those that
were running before the engine, and itself).  A line `done` on stdin ends it with nothing stopped: the
parent stopped its engine itself.  End of stdin without it (the parent died, its pipe closed) freezes each
process noted, and any child they start meanwhile, then kills them all, but for Python's multiprocessing
resource tracker: once the processes that used it are gone it removes the shared memory and semaphores they
left (vLLM's message queues in /dev/shm, hundreds of MB each), then ends; the guard kills it only if it
outlives TRACKER_S.  What of Python's in /dev/shm the processes noted mapped (read every MAPS_S) and is still
there then, the guard removes: a SIGKILL to the whole process group (`kill -9 -PGID`) kills the tracker too,
but not the guard, which runs in a session of its own.  A line `rm PATH` names a temporary file or folder of
the engine's (the watch's heartbeat, vLLM's sockets' folder), which the guard removes after the processes;
only those names (TEMPORARY): a mangled line cannot name a user's folder.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import sys
import time

SCAN_S = 0.2  # a process started less than this before the parent's death can be missed
TRACKER_S = 10.0  # for the resource tracker to clean up after the processes killed, and end
TRACKER = "from multiprocessing.resource_tracker import main;"  # its `-c` program (3.8 to 3.14)
MAPS_S = 2.0  # how often the files the processes noted map in /dev/shm are read
SHM = "/dev/shm"
PYTHON_SHM = {"psm_": "shared_memory", "sem.mp-": "semaphore"}  # Python's names there, by the tracker's kind
TEMPORARY = (b"eagle_extract_heartbeat.", b"ee-")  # the names of what `rm` lines may name (watch.py, engine.py)


def _started(proc) -> float | None:
    """When `proc` (a psutil.Process or a pid) started; None when it is gone."""
    import psutil

    try:
        return (proc if isinstance(proc, psutil.Process) else psutil.Process(proc)).create_time()
    except psutil.Error:
        return None


def _descendants(parent, ignored: dict[int, float | None]) -> dict[int, object]:
    """The parent's descendants but those named to be ignored (the same processes: a reused pid is not one)."""
    import psutil

    try:
        children = parent.children(recursive=True)
    except psutil.Error:
        return {}
    return {p.pid: p for p in children if p.pid not in ignored or _started(p) != ignored[p.pid]}


def _tracker(proc) -> bool:
    import psutil

    try:
        return any(arg.startswith(TRACKER) for arg in proc.cmdline())  # not a -W option naming the module
    except psutil.Error:
        return False


def stop_tree(noted: dict[int, object]) -> list:
    """SIGSTOP what was noted and still is the same process (a pid may be reused), then their children, until
    no new one appears; then SIGKILL them all.  A resource tracker among them is left running (it cleans up
    once its users are gone): returned."""
    import psutil

    frozen: dict[int, object] = {}
    trackers = []
    todo = list(noted.values())
    while todo:
        proc = todo.pop()
        if proc.pid in frozen or proc in trackers:
            continue
        try:
            if not proc.is_running():  # compares the creation time: a reused pid is another process
                continue
            if _tracker(proc):
                trackers.append(proc)
                continue
            proc.send_signal(signal.SIGSTOP)
            frozen[proc.pid] = proc
            todo.extend(proc.children())
        except psutil.Error:
            continue
    for proc in frozen.values():
        _send(proc, signal.SIGKILL, signal.SIGCONT)
    for proc in trackers:  # one stopped with its process group (Ctrl-Z) must run to read its pipe's end
        _send(proc, signal.SIGCONT)
    return trackers


def _send(proc, *signals: int) -> None:
    """The signals in order, to a process that may be gone."""
    import psutil

    try:
        for sig in signals:
            proc.send_signal(sig)
    except psutil.Error:
        pass


def shm_inodes(pids) -> set[int]:
    """The inodes of the files in /dev/shm that these processes map (a semaphore's under the name it had
    before it was linked to its own)."""
    inodes = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    fields = line.split(None, 5)
                    if len(fields) == 6 and fields[5].startswith(f"{SHM}/"):
                        inodes.add(int(fields[4]))
        except (OSError, ValueError):
            continue
    return inodes


def remove_shm(inodes: set[int]) -> list[str]:
    """Unlink Python's shared memory and semaphores among `inodes` (another program's file stays: its owner
    removes it); returns the names removed."""
    try:
        with os.scandir(SHM) as entries:
            found = [e for e in entries if e.name.startswith(tuple(PYTHON_SHM)) and e.inode() in inodes]
    except OSError:  # no /dev/shm
        return []
    removed = []
    for entry in found:
        try:
            os.unlink(entry.path)
        except FileNotFoundError:
            continue
        removed.append(entry.name)
    return removed


def read_lines(unread: bytes, chunk: bytes) -> tuple[bytes, list[bytes], bool]:
    """The parent's lines so far: what is left of a line cut between reads, the paths `rm` lines named, and
    whether `done` came."""
    *lines, unread = (unread + chunk).split(b"\n")
    named = [line[3:] for line in lines if line.startswith(b"rm ")]
    return unread, [path for path in named if os.path.basename(path).startswith(TEMPORARY)], b"done" in lines


def remove_temporary(paths: list[bytes]) -> None:
    for path in paths:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)


def main(argv: list[str]) -> None:
    import psutil

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a terminal's Ctrl-C or a scheduler's
        signal.signal(sig, signal.SIG_IGN)  # SIGTERM to the whole group must not end the guard before its parent
    parent = psutil.Process(int(argv[0]))
    ignored = {pid: _started(pid) for pid in [*map(int, argv[1:]), os.getpid()]}
    noted: dict[int, object] = {}
    mapped: set[int] = set()
    leftovers: list[bytes] = []
    looked = time.monotonic()
    stdin = sys.stdin.fileno()
    unread = b""

    def read() -> tuple[bytes, bool]:
        """One read of the parent's pipe: what came (b"" once the parent is gone) and whether `done` came."""
        nonlocal unread
        chunk = os.read(stdin, 4096)
        unread, named, done = read_lines(unread, chunk)
        leftovers.extend(named)
        return chunk, done

    while True:
        ready, _, _ = select.select([stdin], [], [], SCAN_S)
        if ready:
            chunk, done = read()
            if done:
                return
            if not chunk:  # the parent is gone
                break
        noted = {pid: proc for pid, proc in noted.items() if proc.is_running()}  # those gone, forgotten
        noted.update(_descendants(parent, ignored))
        if time.monotonic() - looked > MAPS_S:
            looked = time.monotonic()
            mapped |= shm_inodes(noted)
        if not parent.is_running():
            break
    while select.select([stdin], [], [], 0)[0]:  # what the parent wrote just before its end
        chunk, done = read()
        if done:
            return
        if not chunk:
            break
    _, left = psutil.wait_procs(stop_tree(noted), timeout=TRACKER_S)
    for proc in left:  # another process still holds its pipe: nothing it could clean up yet
        _send(proc, signal.SIGKILL)
    remove_shm(mapped)  # what the tracker, killed with them, could not
    remove_temporary(leftovers)


if __name__ == "__main__":
    main(sys.argv[1:])
