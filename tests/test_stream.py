"""The token store written by the background stream, against the one-thread, in-memory tokenization
(`load_samples`) of the same rows, with the real SmolLM2 tokenizer: bad rows, `--long-samples skip`,
`--max-samples`, worker processes, shards' stores merged, and a store cut short by a killed run,
which a rerun continues without tokenizing again what it kept."""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
import torch

from eagle_extract.config import ExtractConfig
from eagle_extract.data.formats import read_rows
from eagle_extract.data.samples import load_samples
from eagle_extract.data.store import DatasetRows, TokenStore
from eagle_extract.errors import ExtractError
from eagle_extract.files.shards import owns
from eagle_extract.files.writer import write_dataset
from eagle_extract.job import stream
from eagle_extract.job.plan import make_plan

ROWS = 1300  # common.write_stream_rows: three chunks of stream.CHUNK_ROWS, the last one partly filled


@pytest.fixture(scope="module")
def rows_file(stream_rows):
    return stream_rows


def _plan(tmp_path, data, **options):
    cfg = ExtractConfig.from_options(output=tmp_path / "out", data=data, seq_length=256, **options).resolved()
    return make_plan(cfg)


def _stream(plan, store, processes, first=None):
    rows = lambda: stream.job_rows(plan.cfg, plan.shard)  # noqa: E731
    first = stream.first_chunks(plan, rows()) if first is None else first
    tokenizing = stream.Tokenizing(store, rows(), plan, processes, first).start()
    while store.wait(len(store.chunks)) is not None:
        pass
    tokenizing.stop()
    return store


def _assert_same_as_in_memory(store, plan):
    cfg = plan.cfg
    samples, report = load_samples(
        cfg.data, plan.tokenizer, cfg.seq_length, cfg.max_samples, long_samples=cfg.long_samples
    )
    rows = [r for chunk in store.chunks for r in store.rows(chunk)]
    assert [index for index, *_ in rows] == list(range(len(samples)))
    assert [(row, ids, mask) for _, row, ids, mask in rows] == [(s.row, s.input_ids, s.loss_mask) for s in samples]
    merged = DatasetRows([store])
    counts = merged.counts
    assert (store.read, counts["samples"], counts["truncated"]) == (report.rows, len(samples), report.truncated)
    assert (counts["skipped"], counts["skipped_long"]) == (len(report.skipped), report.skipped_long)
    assert list(merged.skipped()) == report.skipped
    freq = Counter(t for s in samples for t, m in zip(s.input_ids, s.loss_mask) if m)  # fed row by row
    assert list(merged.token_freq().items()) == list(freq.items())  # the order a Counter gives too
    return samples, report


