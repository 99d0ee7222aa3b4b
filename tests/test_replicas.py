"""`eagle-extract serve --replicas 2` on Ray Serve: two engines of the tiny Llama behind one endpoint, against
speculators 0.9's own client in several threads, every row checked against transformers in float32.  Both
replicas serve rows; a prompt's copies sent together run once, on one replica; one replica's engine is killed
while rows are asked for: every request is still answered (speculators' client retries), the replica comes back,
and no row is left in the spool; SIGTERM stops both."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import torch

from .common import Reference, rel_err
from .test_serve import Server, _alive, _dataset, _online_dataset

LAYERS = [1, 3, 6]  # --layers 1,3 and the final slot (the input of the final norm)


def _health(server: Server) -> dict:
    with urllib.request.urlopen(server.url.removesuffix("/v1") + "/health", timeout=30) as r:
        return json.loads(r.read())


def _row_files(spool: Path) -> list[Path]:
    return [p for folder in spool.glob("eagle-extract-serve.*") for p in (folder / "hidden_states").rglob("*.*")]


def _rows(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 200, (n,), generator=g).tolist()
    return [torch.randint(100, 40000, (length,), generator=g).tolist() for length in lengths]


def _check(server: Server, rows: list[list[int]], datapath: Path, ref: Reference, threads: int, during=None) -> None:
    from hs_connectors import FileTransfer

    online = _online_dataset(datapath, server, FileTransfer(datapath / "hidden_states"))
    online.max_retries = 3  # speculators' default: the requests a dying replica answers 503 are asked again
    with ThreadPoolExecutor(threads) as pool:
        items = pool.map(online.__getitem__, range(len(rows)))
        if during:
            during()
        items = list(items)
    for ids, item in zip(rows, items):
        assert isinstance(item, dict), item  # not SampleUnavailable
        assert item["input_ids"].tolist() == ids
        got = torch.cat([item["hidden_states"].unflatten(1, (2, -1)), item["verifier_last_hidden_states"][:, None]], 1)
        assert rel_err(got, ref.slots(ids, LAYERS)) < 1e-4


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory, tiny_llama):
    spool = tmp_path_factory.mktemp("spool_replicas")
    server = Server(tiny_llama, spool, "--replicas", "2", "--dtype", "float32", "--layers", "1,3")
    yield server
    server.stop()


def test_two_replicas_serve_speculators_client_transformers_states(two_replicas, tiny_llama, tmp_path):
    rows = _rows(16, seed=1)
    _check(two_replicas, rows, _dataset(tmp_path / "data", rows), Reference(tiny_llama), threads=6)
    replicas = _health(two_replicas)["replicas"]
    assert sorted(r["rank"] for r in replicas.values()) == [0, 1], replicas
    assert all(r["rows"] > 0 for r in replicas.values()), replicas  # both served
    assert sum(r["rows"] for r in replicas.values()) >= len(rows)
    assert _row_files(two_replicas.spool) == []  # the reader deleted every file


def test_a_prompts_copies_sent_together_run_once_on_one_replica(two_replicas, tiny_llama):
    """The front draws a prompt's copies in flight to the replica running it, whose engine joins those still in
    flight there (links to one file; a copy that reaches the engine after the row is written runs again, so the
    test counts runs only across all prompts), and spreads the other prompts: 8 prompts, 4 copies of each sent
    together behind 8 longer rows that keep both engines busy while the copies arrive."""
    from safetensors.torch import load_file

    before = _health(two_replicas)["replicas"]
    g = torch.Generator().manual_seed(3)
    ballast, prompts = ([torch.randint(100, 40000, (n,), generator=g).tolist() for _ in range(8)] for n in (1000, 500))

    def ask(ids: list[int], barrier: threading.Barrier | None = None) -> Path:
        if barrier:
            barrier.wait()
        status, answer = two_replicas.post("/completions", {"prompt": ids})
        assert status == 200, answer
        return Path(answer["kv_transfer_params"]["hidden_states_path"])

    barrier = threading.Barrier(32)
    with ThreadPoolExecutor(40) as pool:
        held = [pool.submit(ask, ids) for ids in ballast]
        time.sleep(0.3)
        paths = list(pool.map(lambda i: ask(prompts[i % 8], barrier), range(32)))
        held = [future.result() for future in held]
    ref = Reference(tiny_llama)
    try:
        for p, ids in enumerate(prompts):
            copies = paths[p::8]
            assert len({path.parent.parent for path in copies}) == 1, copies  # one replica's spool folder
            row = load_file(str(copies[0]))
            assert row["token_ids"].tolist() == ids
            assert rel_err(row["hidden_states"], ref.slots(ids, LAYERS)) < 1e-4
        runs = len({path.stat().st_ino for path in paths})
        assert runs < len(paths), runs  # copies joined in the engine: links to one file
    finally:
        for path in paths + held:
            path.unlink()
    deadline = time.monotonic() + 10
    while True:  # the replicas' counts reach the tally every half second
        after = _health(two_replicas)["replicas"]
        rose = {r["rank"]: r["rows"] - before[replica]["rows"] for replica, r in after.items() if replica in before}
        if sum(rose.values()) >= 40 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert sum(rose.values()) == 40 and sorted(rose) == [0, 1] and min(rose.values()) > 0, rose  # both served


def test_a_replica_whose_engine_dies_comes_back_and_every_request_is_answered(two_replicas, tiny_llama, tmp_path):
    before = _health(two_replicas)["replicas"]
    victim = psutil.Process(next(r["pid"] for r in before.values() if r["rank"] == 0))
    engine = [p for p in victim.children(recursive=True) if p.name().startswith("VLLM::")]
    assert engine, "no vLLM engine process under replica 0"

    def kill_engine() -> None:
        time.sleep(1)  # some rows in flight
        for p in engine:
            p.kill()

    rows = _rows(24, seed=2)
    _check(two_replicas, rows, _dataset(tmp_path / "data", rows), Reference(tiny_llama), threads=4, during=kill_engine)
    time.sleep(1)
    assert not [p for p in engine if _alive(p)]  # the dead replica's engine processes are gone
    deadline = time.monotonic() + 240
    while True:  # Ray Serve starts a replica in its place, in a new process with a new engine
        now = _health(two_replicas)["replicas"]
        if len(now) == 2 and victim.pid not in [r["pid"] for r in now.values()] and not any(
            r["failed"] for r in now.values()
        ):
            break
        assert time.monotonic() < deadline, (now, "".join(two_replicas.lines[-20:]))
        time.sleep(2)
    assert any("the engine failed" in line and "starts this replica again" in line for line in two_replicas.lines)
    assert _row_files(two_replicas.spool) == []  # the dead replica's rows went with its engine

    two_replicas.proc.terminate()
    assert two_replicas.proc.wait(timeout=180) == 0, "".join(two_replicas.lines[-20:])
    assert two_replicas.lines[-1].startswith("stopped: "), two_replicas.lines[-5:]
    assert _row_files(two_replicas.spool) == []


def test_the_server_stops_once_no_replica_can_start_again():
    """Ray Serve tries a replica that fails after it served again for ever; with none serving, the trainers would
    wait on 503s for ever: once every replica's restart failed twice the server stops, naming the last cause."""
    from eagle_extract.errors import ExtractError
    from eagle_extract.faces.fleet import _still_failing

    healthy, dead = {"a": {"failed": None}, "b": {"failed": "engine died"}}, {"b": {"failed": "engine died"}}
    tries = [(0, "x"), (1, "y"), (0, "x"), (1, "y")]
    assert _still_failing(tries, healthy, 2) == []  # one replica serves: the count starts again
    assert _still_failing([(0, "x")] * 5, dead, 2) == [(0, "x")] * 5  # replica 1 is still loading: wait for it
    assert _still_failing(tries[:3], {}, 2) == tries[:3]  # replica 1 failed once only
    recovered = _still_failing(tries[:3], healthy, 2)  # both came back: the old tries no longer count
    assert _still_failing([*recovered, (1, "y")], dead, 2) == [(1, "y")]
    with pytest.raises(ExtractError) as stopped:
        _still_failing([*tries[:3], (1, "--model /m: no such folder")], dead, 2)
    assert str(stopped.value) == (
        "no replica could start again (4 tries; the last, replica 1: --model /m: no such folder); the server stops: "
        "fix that and start it again"
    )
