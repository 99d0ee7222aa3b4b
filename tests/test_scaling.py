"""Scale-out: N shards of one job, or N engine replicas on one machine, equal one run."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import load_from_disk

from eagle_extract.files.shards import ShardError, owns, parse_shard

from .common import load_row, rel_err
from .conftest import BUDGET, ONE_PROCESS, STREAM_ARGS, run_cli


def assert_same_output(got, want):
    """File for file: the same rows and token counts exactly; hidden states to float32 rounding
    (a shard's engine steps hold other requests than one run's)."""
    names = sorted(p.name for p in (want / "hidden_states").iterdir())
    assert sorted(p.name for p in (got / "hidden_states").iterdir()) == names
    a, b = (load_from_disk(str(o)).with_format(None) for o in (got, want))
    assert a["input_ids"] == b["input_ids"] and a["loss_mask"] == b["loss_mask"]
    assert torch.load(got / "token_freq.pt") == torch.load(want / "token_freq.pt")
    for i in range(len(b)):
        x, y = load_row(got, i), load_row(want, i)
        assert torch.equal(x["token_ids"], y["token_ids"])
        assert rel_err(x["hidden_states"], y["hidden_states"]) < 1e-5
    m, n = (json.loads((o / "eagle_extract.json").read_text()) for o in (got, want))
    assert m["identity"] == n["identity"] and m["num_tokens"] == n["num_tokens"]


def test_shard_spec():
    assert parse_shard("1/4") == (1, 4) and parse_shard(None) is None
    for bad in ("4/4", "-1/2", "1", "a/b"):
        with pytest.raises(ShardError, match="expected I/N with 0 <= I < N"):
            parse_shard(bad)
    assert [r for r in range(7) if owns((1, 3), r)] == [1, 4]


def _cut_shard(out, shard: str) -> tuple[int, list[str]]:
    """Make a finished shard's record what a killed run leaves: its run file instead of its summary, its
    token store without its last chunk, and two row files gone (one of a kept chunk, one of the cut one).
    Returns the source rows the cut chunk read and the row files removed."""
    summary = out / "shards" / f"{shard}.json"
    (out / f".eagle_extract_run.{shard}.json").write_text(json.dumps(json.loads(summary.read_text())["identity"]))
    summary.unlink()
    store = out / f".eagle_extract_tokens.{shard}"
    markers = sorted(store.glob("chunk_*.json"))
    last, before = (json.loads(m.read_text()) for m in markers[-1:-3:-1])
    for suffix in ("json", "arrow"):
        markers[-1].with_suffix(f".{suffix}").unlink()
    gone = [f"hs_{before['rows'][0]}.safetensors", f"hs_{last['rows'][-1]}.safetensors"]
    for name in gone:
        (out / ".eagle_extract_rows" / "hidden_states" / name).unlink()
    return last["read"] - before["read"], gone


def test_two_shards_run_separately_equal_one_run(tmp_path, tiny_llama, stream_rows, streamed_out):
    """On the streamed run's rows (two chunks, bad rows, skipped long rows, --max-samples, so each shard
    tokenizes every row up to the cut and keeps its own): shard 0 is cut and resumed, without tokenizing
    again what its store kept, and rewrites the row files it lost."""
    out = tmp_path / "sharded"
    args = ["--model", str(tiny_llama), "--data", str(stream_rows), "--output", str(out), *STREAM_ARGS]
    first = run_cli(*args, "--shard", "0/2", env=ONE_PROCESS)
    assert "shard 0/2 done" in first.stdout and not (out / "eagle_extract.json").exists()
    assert not (out / "hidden_states").exists()  # a shard's rows are named by source row until completion
    cut_rows, gone = _cut_shard(out, "0-of-2")
    resumed = run_cli(*args, "--shard", "0/2", env=ONE_PROCESS)
    assert "resuming" in resumed.stdout and "1 damaged" not in resumed.stdout
    summary = json.loads((out / "shards" / "0-of-2.json").read_text())
    assert summary["tokenized_rows"] == cut_rows and summary["resumed_rows"] > 0
    assert all((out / ".eagle_extract_rows" / "hidden_states" / name).exists() for name in gone)
    early = run_cli("merge", str(out), check=False)
    lines = [x for x in early.stderr.splitlines() if x.strip()]
    assert early.returncode == 1 and len(lines) == 1 and "shard(s) 1/2" in lines[0], early.stderr
    other = run_cli(*args, "--shard", "1/2", "--dtype", "bfloat16", check=False)  # a different job cannot join
    assert other.returncode == 1 and "different dtype" in other.stderr and "other shards' settings" in other.stderr
    run_cli(*args, "--shard", "1/2", env=ONE_PROCESS)  # the last shard completes the dataset
    assert_same_output(out, streamed_out)
    assert (out / "skipped_rows.jsonl").read_text() == (streamed_out / "skipped_rows.jsonl").read_text()
    assert "passes every check" in run_cli("verify", str(out)).stdout
    assert not list(out.glob(".eagle_extract_tokens*"))  # both shards' stores went with completion


def test_two_replicas_equal_one_run(tmp_path, tiny_llama, mixed_conversations, tiny_tp1_out):
    out = tmp_path / "dp2"
    args = ["--model", str(tiny_llama), "--data", str(mixed_conversations), "--output", str(out)]
    proc = run_cli(*args, "--dtype", "float32", *BUDGET, "--dp", "2")
    assert "2 replicas started" in proc.stdout and "done:" in proc.stdout
    summaries = [json.loads((out / "shards" / f"{k}-of-2.json").read_text()) for k in range(2)]
    rows = len(mixed_conversations.read_text().splitlines())
    assert [s["tokenized_rows"] for s in summaries] == [(rows + 1) // 2, rows // 2]  # each its own rows only
    assert_same_output(out, tiny_tp1_out)
    assert not (out / ".eagle_extract_rows").exists()


def test_a_shard_whose_rows_are_all_skipped_finishes_without_an_engine(tmp_path, tiny_llama):
    """Shard 1/2 owns one malformed row only: it tokenizes its own row, has nothing to write, and records
    itself finished without starting an engine, waiting for shard 0/2 (whose rows are usable)."""
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]}
    data = tmp_path / "rows.jsonl"
    data.write_text(f"{json.dumps(good)}\n{{oops\n{json.dumps(good)}\n")
    out = tmp_path / "out"
    idle = run_cli("--model", str(tiny_llama), "--data", str(data), "--output", str(out), "--shard", "1/2")
    assert "waiting for shard(s) 0/2" in idle.stdout
    summary = json.loads((out / "shards" / "1-of-2.json").read_text())
    assert (summary["rows"], summary["tokenized_rows"], summary["engine_start_s"]) == (0, 1, 0)
    assert "vllm" not in (out / "eagle_extract.1-of-2.log").read_text().lower()  # no engine was started
    assert not (out / ".eagle_extract_rows").exists()


def test_replicas_tell_their_parent_their_rows_through_one_small_file_each(tmp_path, monkeypatch):
    """The --dp parent's progress reads one file per replica, whatever the number of rows (it listed every
    row file once a second before); a missing or half-written file counts as none."""
    from eagle_extract.runlog import PROGRESS_FILE, share_progress, shared_progress

    files = [tmp_path / f".{k}-of-3.progress" for k in range(3)]
    for k, rows in ((0, 1200), (1, 34)):
        monkeypatch.setenv(PROGRESS_FILE, str(files[k]))
        share_progress(rows)
    files[2].with_suffix(".progress.tmp").write_text("9")  # a replica cut mid-write: its count is not yet whole
    assert shared_progress(files) == 1234
    left = [".0-of-3.progress", ".1-of-3.progress", ".2-of-3.progress.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == left
