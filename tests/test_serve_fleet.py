"""`eagle-extract serve` under a trainer fleet, the parts that need no engine: the API key, the spool's bound and
count, and the engine's guard.  (With an engine: tests/test_serve.py, and tests/test_mooncake.py's SIGKILL.)"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from .test_serve import _alive

KEY = "s3cret"


def test_the_api_key_is_checked_with_any_case_of_the_scheme():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from eagle_extract.faces.routes import _Authorized

    app = FastAPI()
    app.get("/health")(lambda: {"status": "ok"})
    app.add_middleware(_Authorized, key=KEY)
    client = TestClient(app)
    for header, status in [(f"Bearer {KEY}", 200), (f"bearer {KEY}", 200), (f"BEARER  {KEY}", 200),
                           (f"Bearer {KEY}x", 401), (KEY, 401), ("", 401)]:  # fmt: skip
        got = client.get("/health", headers={"authorization": header} if header else {})
        assert got.status_code == status, (header, got.status_code)
        assert status == 200 or got.json()["error"]["code"] == 401


def test_sampling_options_are_read_as_vllm_reads_them_and_numbers_equal_to_the_allowed_ones_pass():
    """No text is generated, so these options change nothing; what vLLM's server accepts (pydantic's lax mode:
    "1", 1.0 and true are 1) passes, what it refuses is refused naming the field."""
    import json

    from eagle_extract.errors import RequestError
    from eagle_extract.faces.requests import Requests

    requests = Requests("m", None, 100, 8, 1000, None)
    for fine in [{"n": 1.0}, {"n": "1"}, {"best_of": 1}, {"top_logprobs": 0.0}, {"max_tokens": 1.0},
                 {"max_tokens": "1"}, {"max_tokens": None}, {"seed": True}, {"temperature": 0}, {"top_p": "0.9"},
                 {"max_completion_tokens": 1}]:  # fmt: skip
        assert requests.parse(json.dumps(fine).encode()) == fine
    for bad, param, said in [({"max_tokens": "one"}, "max_tokens", 'give an integer, not "one"'),
                             ({"max_tokens": 1.5}, "max_tokens", "give an integer, not 1.5"),
                             ({"seed": [7]}, "seed", "give an integer, not [7]"),
                             ({"temperature": "hot"}, "temperature", 'give a number, not "hot"'),
                             ({"top_p": {}}, "top_p", "give a number, not {}"),
                             ({"n": 2.0}, "n", "leave n out"), ({"n": "2"}, "n", "leave n out")]:  # fmt: skip
        with pytest.raises(RequestError) as refused:
            requests.parse(json.dumps(bad).encode())
        assert refused.value.param == param and str(refused.value).endswith(said), (bad, str(refused.value))


def test_text_no_tokenizer_encodes_is_refused_naming_its_field(smollm2):
    """A lone surrogate (valid JSON, no Unicode character), and whatever the chat template raises, name the field."""
    from transformers import AutoTokenizer

    from eagle_extract.errors import RequestError
    from eagle_extract.faces.requests import Requests

    requests = Requests("m", AutoTokenizer.from_pretrained(smollm2), 100, 8, 49152, None)
    cases = [(b'{"prompt": "ab\\ud800"}', False, "prompt",
              "prompt: the text holds a lone surrogate (U+D800 at character 2)"),
             (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', True, "messages",
              "messages[0].content: the text holds a lone surrogate (U+DFFF at character 0)"),
             (b'{"messages": [{"content": "hi"}]}', True, "messages",
              "messages: the chat template refused them")]  # fmt: skip
    for raw, chat, param, said in cases:
        with pytest.raises(RequestError) as refused:
            requests.tokens(requests.parse(raw), chat)
        assert refused.value.param == param and str(refused.value).startswith(said), str(refused.value)


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


def test_rows_in_flight_count_against_the_spools_filesystem_when_it_holds_less_than_the_bound(small_disk):
    """A --spool-bytes larger than its filesystem: concurrent rows wait for room there instead of each passing
    the free-space check and then failing to be written (507)."""
    from eagle_extract.errors import RequestError
    from eagle_extract.files.spool import Spool

    spool = Spool(small_disk, limit=1 << 40, ttl=60)
    row = shutil.disk_usage(small_disk).free * 2 // 5
    for _ in range(2):
        spool.admit(row, threading.Event())
    given_up = threading.Event()
    threading.Timer(0.3, given_up.set).start()
    with pytest.raises(RequestError) as err:
        spool.admit(row, given_up)  # a third would not fit on the disk: it waits (here until its client goes)
    assert err.value.status == 503 and spool.used() == 2 * row
    spool.release(row)  # a row in flight is answered or fails: room again
    spool.admit(row, threading.Event())
    assert spool.used() == 2 * row
    spool.release(2 * row)
    halves = [Spool(small_disk, limit=1 << 40, ttl=60, share=0.5) for _ in range(2)]  # two replicas, one disk
    for half in halves:
        half.admit(row, threading.Event())  # each takes its share of the free space; nothing more fits
    for half in halves:
        gone = threading.Event()
        threading.Timer(0.3, gone.set).start()
        with pytest.raises(RequestError) as err:
            half.admit(row, gone)
        assert err.value.status == 503 and half.used() == row  # it waited (for room that did not come)
    lone = Spool(small_disk, limit=1 << 40, ttl=60, share=0.5)
    with pytest.raises(RequestError, match=r"free \(this server's share of it: 1/2, --replicas\)") as err:
        lone.admit(shutil.disk_usage(small_disk).free * 3 // 5, threading.Event())  # past its share: never
    assert err.value.status == 413


PARENT = """
import multiprocessing, os, subprocess, sys, time


