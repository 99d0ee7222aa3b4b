"""`eagle-extract serve` against speculators 0.9's own online client (ArrowDataset with hs-connectors'
FileTransfer and FP8Transfer), checked against transformers in float32; bad requests, a trainer that never
collects, a full spool, SIGTERM with a request in flight, and an engine that dies.

Two servers start (a vLLM start each): SmolLM2 in float32, as the held-out check runs it, and a tiny Llama
with FP8 storage, whose engine is killed at the end.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from .common import Reference, rel_err

TTL_S = 8  # --spool-ttl of the SmolLM2 server: an uncollected file goes this long after it was written


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path, spool: Path, *args: str, tmpdir: Path | None = None) -> None:
        self.port, self.spool, self.tmpdir = _free_port(), spool, tmpdir
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.model = str(model)
        cmd = [sys.executable, "-m", "eagle_extract", "serve", "--model", self.model, "--port", str(self.port),
               "--spool", str(spool), *args]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"TMPDIR": str(tmpdir)} if tmpdir else {})}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)  # fmt: skip
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + 300
        while not any(line.startswith("serving ") for line in self.lines):
            assert self.proc.poll() is None, "".join(self.lines)
            assert time.monotonic() < deadline, "".join(self.lines)
            time.sleep(0.5)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def post(self, route: str, body, headers: dict | None = None) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.url + route, data=data, headers={"content-type": "application/json",
                                                                               **(headers or {})})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def folder(self) -> Path:
        return next(self.spool.glob("eagle-extract-serve.*"))

    def state_files(self) -> list[Path]:
        return sorted((self.folder() / "hidden_states").glob("*")) if (self.folder() / "hidden_states").exists() else []

    def engine(self) -> list[psutil.Process]:
        return [p for p in psutil.Process(self.proc.pid).children(recursive=True) if p.name().startswith("VLLM::")]

    def stop(self) -> None:
        """After a failed test too: no engine process of this server may outlive it."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory, smollm2):
    spool = tmp_path_factory.mktemp("spool")
    # room for a few rows only: the client threads below wait for each other's files to be collected
    server = Server(smollm2, spool, "--layers", "2,15,27", "--dtype", "float32", "--spool-bytes", "6000000",
                    "--spool-ttl", str(TTL_S), "--max-num-batched-tokens", "4096")  # fmt: skip
    yield server
    server.stop()


def _dataset(path: Path, rows: list[list[int]]) -> Path:
    from datasets import Dataset

    ds = Dataset.from_dict({"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows],
                            "seq_len": [len(r) for r in rows]})  # fmt: skip
    ds.set_format("torch")
    ds.save_to_disk(str(path))
    return path


