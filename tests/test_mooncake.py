"""`eagle-extract serve --transfer mooncake` against speculators 0.9's own online client with its own Mooncake
reader (ArrowDataset with hs-connectors' MooncakeTransfer, built by speculators' `MooncakeBackend`), over a real
Mooncake master and store on loopback TCP; checked against transformers in float32.  Also: the objects bounded in
bytes (a request waits for room, an uncollected object goes after the TTL), the master stopped and restarted, and
a master that does not answer at start.

One vLLM start: the tiny Llama in float32.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import pytest
import torch

from eagle_extract.job.engine import own_socket_folder

from .common import Reference, engine_temporary, rel_err
from .test_serve import Server, _alive, _dataset, _free_port, _online_dataset

TTL_S = 8  # --spool-ttl of the server: an uncollected object goes this long after it was put
SEGMENT_GIB = 1 / 64  # the server's segment, Mooncake's least: 16 MiB, of which 80% for our objects
LAYERS = [0, 1, 2, 3, 4]  # and the final slot, 6: 3,072 bytes a token in float32
pytestmark = pytest.mark.usefixtures("loopback")


@pytest.fixture(scope="module")
def loopback():
    """Both ends announce themselves on loopback (hs-connectors reads MOONCAKE_LOCAL_HOSTNAME)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")
        yield