def hold(names):  # as vLLM's engine core: a spawned process makes the message queues, and the resource
    from multiprocessing import shared_memory  # tracker (a process started with it) unlinks one once every
    queue = shared_memory.SharedMemory(create=True, size=1 << 20)  # process holding its pipe is gone
    names.put(queue.name)
    time.sleep(60)


if __name__ == "__main__":  # the spawned process below imports this file again
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    kept = subprocess.Popen(sleep)  # running before the guard: not the engine's
    guard = [sys.executable, "-I", sys.argv[1], str(os.getpid()), str(kept.pid)]
    guard = subprocess.Popen(guard, stdin=subprocess.PIPE, start_new_session=True)
    files = ("ee-1", "eagle_extract_heartbeat.1", "mine")
    sockets, heartbeat, mine = (os.path.join(sys.argv[3], name) for name in files)
    os.mkdir(sockets)
    for path in (os.path.join(sockets, "a-socket"), heartbeat, mine):
        open(path, "w").close()
    guard.stdin.write(f"rm {sockets}\\nrm {heartbeat}\\nrm {mine}\\n".encode())  # not ours by its name: kept
    guard.stdin.flush()
    spawn = multiprocessing.get_context("spawn")
    names = spawn.Queue()
    user = spawn.Process(target=hold, args=(names,))
    user.start()
    queue = names.get(timeout=60)
    spawner = f"import subprocess, time; subprocess.Popen({sleep!r}); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", spawner])
    import psutil
    deadline = time.monotonic() + 30
    while not psutil.Process(child.pid).children() and time.monotonic() < deadline:  # a loaded machine is slow
        time.sleep(0.05)
    time.sleep(3)  # the guard has seen the child and its own child (every 0.2 s), and what they map (every 2 s)
    if sys.argv[2] == "dismiss":
        guard.communicate(b"done\\n")
    print(kept.pid, child.pid, user.pid, guard.pid, queue, flush=True)
    time.sleep(60)