def test_two_worker_processes_store_what_one_thread_in_memory_makes(tmp_path, rows_file):
    """(No worker process: the next test; one, with --long-samples skip and --max-samples: the CLI run below.)"""
    plan = _plan(tmp_path, rows_file)
    store = _stream(plan, TokenStore(tmp_path / "store"), 2)
    samples, report = _assert_same_as_in_memory(store, plan)
    assert report.skipped and report.truncated  # the bad and the long rows are there to be met
    assert len(store.chunks) >= 2 and store.ended

    (tmp_path / "ds").mkdir()
    write_dataset(tmp_path / "ds", DatasetRows([store]).dataset(), DatasetRows([store]).token_freq())  # as completion
    from datasets import load_from_disk

    written = load_from_disk(str(tmp_path / "ds"))
    assert written.format["type"] == "torch" and len(written) == len(samples)
    for i in (0, len(samples) // 2, len(samples) - 1):
        assert torch.equal(written[i]["input_ids"], torch.tensor(samples[i].input_ids))
        assert torch.equal(written[i]["loss_mask"], torch.tensor(samples[i].loss_mask))
        assert int(written[i]["seq_len"]) == len(samples[i].input_ids)


@pytest.mark.parametrize("cap", [None, 600])
def test_shards_stores_hold_their_own_rows_and_merge_into_one_runs(tmp_path, rows_file, monkeypatch, cap):
    """Three shards' stores, merged in source row order, against one run's: rows, counts, skipped rows, ranges
    and token frequencies (in first-occurrence order).  Without --max-samples a shard tokenizes only its own
    rows; with it, every row up to the cut, keeping its own."""
    options = {"long_samples": "skip", "max_samples": cap}
    whole = _stream(_plan(tmp_path, rows_file, **options), TokenStore(tmp_path / "whole"), 0)
    seen = []
    real = stream.tokenize_rows
    monkeypatch.setattr(
        stream, "tokenize_rows", lambda tok, rows, *a: seen.extend(n for n, _ in rows) or real(tok, rows, *a)
    )
    parts = []
    for k in range(3):
        seen.clear()
        plan = _plan(tmp_path, rows_file, shard=f"{k}/3", **options)
        parts.append(_stream(plan, TokenStore(tmp_path / f"store.{k}-of-3"), 0))
        kept = [row for c in parts[-1].chunks for _, row, _, _ in parts[-1].rows(c)]
        assert kept and all(owns((k, 3), r) for r in kept + [r for r, _ in DatasetRows([parts[-1]]).skipped()])
        if cap is None:
            assert seen == [r for r in range(ROWS) if owns((k, 3), r)]
        else:  # every row, chunk by chunk, up to the cut: the 600th usable row, the same for every shard
            assert seen == list(range(len(seen))) and len(seen) >= whole.read == parts[-1].read
    one, merged = DatasetRows([whole]), DatasetRows(parts)
    assert merged.order is not None and merged.counts == one.counts and one.counts["samples"] == (cap or whole.usable)
    assert merged.source_rows.tolist() == one.source_rows.tolist()
    assert list(merged.skipped()) == list(one.skipped()) and merged.source_row_ranges() == one.source_row_ranges()
    assert list(merged.token_freq().items()) == list(one.token_freq().items())
    a, b = merged.dataset().with_format(None), one.dataset().with_format(None)
    assert a["input_ids"] == b["input_ids"] and a["loss_mask"] == b["loss_mask"] and a["seq_len"] == b["seq_len"]


def test_a_rerun_continues_a_cut_store_without_tokenizing_its_rows_again(tmp_path, rows_file, monkeypatch):
    plan = _plan(tmp_path, rows_file, long_samples="skip")
    folder = tmp_path / "store"
    whole = _stream(plan, TokenStore(tmp_path / "whole"), 0)
    cut = TokenStore(folder)
    for number in range(2):  # what a killed run kept: two whole chunks, and a third cut before its marker
        table, meta = whole.table(number), whole.meta(number)
        (folder / f"chunk_{number:08d}.arrow").write_bytes(whole.path(number, "arrow").read_bytes())
        (folder / f"chunk_{number:08d}.json").write_text(json.dumps(meta))
        assert len(table) == whole.chunks[number].usable
    (folder / "chunk_00000002.arrow").write_bytes(whole.path(2, "arrow").read_bytes()[:100])
    (folder / ".chunk_00000003.arrow.tmp").write_bytes(b"torn")

    seen = []
    real = stream.tokenize_rows
    monkeypatch.setattr(
        stream, "tokenize_rows", lambda tok, rows, *a: seen.extend(n for n, _ in rows) or real(tok, rows, *a)
    )
    cut = TokenStore(folder)
    assert len(cut.chunks) == 2 and not list(folder.glob(".*.tmp")) and not (folder / "chunk_00000002.arrow").exists()
    _stream(plan, cut, 0, first=[])
    assert seen and min(seen) == whole.chunks[1].read  # the first row after the kept chunks, and none before
    _assert_same_as_in_memory(cut, plan)

    seen.clear()
    _stream(plan, TokenStore(folder), 0, first=[])  # a complete store: nothing is read or tokenized
    assert seen == []


def test_a_tokenizing_worker_that_dies_is_one_line(tmp_path, rows_file):
    import itertools
    import threading

    import psutil

    from .common import assert_documented

    plan = _plan(tmp_path, rows_file)
    go_on = threading.Event()

    def rows():  # the last chunk waits until the worker is dead, so the stream cannot end first
        source = read_rows(rows_file)
        yield from itertools.islice(source, 2 * stream.CHUNK_ROWS)
        go_on.wait(60)
        yield from source

    store = TokenStore(tmp_path / "store")
    tokenizing = stream.Tokenizing(store, rows(), plan, 1, []).start()

    def spawned(process) -> bool:
        try:
            return "spawn_main" in " ".join(process.cmdline())
        except psutil.Error:  # an earlier test's child, a zombie now, or one gone meanwhile
            return False

    workers = []
    for _ in range(600):
        workers = [p for p in psutil.Process().children() if spawned(p)]
        if workers:
            break
        time.sleep(0.1)
    assert workers, "no tokenizing worker process started"
    workers[0].kill()
    go_on.set()
    with pytest.raises(ExtractError) as caught:
        while store.wait(len(store.chunks)) is not None:
            pass
    tokenizing.stop()
    line = f"Error: {caught.value} (the run's log: {tmp_path}/eagle_extract.log)"
    assert_documented("During the run", "a tokenizing worker process dies", line)


def test_a_streamed_run_writes_what_the_in_memory_rows_say(tmp_path, stream_rows, tiny_llama, streamed_out):
    """The CLI on two chunks with a worker process, bad rows, --long-samples skip and --max-samples: the
    dataset is the one-thread tokenization's, row for row, each row's file holds its tokens and the
    states transformers computes for them, and the token store is gone once the output is complete."""
    from datasets import load_from_disk

    from eagle_extract import verify
    from eagle_extract.files.manifest import read_manifest

    from .common import Reference, load_row, rel_err

    out = streamed_out
    plan = _plan(tmp_path, stream_rows, model=str(tiny_llama), long_samples="skip", max_samples=600)
    samples, report = load_samples(stream_rows, plan.tokenizer, 256, 600, long_samples="skip")
    rows = load_from_disk(str(out)).with_format(None)
    assert rows["input_ids"] == [s.input_ids for s in samples] and rows["loss_mask"] == [s.loss_mask for s in samples]
    skipped = [json.loads(line) for line in (out / "skipped_rows.jsonl").read_text().splitlines()]
    assert [(r["row"], r["reason"]) for r in skipped] == report.skipped and report.skipped_long
    manifest = read_manifest(out)
    ranges = [row for first, end in manifest["source_row_ranges"] for row in range(first, end)]
    assert ranges == [s.row for s in samples] and samples[-1].row >= stream.CHUNK_ROWS  # past the first chunk
    assert (manifest["num_samples"], manifest["skipped"], manifest["skipped_long"]) == (
        len(samples), len(report.skipped), report.skipped_long
    )  # fmt: skip
    assert manifest["tokenized_rows"] == report.rows and not list(out.glob(".eagle_extract_tokens*"))
    assert verify(out).ok
    ref = Reference(tiny_llama)
    for i in (0, 300, len(samples) - 1):
        got = load_row(out, i)
        assert got["token_ids"].tolist() == samples[i].input_ids
        assert rel_err(got["hidden_states"], ref.slots(samples[i].input_ids, manifest["slot_layer_ids"])) < 1e-4


def test_strict_refuses_a_bad_row_past_the_first_chunk_before_the_engine_starts(tmp_path, tiny_llama):
    """The whole source is tokenized first: the line names the row, and the run leaves no record, no store
    and no row file, so the corrected data starts cleanly."""
    from .common import assert_documented
    from .conftest import run_cli

    data = tmp_path / "rows.jsonl"
    good = [
        json.dumps({"messages": [{"role": "user", "content": f"Q{i}?"}, {"role": "assistant", "content": "A."}]})
        for i in range(stream.CHUNK_ROWS + 110)
    ]
    good.insert(stream.CHUNK_ROWS + 100, "{oops")  # line CHUNK_ROWS + 101
    data.write_text("\n".join(good) + "\n")
    out = tmp_path / "out"
    proc = run_cli("--model", str(tiny_llama), "--data", str(data), "--output", str(out), "--strict", check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]  # the tokenizer's progress, then it
    assert proc.returncode == 1 and [x for x in lines if "Error" in x] == lines[-1:], proc.stderr[-3000:]
    assert f"line {stream.CHUNK_ROWS + 101}: malformed JSON line" in lines[-1], lines[-1]
    case = "a bad row past the first chunk under `--strict`, or a sample there longer than the model's context"
    assert_documented("During the run", case, lines[-1])
    assert "--strict: checking every row before the engine starts" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["eagle_extract.log"]  # no run record, store or row file
    assert "vllm" not in (out / "eagle_extract.log").read_text().lower()  # the engine never started


POOL_PARENT = """
import multiprocessing, os, sys, time
from concurrent.futures import ProcessPoolExecutor
from eagle_extract.job.stream import die_with_parent
if __name__ == "__main__":  # the pool's spawned workers import this file again
    pool = ProcessPoolExecutor(2, multiprocessing.get_context("spawn"), die_with_parent)
    list(pool.map(time.sleep, [0.5, 0.5]))  # both workers started
    print(flush=True)
    time.sleep(60)
"""


def test_tokenizing_workers_end_when_their_parent_is_killed(tmp_path):
    """A killed run's pool workers would wait on their task queue for ever (each holds its other end), keeping
    Python's resource tracker, and so the engine's shared memory, alive too: they end with their parent."""
    import contextlib
    import signal
    import subprocess
    import sys

    import psutil

    script = tmp_path / "parent.py"
    script.write_text(POOL_PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        parent.stdout.readline()
        family = psutil.Process(parent.pid).children()
        workers = [p for p in family if "spawn_main" in " ".join(p.cmdline())]
        assert len(workers) == 2, [p.cmdline() for p in family]
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    _, alive = psutil.wait_procs(family, timeout=15)  # the workers, and the tracker once they are gone
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    assert not alive, [proc.pid for proc in alive]
