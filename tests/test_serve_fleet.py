"""`eagle-extract serve` under a trainer fleet: a row whose file cannot be written fails alone, a server killed
with SIGKILL leaves no engine behind, and the rows it left in the spool are swept by the next server's start
while a live server's are not.  One tiny Llama server (a vLLM start)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from .test_serve import Server, _alive, _eventually, _health

KEY = "s3cret"
AUTH = {"authorization": f"bearer {KEY}"}  # the scheme in lower case, as RFC 7235 allows


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory, tiny_llama):
    server = Server(tiny_llama, tmp_path_factory.mktemp("spool"), "--dtype", "float32", "--layers", "1,3",
                    "--api-key", KEY)  # fmt: skip
    yield server
    server.stop()


def test_a_row_whose_file_cannot_be_written_fails_alone_and_the_server_goes_on(tiny_server):
    s = tiny_server
    got, answer = s.post("/completions", {"prompt": [5, 6, 7]}, {"authorization": f"Bearer {KEY}x"})
    assert got == 401
    got, answer = s.post("/completions", {"prompt": [5, 6, 7]}, AUTH)
    assert got == 200
    served = Path(answer["kv_transfer_params"]["hidden_states_path"])
    index = int(served.stem.rpartition("_")[2])
    served.unlink()
    # the next row's file name is taken by a folder: its rename fails as a full or broken disk would
    blocker = served.with_name(f"hs_{index + 1}.safetensors")
    (blocker / "taken").mkdir(parents=True)
    got, answer = s.post("/completions", {"prompt": [8, 9, 10, 11]}, AUTH)
    assert got in (500, 507) and "could not be written" in answer["error"]["message"], answer
    assert _health(s, AUTH)["status"] == "ok"
    got, answer = s.post("/completions", {"prompt": [12, 13]}, AUTH)  # the next request is served
    assert got == 200, answer
    Path(answer["kv_transfer_params"]["hidden_states_path"]).unlink()
    (blocker / "taken").rmdir()
    blocker.rmdir()
    assert _eventually(lambda: _health(s, AUTH)["spool_bytes"] == 0, 3)  # the failed row's reservation went back


def test_sigkill_of_the_server_leaves_no_engine_and_the_next_start_sweeps_its_rows(tiny_server, tmp_path):
    from eagle_extract.files.spool import LOCK_NAME, folder_prefix, hold_folder, sweep_dead_servers

    s = tiny_server
    got, answer = s.post("/completions", {"prompt": list(range(100, 400))}, AUTH)  # a row nobody collects
    assert got == 200
    left = Path(answer["kv_transfer_params"]["hidden_states_path"])
    engine = s.engine()
    assert engine, "no engine process found"
    os.kill(s.proc.pid, signal.SIGKILL)
    s.proc.wait(timeout=10)
    deadline = time.monotonic() + 15
    while [p for p in engine if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in engine if _alive(p)], [p.pid for p in engine if _alive(p)]
    assert left.exists()  # what SIGKILL left; a live server's folder beside it must stay
    size = left.stat().st_size
    live = s.spool / f"{folder_prefix()}live"
    (live / "hidden_states").mkdir(parents=True)
    (live / "hidden_states" / "hs_0.safetensors").write_bytes(b"x" * 1000)
    held = hold_folder(live)
    try:
        folders, freed = sweep_dead_servers(s.spool)
    finally:
        os.close(held)
    assert folders == 1 and freed >= size
    assert not left.exists() and not left.parent.exists()
    assert (left.parent.parent / LOCK_NAME).exists()  # the dead server's folder and log stay; its rows are gone
    assert (live / "hidden_states" / "hs_0.safetensors").exists()
    assert sweep_dead_servers(s.spool) == (1, 1000)  # the live one, once its server is gone


def test_a_row_larger_than_the_spool_or_its_filesystem_is_refused_and_room_is_counted_once(tmp_path):
    """No engine: the spool's own bound and count."""
    from eagle_extract.errors import RequestError
    from eagle_extract.files.rowfile import hidden_state_path
    from eagle_extract.files.spool import Spool

    spool = Spool(tmp_path, limit=10_000, ttl=60)
    with pytest.raises(RequestError, match="--spool-bytes") as err:
        spool.admit(10_001, threading.Event())
    assert err.value.status == 413
    huge = Spool(tmp_path, limit=1 << 62, ttl=60)
    with pytest.raises(RequestError, match="--spool") as err:
        huge.admit(1 << 61, threading.Event())  # more than any disk here has free
    assert err.value.status == 413 and huge.used() == 0
    first, link, other = (hidden_state_path(tmp_path, i) for i in range(3))
    first.parent.mkdir(parents=True)
    spool.admit(4_000, threading.Event())  # identical prompts: the second is a hard link to the first's file
    spool.reserve(4_000, threading.Event())
    first.write_bytes(b"x" * 4_000)
    os.link(first, link)
    spool.written([first, link], reserved=8_000)
    assert spool.used() == 4_000
    spool.remove(first)  # its client went away: freed at once only when no other name holds the bytes
    assert spool.used() == 4_000
    link.unlink()  # collected by the trainer; another row may now take its inode number
    spool.reserve(100, threading.Event())
    other.write_bytes(b"y" * 100)
    spool.written([other], reserved=100)
    spool.sweep()
    assert spool.used() == 100  # the new file is its own, whatever inode it got
    other.unlink()
    spool.sweep()
    assert spool.used() == 0
    given_up = threading.Event()
    spool.reserve(9_000, threading.Event())
    threading.Timer(0.2, given_up.set).start()
    with pytest.raises(RequestError) as err:
        spool.reserve(2_000, given_up)  # a request whose client went away while it waited for room
    assert err.value.status == 503 and spool.used() == 9_000
    spool.close()  # the server stops: whoever still waits gives up
    with pytest.raises(RequestError):
        spool.reserve(2_000, threading.Event())