"""


def test_the_guard_stops_a_dead_parents_processes_and_nothing_else(tmp_path):
    """guard.py on its own: a parent killed with SIGKILL leaves its children and theirs stopped (a process it
    told the guard to ignore stays), and no shared memory behind: the resource tracker, spared, removes what
    the dead registered, and the guard what they mapped where a SIGKILL to the whole group killed the tracker
    too, and the temporary files the parent named (and no other file); a parent that dismissed its guard leaves
    everything running, and every file."""
    import subprocess
    import sys

    import eagle_extract.job.guard as guard

    def family(how: str):
        script = tmp_path / "parent.py"
        script.write_text(PARENT)
        (tmp_path / how).mkdir()
        parent = subprocess.Popen([sys.executable, str(script), guard.__file__, how, str(tmp_path / how)],
                                  stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
        *pids, queue = parent.stdout.readline().split()
        kept, child, user, guard_pid = map(int, pids)
        tree = [psutil.Process(child), *psutil.Process(child).children(recursive=True)]
        assert len(tree) == 2
        tree.append(psutil.Process(user))
        tracker = [p for p in psutil.Process(parent.pid).children() if "resource_tracker" in " ".join(p.cmdline())]
        assert len(tracker) == 1 and Path(f"/dev/shm/{queue}").exists()
        kept = psutil.Process(kept)
        if how == "group":  # `kill -9 -PGID`: all but the guard, which runs in a session of its own
            os.killpg(parent.pid, signal.SIGKILL)
        else:
            parent.kill()
        parent.wait()
        return kept, tree, tracker[0], guard_pid, Path(f"/dev/shm/{queue}")

    for how in ("die", "group"):
        kept, tree, tracker, guard_pid, queue = family(how)
        gone = [*tree, tracker, *([psutil.Process(guard_pid)] if psutil.pid_exists(guard_pid) else [])]
        deadline = time.monotonic() + 15
        while (any(_alive(p) for p in gone) or queue.exists()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in gone)  # the guard too: it waited for the tracker's end
        assert not queue.exists(), how  # the tracker, spared, removed it; killed with its group, the guard did
        assert _alive(kept) == (how == "die")
        assert [p.name for p in (tmp_path / how).iterdir()] == ["mine"], how  # only the engine's
        if how == "die":
            kept.kill()
    kept, tree, _, _, queue = family("dismiss")
    time.sleep(2)
    assert all(_alive(p) for p in tree) and _alive(kept)
    assert sorted(p.name for p in (tmp_path / "dismiss").iterdir()) == ["eagle_extract_heartbeat.1", "ee-1", "mine"]
    assert queue.exists()  # the tracker waits for every user of its pipe: here the spawned one lives on
    for proc in [*tree, kept]:
        proc.kill()
    deadline = time.monotonic() + 15  # the tracker removes it once its last user is gone
    while queue.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not queue.exists()


def test_the_guard_reads_whole_lines_and_only_the_engines_temporary_names():
    """A parent's line may reach the guard in two reads; `done` ends it whatever came with it; a path whose
    name is not one of the engine's temporary files is never named for removal, nor is a line's cut end."""
    from eagle_extract.job.guard import read_lines

    unread, named, done = read_lines(b"", b"rm /t/ee-ab\nrm /t/eagle_extract_heart")
    assert (unread, named, done) == (b"rm /t/eagle_extract_heart", [b"/t/ee-ab"], False)
    unread, named, done = read_lines(unread, b"beat.x\nrm /home/me\nrm /t/my ee-x\nrm /t/with space/ee-2\n")
    assert (unread, named, done) == (b"", [b"/t/eagle_extract_heartbeat.x", b"/t/with space/ee-2"], False)
    assert read_lines(b"", b"rm /t/ee-3\ndone\n") == (b"", [b"/t/ee-3"], True)
    assert read_lines(b"do", b"ne") == (b"done", [], False)  # not yet a line


def _hold_shared_memory(names) -> None:
    from multiprocessing import shared_memory

    segment = shared_memory.SharedMemory(create=True, size=1 << 20)  # as vLLM's queues: made by a spawned child
    names.put(segment.name)
    time.sleep(60)


def test_the_shared_memory_a_killed_engine_made_is_removed_at_once(tmp_path):
    """The clean-up of EngineWatch.end_engine and of the guard on its own: what a spawned process mapped in
    /dev/shm is found by its inode and removed once the process is killed (its resource tracker would remove
    it only when the run's process ends); a file of /dev/shm that it did not map stays."""
    import multiprocessing

    from eagle_extract.job.guard import remove_shm, shm_inodes

    ctx = multiprocessing.get_context("spawn")
    names = ctx.Queue()
    child = ctx.Process(target=_hold_shared_memory, args=(names,))
    child.start()
    segment = Path("/dev/shm") / names.get(timeout=60)
    other = Path("/dev/shm") / f"psm_eagle_test_{os.getpid()}"
    other.write_bytes(b"x")  # Python's name, not the child's: not removed
    try:
        made = shm_inodes([child.pid]) - shm_inodes([os.getpid()])
        child.kill()
        child.join()
        assert segment.exists()  # nothing removes it yet: the tracker outlives the child
        assert remove_shm(made) == [segment.name]
        assert not segment.exists() and other.exists()
    finally:
        other.unlink()


class _Loop:
    """The engine loop's side of a request (no engine: what is tested is the routes' handling of a request
    the front cancels): submit gives a future the test answers; abandoned rows are counted."""

    def __init__(self) -> None:
        from concurrent.futures import Future

        self.futures: list[Future] = []
        self.abandoned, self.failed, self.rows, self.tokens, self.redone = 0, None, 0, 0, 0
        self.steps, self.step_s, self.drain_s, self.worker_s, self.starved_s = 0, 0.0, 0.0, 0.0, 0.0  # /metrics
        self.make = Future

    def submit(self, ids, nbytes):
        future = self.make()
        self.futures.append(future)
        return future

    def count_abandoned(self) -> None:
        self.abandoned += 1

    def waiting(self) -> int:
        return 0


def test_a_request_the_front_cancels_never_runs_or_has_its_row_removed(tmp_path, smollm2):
    """`serve --replicas`' front cancels the replica's call (routes.run_asgi) when its client goes away: before
    the row runs, its future is cancelled (the loop drops it); once it runs, the row's file is removed as soon as
    it is written."""
    import asyncio
    import json

    from transformers import AutoTokenizer

    from eagle_extract.config import ServeOptions
    from eagle_extract.faces.requests import Requests
    from eagle_extract.faces.routes import make_app, run_asgi
    from eagle_extract.files.rowfile import HEADER_BOUND
    from eagle_extract.files.spool import Spool

    loop, spool = _Loop(), Spool(tmp_path, 10**9, 600)
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    requests = Requests("m", tokenizer, 100, 8, len(tokenizer), None)
    app = make_app(loop, spool, requests, ServeOptions(), 100, None, cancelled_by_host=True)
    body = json.dumps({"model": "m", "prompt": [1, 2, 3]}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]

    async def request(answer) -> None:
        task = asyncio.create_task(run_asgi(app, "POST", "/v1/completions", b"", headers, body))
        count = len(loop.futures)
        while len(loop.futures) == count:
            await asyncio.sleep(0.01)
        await answer(loop.futures[-1], task)
        assert task.cancelled()  # not answered

    async def cancelled_before_it_runs(future, task) -> None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.1)
        assert future.cancelled() and loop.abandoned == 0  # the loop drops it, and counts it then
        spool.release(24 + HEADER_BOUND)  # as the loop does for a row it drops: 3 tokens of 8 bytes, and a header

    async def cancelled_while_it_runs(future, task) -> None:
        assert future.set_running_or_notify_cancel()  # in the engine: it can no longer be dropped
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        row = tmp_path / "hs_0.safetensors"
        row.write_bytes(b"x" * 24)
        spool.written([row], 24 + HEADER_BOUND)
        future.set_result(str(row))
        for _ in range(100):
            if not row.exists() and loop.abandoned == 1:
                break
            await asyncio.sleep(0.02)
        assert not row.exists() and loop.abandoned == 1 and spool.used() == 0

    async def both() -> None:
        await request(cancelled_before_it_runs)
        await request(cancelled_while_it_runs)

    asyncio.run(both())
    assert not app.state.live and not app.state.cleanups  # nothing held