class Master:
    """A `mooncake_master` on loopback, on a port of its own."""

    def __init__(self, log: Path) -> None:
        self.port, self.log = _free_port(), log
        self.address = f"127.0.0.1:{self.port}"
        self.start()

    def start(self) -> None:
        binary = Path(sys.executable).parent / "mooncake_master"
        self.proc = subprocess.Popen([str(binary), f"--rpc_port={self.port}", "--rpc_address=127.0.0.1",
                                      f"--metrics_port={_free_port()}", "--enable_metric_reporting=false"],
                                     stdout=self.log.open("a"), stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()[-2000:]
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    master = Master(tmp_path_factory.mktemp("mooncake") / "master.log")
    yield master
    master.stop()


def _transfer(master: Master):
    """The trainer's reader, as `speculators train --hidden-states-backend mooncake` builds it."""
    from hs_connectors.transfer import MooncakeBackend

    args = argparse.Namespace(mooncake_master=master.address, mooncake_metadata_server="P2PHANDSHAKE",
                              mooncake_protocol="tcp", mooncake_device="", mooncake_global_segment_gib=SEGMENT_GIB,
                              mooncake_local_buffer_gib=SEGMENT_GIB)  # fmt: skip
    return MooncakeBackend.from_train_args(args, "unused")


def test_an_object_put_from_a_row_file_is_what_hs_connectors_reads(master, tmp_path):
    """No engine: a row file as the capture writes it goes into the store, hs-connectors' own reader unpacks
    it, bf16 and float32; its removal frees the room, and close() leaves no object of ours."""
    from eagle_extract.faces.mooncake import MooncakeObjects, StoreSettings
    from eagle_extract.files.rowfile import hidden_state_path
    from eagle_extract.files.writer import write_hidden_states

    objects = MooncakeObjects(StoreSettings(master=master.address, global_segment_gib=SEGMENT_GIB), ttl=60)
    objects.connect()
    reader = _transfer(master)
    reader.setup()
    (tmp_path / "hidden_states").mkdir()
    try:
        for i, dtype in enumerate((torch.bfloat16, torch.float32)):
            hidden = torch.randn(37, 3, 40).to(dtype)  # 37 x 3 x 40 x 2 bytes: not a multiple of 64
            ids = list(range(100, 137))
            write_hidden_states(tmp_path, i, hidden, ids, durable=False)
            manifest = objects.put(hidden_state_path(tmp_path, i), threading.Event())
            assert not hidden_state_path(tmp_path, i).exists()  # the file goes once its object is in
            got = reader.get_generated(manifest)
            assert torch.equal(got["hidden_states"], hidden) and got["token_ids"].tolist() == ids
            assert objects.used() == manifest["metadata"]["total_aligned_bytes"] > 0
            reader.delete(manifest["handle"])
            deadline = time.monotonic() + 10
            while objects.used() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert objects.used() == 0 and objects.waiting() == 0
        write_hidden_states(tmp_path, 5, torch.randn(4, 3, 40), [1, 2, 3, 4], durable=False)
        left = objects.put(hidden_state_path(tmp_path, 5), threading.Event())
    finally:
        objects.close()
    with pytest.raises(TimeoutError):
        reader.store.get_sample(left, timeout=1)  # removed at close


@pytest.fixture(scope="module")
def mooncake_server(tmp_path_factory, tiny_llama, master):
    server = Server(tiny_llama, tmp_path_factory.mktemp("spool-mc"), "--dtype", "float32", "--layers",
                    ",".join(map(str, LAYERS)), "--transfer", "mooncake", "--mooncake-master", master.address,
                    "--mooncake-global-segment-gib", str(SEGMENT_GIB), "--spool-ttl", str(TTL_S),
                    tmpdir=tmp_path_factory.mktemp("tmp-mc"))  # fmt: skip
    yield server
    server.stop()


def _rows(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 300, (n,), generator=g).tolist()
    rows = [torch.randint(100, 40000, (k,), generator=g).tolist() for k in lengths]
    return rows + [rows[0], rows[1][:40]]  # a twin and a prefix in flight together


def _check(items, rows, ref: Reference) -> None:
    for ids, item in zip(rows, items):
        assert isinstance(item, dict), item  # not SampleUnavailable
        assert item["input_ids"].tolist() == ids
        got = torch.cat([item["hidden_states"].unflatten(1, (len(LAYERS), -1)),
                         item["verifier_last_hidden_states"][:, None]], 1)  # fmt: skip
        assert rel_err(got, ref.slots(ids, [*LAYERS, 6])) < 1e-4


def test_speculators_mooncake_reader_gets_transformers_states(mooncake_server, master, tiny_llama, tmp_path):
    """speculators' loader, six threads at once, reading every row from the store; the trainer removes each
    object, and the server sees its room come back."""
    rows = _rows(10, seed=1)
    transfer = _transfer(master)
    transfer.setup()  # once, as each loader process does: the dataset's threads would each mount a store of their own,
    # keep the last, and an object the server put in a segment dropped with the others would be waited for 120 s
    online = _online_dataset(_dataset(tmp_path / "data", rows), mooncake_server, transfer)
    with ThreadPoolExecutor(6) as pool:
        items = list(pool.map(online.__getitem__, range(len(rows))))
    _check(items, rows, Reference(tiny_llama))
    assert mooncake_server.state_files() == []  # the spool's files went into the store
    deadline = time.monotonic() + 10
    while _health(mooncake_server)["store_bytes"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _health(mooncake_server)["store_bytes"] == 0


def _health(server: Server) -> dict:
    import json
    import urllib.request

    with urllib.request.urlopen(server.url.removesuffix("/v1") + "/health", timeout=30) as r:
        return json.loads(r.read())


def test_an_uncollected_object_is_removed_and_a_full_store_makes_requests_wait(mooncake_server, master):
    """A trainer killed after its answers never reads their objects: they go after the TTL.  Meanwhile the
    store's share (80% of 16 MiB) is full, so the next request waits for the removal instead of failing."""
    s = mooncake_server
    big = [7] * 2000  # 2,000 x 3,072 bytes: 6.1 MB, two fill 12.3 MB of the 13.4 MB share
    orphans = [s.post("/completions", {"model": s.model, "prompt": big})[1]["kv_transfer_params"] for _ in range(2)]
    assert _health(s)["store_bytes"] > 12_000_000
    t0 = time.monotonic()
    got, answer = s.post("/completions", {"model": s.model, "prompt": [8] * 1500})
    waited = time.monotonic() - t0
    assert got == 200 and waited > TTL_S / 2, (got, answer, waited)  # it waited for the orphans, not failed
    from hs_connectors.mooncake_store import MooncakeIntegrityError

    reader = _transfer(master)
    reader.setup()
    store = reader.store._require_store()
    deadline = time.monotonic() + 2 * TTL_S  # the orphans' room came back: they are removed from the store too
    while any(store.is_exist(o["handle"]) != 0 for o in orphans) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [store.is_exist(o["handle"]) for o in orphans] == [0, 0], _health(s)
    for orphan in orphans:  # a trainer that comes late is told so at once (the marker), not after its timeout
        t0 = time.monotonic()
        with pytest.raises(MooncakeIntegrityError, match=r"removed this row uncollected 8 s after .*--spool-ttl"):
            reader.store.get_sample(orphan, timeout=60)
        assert time.monotonic() - t0 < 10
    assert reader.get_generated(answer["kv_transfer_params"])["token_ids"].tolist() == [8] * 1500
    reader.delete(answer["kv_transfer_params"]["handle"])
    markers = [orphan["handle"] + ":error" for orphan in orphans]
    deadline = time.monotonic() + 2 * TTL_S  # the markers go a TTL after they came
    while any(store.is_exist(m) == 1 for m in markers) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert all(store.is_exist(m) == 0 for m in markers)


def test_a_stopped_master_is_a_503_with_one_line_and_a_restarted_one_serves_again(
    mooncake_server, master, tiny_llama, tmp_path
):
    s = mooncake_server
    master.stop()
    t0 = time.monotonic()
    got, answer = s.post("/completions", {"model": s.model, "prompt": [5, 6, 7]})
    assert got == 503 and time.monotonic() - t0 < 30, (got, answer)
    message = answer["error"]["message"]
    assert "\n" not in message and message.startswith("the Mooncake store did not take the row (status -"), message
    assert master.address in message
    master.start()  # empty: the objects of before are gone, and the server's segment mounts again
    rows = _rows(3, seed=2)
    online = _online_dataset(_dataset(tmp_path / "data", rows), s, _transfer(master))
    _check([online[i] for i in range(len(rows))], rows, Reference(tiny_llama))


def test_sigkill_of_the_server_leaves_no_engine_and_the_next_start_sweeps_its_rows(mooncake_server):
    """The module's last use of its server: killed outright, its engine goes with it (the guard), and so do
    the engine's shared-memory queues in /dev/shm (the resource tracker the guard spares removes them) and its
    temporary files (the guard, told of them); what it left in the spool is swept by the next server's start,
    while a live server's folder stays."""
    from eagle_extract.files.spool import LOCK_NAME, folder_prefix, hold_folder, sweep_dead_servers

    s = mooncake_server
    engine = s.engine()
    assert engine, "no engine process found"
    maps = " ".join(Path(f"/proc/{p.pid}/maps").read_text() for p in engine).split()
    queues = {Path(word) for word in maps if word.startswith("/dev/shm/psm_")}
    assert queues, "the engine maps no shared memory"
    with mock.patch.object(tempfile, "tempdir", str(s.tmpdir)):  # the server's temp folder
        socket_folder = own_socket_folder(None)
    assert len(engine_temporary(s.tmpdir)) == 1 + socket_folder  # the watch's heartbeat, vLLM's sockets' folder
    os.kill(s.proc.pid, signal.SIGKILL)
    s.proc.wait(timeout=10)
    deadline = time.monotonic() + 20
    alive = lambda: [p for p in engine if _alive(p)]  # noqa: E731
    while (alive() or any(q.exists() for q in queues) or engine_temporary(s.tmpdir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(), [p.pid for p in alive()]
    assert not [q for q in queues if q.exists()]
    assert not engine_temporary(s.tmpdir)  # the guard removed them, as it was told
    left = s.folder() / "hidden_states" / "hs_7.safetensors"  # a row the killed server had not put yet
    left.write_bytes(b"x" * 5000)
    live = s.spool / f"{folder_prefix()}live"
    (live / "hidden_states").mkdir(parents=True)
    (live / "hidden_states" / "hs_0.safetensors").write_bytes(b"x" * 1000)
    held = hold_folder(live)
    try:
        folders, freed = sweep_dead_servers(s.spool)
        assert folders == 1 and freed >= 5000
    finally:
        os.close(held)
    assert not left.parent.exists() and (s.folder() / LOCK_NAME).exists()  # its rows are gone, its log stays
    assert (live / "hidden_states" / "hs_0.safetensors").exists()
    assert sweep_dead_servers(s.spool) == (1, 1000)  # the live one, once its server is gone