PARENT = """
import os, subprocess, sys, time
sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
kept = subprocess.Popen(sleep)  # running before the guard: not the engine's
guard = [sys.executable, "-I", sys.argv[1], str(os.getpid()), str(kept.pid)]
guard = subprocess.Popen(guard, stdin=subprocess.PIPE, start_new_session=True)
spawner = f"import subprocess, time; subprocess.Popen({sleep!r}); time.sleep(60)"
child = subprocess.Popen([sys.executable, "-c", spawner])
time.sleep(2)  # the guard has seen the child and its own child
if sys.argv[2] == "dismiss":
    guard.communicate(b"done\\n")
print(kept.pid, child.pid, guard.pid, flush=True)
time.sleep(60)
"""


def test_the_guard_stops_a_dead_parents_processes_and_nothing_else(tmp_path):
    """guard.py on its own: a parent killed with SIGKILL leaves its children and theirs stopped (a process it
    told the guard to ignore stays); a parent that dismissed its guard leaves everything running."""
    import subprocess
    import sys

    import eagle_extract.job.guard as guard

    def family(how: str):
        script = tmp_path / "parent.py"
        script.write_text(PARENT)
        parent = subprocess.Popen([sys.executable, str(script), guard.__file__, how], stdout=subprocess.PIPE, text=True)
        kept, child, guard_pid = map(int, parent.stdout.readline().split())
        tree = [psutil.Process(child), *psutil.Process(child).children(recursive=True)]
        assert len(tree) == 2
        parent.kill()
        parent.wait()
        return psutil.Process(kept), tree, guard_pid

    kept, tree, guard_pid = family("die")
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in tree) and _alive(kept)
    assert not psutil.pid_exists(guard_pid) or not _alive(psutil.Process(guard_pid))
    kept.kill()
    kept, tree, _ = family("dismiss")
    time.sleep(2)
    assert all(_alive(p) for p in tree) and _alive(kept)
    for proc in [*tree, kept]:
        proc.kill()