def _conversation_rows(tokenizer) -> list[list[int]]:
    """Real conversations through the chat template, plus rows made to share prefixes and to repeat:
    a server batches whatever arrives."""
    from .common import SAMPLE_DATA

    conversations = json.loads((SAMPLE_DATA / "sharegpt_dummy_conversations.json").read_text())[:12]
    role = {"human": "user", "gpt": "assistant"}
    rows = []
    for c in conversations:
        messages = [{"role": role.get(t["from"], t["from"]), "content": t["value"]} for t in c["conversations"]]
        rows.append(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)[:300])
    rows += [rows[0], rows[1][: len(rows[1]) // 2], rows[2] + rows[3][:40]]
    return rows


def _online_dataset(datapath: Path, server: Server, transfer):
    from speculators.train.data import ArrowDataset

    return ArrowDataset(max_len=2048, datapath=str(datapath), transfer=transfer, vllm_endpoint=server.url,
                        model=server.model, on_missing="generate", train_ratio=1.0, split="train",
                        request_timeout=120, max_retries=1)  # fmt: skip


def test_speculators_online_client_gets_transformers_states(smollm2_server, smollm2, tmp_path):
    """speculators' own loader, six threads at once, against transformers in float32 (final slot: the input
    of the final norm)."""
    from hs_connectors import FileTransfer
    from transformers import AutoTokenizer

    rows = _conversation_rows(AutoTokenizer.from_pretrained(smollm2))
    datapath = _dataset(tmp_path / "data", rows)
    online = _online_dataset(datapath, smollm2_server, FileTransfer(datapath / "hidden_states"))
    with ThreadPoolExecutor(6) as pool:
        items = list(pool.map(online.__getitem__, range(len(rows))))
    ref = Reference(smollm2)
    for ids, item in zip(rows, items):
        assert isinstance(item, dict), item  # not SampleUnavailable
        assert item["input_ids"].tolist() == ids
        got = torch.cat([item["hidden_states"].unflatten(1, (3, -1)), item["verifier_last_hidden_states"][:, None]], 1)
        assert rel_err(got, ref.slots(ids, [2, 15, 27, 30])) < 1e-4
    assert smollm2_server.state_files() == []  # the reader deleted every file
    # SmolLM2's 8,192-token context against the fixture's 4,096-token step budget: the start line says so
    start = next(line for line in smollm2_server.lines if "starting the engine" in line)
    assert "split over steps of 4,096 tokens (prompts up to 8,191); --seq-length 4095 or --max-num-batched" in start


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(smollm2_server):
    s = smollm2_server
    cases = {
        "empty prompt": ({"model": s.model, "prompt": []}, 400),
        "not token ids": ({"model": s.model, "prompt": [1, "two", 3]}, 400),
        "a float id": ({"model": s.model, "prompt": [1, 2.5]}, 400),
        "out of vocabulary": ({"model": s.model, "prompt": [1, 49152]}, 400),
        "negative id": ({"model": s.model, "prompt": [-1, 5]}, 400),
        "longer than the model's context": ({"model": s.model, "prompt": [5] * 8192}, 400),  # serve's default
        "unknown model": ({"model": "gpt-9", "prompt": [1, 2]}, 400),
        "no JSON object": ([1, 2, 3], 400),
        "image content": ({"model": s.model, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    }
    for name, (body, status) in cases.items():
        route = "/chat/completions" if "messages" in body else "/completions"
        got, answer = s.post(route, body)
        assert got == status and answer["error"]["code"] == status and answer["error"]["message"], (name, answer)
    assert s.post("/completions", b"{not json")[0] == 400
    got, answer = s.post("/no/such/route", {})
    assert got == 404 and "error" in answer
    got, answer = s.post("/completions", {"model": s.model, "prompt": [1, 2, 3], "max_tokens": 1})
    assert got == 200 and answer["choices"][0]["prompt_token_ids"] == [1, 2, 3]
    path = Path(answer["kv_transfer_params"]["hidden_states_path"])
    assert path.parent.parent == s.folder() and load_file(str(path))["token_ids"].tolist() == [1, 2, 3]
    path.unlink()
    got, answer = s.post("/chat/completions", {"model": s.model, "messages": [{"role": "user", "content": "Hi"}],
                                               "add_generation_prompt": False, "return_token_ids": True})  # fmt: skip
    assert (
        got == 200 and answer["prompt_token_ids"] and Path(answer["kv_transfer_params"]["hidden_states_path"]).exists()
    )
    Path(answer["kv_transfer_params"]["hidden_states_path"]).unlink()


def test_an_uncollected_file_is_removed_and_a_full_spool_makes_requests_wait(smollm2_server):
    """A trainer killed after its answer never reads the file: it goes after --spool-ttl.  Meanwhile the
    spool (6 MB) is full, so the next request waits for the removal instead of failing."""
    s = smollm2_server
    big = [7] * 600  # 600 x 9,224 bytes: 5.5 MB of the 6 MB spool
    got, answer = s.post("/completions", {"model": s.model, "prompt": big})
    assert got == 200
    orphan = Path(answer["kv_transfer_params"]["hidden_states_path"])
    assert orphan.exists()
    t0 = time.monotonic()
    got, answer = s.post("/completions", {"model": s.model, "prompt": [8] * 200})
    waited = time.monotonic() - t0
    assert got == 200 and not orphan.exists()
    assert waited > TTL_S / 2, waited  # it waited for the orphan's removal, not failed
    Path(answer["kv_transfer_params"]["hidden_states_path"]).unlink()


def _served(server: Server) -> int:
    return _health(server)["rows"]


def test_a_dataset_without_states_takes_its_kept_rows_from_disk_and_the_rest_from_the_server(
    smollm2_server, smollm2, tmp_path
):
    """`--states none` writes the dataset files with no engine; a row whose file is in hidden_states/ (a partial
    offline run's) is read there, every other one is asked of the server."""
    from datasets import load_from_disk
    from hs_connectors import FileTransfer

    from .conftest import run_cli

    s, out = smollm2_server, tmp_path / "out"
    shown = run_cli("--model", str(smollm2), "--output", str(out), "--states", "none", "--max-samples", "6",
                    "--dtype", "float32", "--layers", "2,15,27").stdout  # fmt: skip
    assert "hidden_states" not in {p.name for p in out.iterdir()} or not any((out / "hidden_states").iterdir())
    assert "starting the engine" not in shown
    lines = shown.splitlines()  # the closing lines say how to train on it: this server's options, the endpoint
    assert f"serve the states: eagle-extract serve --model {smollm2} --layers 2,15,27 --dtype float32" in lines[-2]
    assert lines[-1].endswith("--target-layer-ids 2 15 27 --vllm-endpoint http://127.0.0.1:8000/v1"), lines[-2:]
    rows = [r.tolist() for r in load_from_disk(str(out))["input_ids"]]
    got, answer = s.post("/completions", {"model": s.model, "prompt": rows[0]})  # row 0, as an offline run wrote it
    (out / "hidden_states").mkdir(exist_ok=True)
    os.replace(answer["kv_transfer_params"]["hidden_states_path"], out / "hidden_states" / "hs_0.safetensors")
    assert run_cli("verify", str(out)).returncode == 0
    before = _served(s)
    online = _online_dataset(out, s, FileTransfer(out / "hidden_states"))
    items = [online[i] for i in range(len(rows))]
    assert all(isinstance(item, dict) for item in items) and _served(s) - before == len(rows) - 1
    assert [item["input_ids"].tolist() for item in items] == rows
    assert (out / "hidden_states" / "hs_0.safetensors").exists()  # a kept row is never deleted by the loader


def _health(server: Server, headers: dict | None = None) -> dict:
    request = urllib.request.Request(server.url.removesuffix("/v1") + "/health", headers=headers or {})
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())


def _abandon(server: Server, body: dict, after: float) -> None:
    """A client that sends its request and goes away `after` seconds later, as a trainer's timed-out try does."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(data), data))  # fmt: skip
        time.sleep(after)


def _eventually(check, within: float) -> bool:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_parameters_the_server_cannot_honour_and_rows_that_cannot_fit_are_refused_alone(smollm2_server):
    s = smollm2_server
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    cases = [({"prompt": [1, 2], "n": 2}, "n"), ({"prompt": [1, 2], "stream": True}, "stream"),
             ({"prompt": [1, 2], "logprobs": 2}, "logprobs"), ({"prompt": [1, 2], "echo": True}, "echo"),
             ({**chat, "add_generation_prompt": "false"}, "add_generation_prompt")]  # fmt: skip
    for body, param in cases:
        got, answer = s.post("/chat/completions" if "messages" in body else "/completions", body)
        assert got == 400 and answer["error"]["param"] == param, (body, answer)
    got, answer = s.post("/completions", {"prompt": [1, 2], "max_tokens": 1, "return_token_ids": True, "n": 1})
    assert got == 200, answer  # what speculators' client sends, and defaults said aloud, are served
    Path(answer["kv_transfer_params"]["hidden_states_path"]).unlink()
    # a body past what the longest prompt needs is refused from its Content-Length, before it is read
    with socket.create_connection(("127.0.0.1", s.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n{")
        assert sock.recv(4096).split(b"\r\n")[0].endswith(b"413 Request Entity Too Large")
    # a row larger than the whole spool (6 MB; 700 x 9,224 bytes) could never be written: refused, not queued
    got, answer = s.post("/completions", {"prompt": [7] * 700})
    assert got == 413 and "--spool-bytes" in answer["error"]["message"], answer
    got, answer = s.post("/completions", {"prompt": [1, 2, 3]})  # the next request is served
    assert got == 200
    Path(answer["kv_transfer_params"]["hidden_states_path"]).unlink()
    assert _eventually(lambda: _health(s)["spool_bytes"] == 0, 3)


def test_a_client_that_goes_away_leaves_no_row_and_no_bytes_and_a_linked_row_counts_once(smollm2_server):
    s = smollm2_server
    before = _health(s)
    got, answer = s.post("/completions", {"prompt": [7] * 600})  # 5.5 MB of the 6 MB spool, not collected yet
    full = Path(answer["kv_transfer_params"]["hidden_states_path"])
    _abandon(s, {"prompt": [21] * 200}, after=1.0)  # waits for room, then its client goes
    assert _eventually(lambda: _health(s)["waiting_for_room"] == 0, 3)
    full.unlink()  # collected
    _abandon(s, {"prompt": [22] * 600}, after=0.02)  # gone while it runs: its file is removed once written
    assert _eventually(lambda: not s.state_files() and _health(s)["spool_bytes"] == 0, 5), s.state_files()
    after = _health(s)
    assert after["abandoned"] - before["abandoned"] == 2, after
    assert after["rows"] - before["rows"] == 1, after  # neither abandoned request counts as served
    barrier = threading.Barrier(6)

    def twin(_):
        barrier.wait()
        return s.post("/completions", {"prompt": [31] * 100})

    with ThreadPoolExecutor(6) as pool:
        paths = [Path(answer["kv_transfer_params"]["hidden_states_path"]) for _, answer in pool.map(twin, range(6))]
    inodes = {path.stat().st_ino: path.stat().st_size for path in paths}
    assert len(inodes) < 6  # identical prompts in flight ran once, and got links to its file
    assert _health(s)["spool_bytes"] == sum(inodes.values())  # each file counted once, however many names
    for path in paths:
        path.unlink()
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(s.url.removesuffix("/v1") + "/metrics", timeout=30) as r:
        scraped = {s.name: s.value for m in text_string_to_metric_families(r.read().decode()) for s in m.samples
                   if not s.labels}  # fmt: skip
    health = _health(s)
    assert scraped["eagle_extract_rows_total"] == health["rows"]
    assert scraped["eagle_extract_requests_abandoned_total"] == before["abandoned"] + 2
    assert scraped["eagle_extract_row_seconds_count"] >= 7 and scraped["eagle_extract_engine_step_seconds_total"] > 0
    waited = scraped["eagle_extract_engine_wait_seconds_total"]  # the workers' part of the looks is part of them
    assert 0 < scraped["eagle_extract_engine_wait_worker_seconds_total"] < waited


def test_a_row_whose_file_cannot_be_written_fails_alone_and_the_server_goes_on(smollm2_server):
    s = smollm2_server
    got, answer = s.post("/completions", {"prompt": [5, 6, 7]})
    assert got == 200
    served = Path(answer["kv_transfer_params"]["hidden_states_path"])
    index = int(served.stem.rpartition("_")[2])
    served.unlink()
    # the next row's file name is taken by a folder: its rename fails as a full or broken disk would
    blocker = served.with_name(f"hs_{index + 1}.safetensors")
    (blocker / "taken").mkdir(parents=True)
    got, answer = s.post("/completions", {"prompt": [8, 9, 10, 11]})
    assert got in (500, 507) and "could not be written" in answer["error"]["message"], answer
    assert _health(s)["status"] == "ok"
    got, answer = s.post("/completions", {"prompt": [12, 13]})  # the next request is served
    assert got == 200, answer
    Path(answer["kv_transfer_params"]["hidden_states_path"]).unlink()
    (blocker / "taken").rmdir()
    blocker.rmdir()
    assert _eventually(lambda: _health(s)["spool_bytes"] == 0, 3)  # the failed row's reservation went back


def test_sigterm_answers_the_request_in_flight_refuses_the_waiting_one_then_exits_0(smollm2_server):
    """The request in the engine is answered; the one waiting for spool room gets 503 at once."""
    s = smollm2_server
    got, answer = s.post("/completions", {"prompt": [7] * 560})  # 5.2 MB of the 6 MB spool, not collected
    assert got == 200
    answers, waiting = [], []
    client = threading.Thread(target=lambda: answers.append(s.post("/completions", {"prompt": [9] * 80})))
    late = threading.Thread(target=lambda: waiting.append(s.post("/completions", {"prompt": [10] * 300})))
    client.start()
    time.sleep(0.05)
    late.start()
    assert _eventually(lambda: _health(s)["waiting_for_room"] == 1, 5)
    t0 = time.monotonic()
    engine = s.engine()
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(timeout=30) == 0, "".join(s.lines)
    assert not [p for p in engine if _alive(p)]
    client.join(5)
    late.join(5)
    assert time.monotonic() - t0 < 30
    assert answers and answers[0][0] == 200, answers
    assert waiting and waiting[0][0] == 503 and "stopping" in waiting[0][1]["error"]["message"], waiting
    assert s.state_files() == [] and not (s.folder() / "hidden_states").exists()
    assert s.lines[-1].startswith("stopped: ")


def _twins_and_turns() -> list[list[int]]:
    """Rows continuous batching must not confuse: twins (equal length, other early tokens, one tail) cut into
    16-token chunks side by side, and the first k turns of one conversation."""
    g = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(3):
        twin = torch.randint(100, 40000, (100,), generator=g).tolist()
        other = twin[:20] + torch.randint(100, 40000, (3,), generator=g).tolist() + twin[23:]
        rows += [twin, other]
    whole = torch.randint(100, 40000, (120,), generator=g).tolist()
    return rows + [whole[:k] for k in (30, 60, 90, 120)]


def test_fp8_rows_read_by_fp8transfer_and_a_dead_engine_ends_the_server(tmp_path_factory, tiny_llama, tmp_path):
    """hs-connectors' FP8Transfer dequantises the server's FP8 files (bf16 engine, against transformers in
    float32), also for rows that arrive together and that the engine runs in 16-token chunks side by side
    (twins, prefixes of each other), in two waves: each row gets its own states, at every position.  Then
    the engine process dies: one line, a non-zero exit, no file left, no client waiting."""
    from hs_connectors import FP8Transfer

    server = Server(tiny_llama, tmp_path_factory.mktemp("spool8"), "--dtype", "bfloat16", "--storage-dtype", "fp8",
                    "--layers", "1,3", "--engine-arg", "long_prefill_token_threshold=16",
                    "--max-num-batched-tokens", "64")  # fmt: skip
    try:
        ref = Reference(tiny_llama)
        for wave in range(2):  # the second wave: the server still takes requests after the first one's
            rows = _twins_and_turns()
            datapath = _dataset(tmp_path / f"wave{wave}", rows)
            online = _online_dataset(datapath, server, FP8Transfer(datapath / "hidden_states"))
            with ThreadPoolExecutor(len(rows)) as pool:
                items = list(pool.map(online.__getitem__, range(len(rows))))
            for ids, item in zip(rows, items):
                assert isinstance(item, dict), item
                got = torch.cat(
                    [item["hidden_states"].unflatten(1, (2, -1)), item["verifier_last_hidden_states"][:, None]], 1
                ).float()
                want = ref.slots(ids, [1, 3, 6])
                assert rel_err(got, want) < 0.05 and rel_err(got[20:], want[20:]) < 0.05  # a twin's tail too

        rows = [[int(t) for t in torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(n))]
                for n in (17, 60, 130)]  # fmt: skip
        datapath = _dataset(tmp_path / "data", rows)
        online = _online_dataset(datapath, server, FP8Transfer(datapath / "hidden_states"))
        ref = Reference(tiny_llama)
        for i, ids in enumerate(rows):
            item = online[i]
            assert isinstance(item, dict), item
            got = torch.cat(
                [item["hidden_states"].unflatten(1, (2, -1)), item["verifier_last_hidden_states"][:, None]], 1
            )
            assert rel_err(got.float(), ref.slots(ids, [1, 3, 6])) < 0.05  # bf16 engine, FP8 storage
        engine = server.engine()
        assert engine, "no vLLM engine process found"
        worker = next((p for p in engine if "Worker" in p.name()), engine[0])  # a GPU's TP=1: the core runs it
        worker.kill()
        assert server.proc.wait(timeout=60) != 0
        time.sleep(0.5)
        assert not [p for p in engine if _alive(p)]  # none left
        shown = [line for line in server.lines if line.strip()]
        assert shown[-1].startswith("Error: the vLLM engine failed"), shown[-3:]
        assert server.state_files() == []
    finally:
        server.stop()


def test_the_start_line_says_how_prompts_are_prefilled():
    """Whole where the step budget holds the longest prompt (max_model_len here); the user's chunking settings
    are theirs."""
    from eagle_extract.job.engine import prefill_note

    assert prefill_note({"max_num_batched_tokens": 8192}, 8192, 1) == "each prompt prefilled in one step"
    assert prefill_note({"long_prefill_token_threshold": 16}, 2048, 1) == "prompts prefilled as --engine-arg sets it"
    split = prefill_note({"max_num_batched_tokens": 4096}, 4097, 1)
    assert split.endswith("--seq-length 4095 or --max-num-batched-tokens 4097 prefills each whole"), split


def test_bad_server_options_get_one_line_before_the_engine(smollm2, tmp_path):
    """In this process through click's runner (the real command), but for the Mooncake master's case, whose
    client library stays loaded: a subprocess."""
    from click.testing import CliRunner

    from eagle_extract.faces.cli import main

    from .common import assert_documented
    from .conftest import run_cli

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cases = {
            "a port out of range": ["--port", "0"],
            "a port another process listens on": ["--port", str(taken.getsockname()[1])],
            "a spool bound below 1": ["--spool-bytes", "0"],
            "a spool bound that holds not one token's row": ["--spool-bytes", "100"],
            "a TTL that is not a positive number": ["--spool-ttl", "nan"],
            "an empty API key": ["--api-key", ""],
            "an API key an HTTP header cannot carry": ["--api-key", "a\nb"],
            "an empty host (which would listen on every address)": ["--host", ""],
            "a spool that cannot be made": ["--spool", "/proc/x"],
            "a Mooncake option without --transfer mooncake": ["--mooncake-master", "127.0.0.1:50051"],
            "FP8 rows through Mooncake": ["--transfer", "mooncake", "--storage-dtype", "fp8"],
            "replicas below 1": ["--replicas", "0"],
            **({} if torch.cuda.is_available() else {  # a GPU machine checks the cluster's GPUs instead, in Ray
                "more replicas than this CPU's cores": ["--replicas", str(len(os.sched_getaffinity(0)) + 1)]}),
            "a Ray address that is not HOST:PORT": ["--ray-address", "head"],
            "a Ray cluster that does not answer": ["--ray-address", f"127.0.0.1:{_free_port()}"],
        }  # fmt: skip
        try:
            import eagle_extract.faces.fleet  # noqa: F401  (what serve imports for --ray-address)
        except ImportError:  # no Ray Serve here (a GPU machine's locked set): the line that says so, once
            args = cases.pop("a Ray address that is not HOST:PORT")
            del cases["a Ray cluster that does not answer"]
            cases.pop("more replicas than this CPU's cores", None)
            cases["`--replicas` or `--ray-address` without Ray Serve"] = args
        environment = dict(os.environ)
        try:
            for case, args in cases.items():
                result = CliRunner().invoke(main, ["serve", "--model", str(smollm2), *args])
                lines = [line for line in result.stderr.splitlines() if line.strip()]
                assert result.exit_code == 1 and len(lines) == 1, (case, result.stdout, result.stderr, result.exception)
                assert "starting the engine" not in result.stdout
                assert_documented("The server", case, lines[0])
        finally:  # importing vLLM sets variables of its own: none for the later tests
            os.environ.clear()
            os.environ.update(environment)
        case = "a Mooncake master that does not answer"
        proc = run_cli("serve", "--model", str(smollm2), "--transfer", "mooncake", "--mooncake-master",
                       f"127.0.0.1:{_free_port()}", check=False)  # fmt: skip
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, (case, proc.stdout, proc.stderr)
        assert_documented("The server", case, lines[0])
        # a chat template that does not parse is said at the start (chat requests get it as their 400), and the
        # server goes on: the trainer's requests carry token ids (here the port stops it before the engine)
        bad = tmp_path / "bad-template"
        bad.mkdir()
        for f in smollm2.iterdir():
            if f.is_file() and f.name not in ("tokenizer_config.json", "chat_template.jinja"):
                (bad / f.name).symlink_to(f)
        settings = json.loads((smollm2 / "tokenizer_config.json").read_text())
        settings.pop("chat_template", None)
        (bad / "tokenizer_config.json").write_text(json.dumps(settings))
        (bad / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }{% endfor %}")
        proc = run_cli("serve", "--model", str(bad), "--port", str(taken.getsockname()[1]), check=False)
        said = (proc.stdout + proc.stderr).splitlines()
        warned = [line for line in said if line.startswith("warning: the chat template of")]
        assert len(warned) == 1 and warned[0].endswith("chat requests are refused, and prompt token ids are served")
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 1 and "cannot listen there" in last, (proc.stdout, proc.stderr)
        from transformers import AutoTokenizer

        from eagle_extract.errors import RequestError
        from eagle_extract.faces.requests import UNPARSED_TEMPLATE, Requests

        tokenizer = AutoTokenizer.from_pretrained(bad)
        requests = Requests("m", tokenizer, 100, 8, len(tokenizer), UNPARSED_TEMPLATE)
        with pytest.raises(RequestError, match=f"^messages: {UNPARSED_TEMPLATE}$"):
            requests.tokens({"messages": [{"role": "user", "content": "Hi"}]}, chat=True)
        assert requests.tokens({"prompt": [1, 2, 3]}, chat=False) == [1, 2, 3]
    # a setting vLLM refuses once the engine starts: the server's own line, naming its log, which holds the rest
    proc = run_cli("serve", "--model", str(smollm2), "--port", str(_free_port()), "--engine-arg", "max_num_seqs=0",
                   check=False)  # fmt: skip
    last = proc.stderr.strip().splitlines()[-1]  # vLLM's import may say a line first (Triton without a CPU backend)
    assert proc.returncode == 1 and "max_num_seqs" in last, (proc.stdout, proc.stderr)
    case = "the engine does not start (a setting vLLM refuses, weights it cannot load)"
    assert_documented("The server", case, last)
    assert "ValidationError" in Path(last.rpartition("(the run's log: ")[2].rstrip(")")).read_text()


def test_a_file_going_into_the_mooncake_store_is_never_swept_as_uncollected(tmp_path):
    """A row waiting for room in the store can wait past --spool-ttl: its file is ours, not an uncollected one."""
    from eagle_extract.files.rowfile import hidden_state_path
    from eagle_extract.files.spool import Spool

    spool = Spool(tmp_path, limit=10_000, ttl=0.05)
    held, left = hidden_state_path(tmp_path, 0), hidden_state_path(tmp_path, 1)
    held.parent.mkdir(parents=True)
    for path in (held, left):
        spool.reserve(100, threading.Event())  # as a request does, before its row is written
        path.write_bytes(b"x" * 100)
        spool.written([path], reserved=100)
    spool.hold(held)
    time.sleep(0.1)
    spool.sweep()
    assert held.exists() and not left.exists() and spool.expired == 1
    assert spool.used() == 100  # the held file's bytes count until it is gone
    held.unlink()
    spool.sweep()
    assert spool.used() == 0 and spool.waiting() == 0
