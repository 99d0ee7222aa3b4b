"""What a user sees from the command line before any engine starts."""

from __future__ import annotations

import json
import re

from .common import SAMPLE_DATA
from .conftest import run_cli

DATA = str(SAMPLE_DATA / "sharegpt_dummy_conversations.json")
OPTIONS = [
    "--model",
    "--data",
    "--output",
    "--layers",
    "--tp",
    "--max-samples",
    "--seq-length",
    "--dtype",
    "--batch-size",
    "--max-num-batched-tokens",
    "--engine-arg",
    "--decoder-path",
    "--trust-remote-code",
    "--overwrite",
]


def _error_line(proc) -> str:
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr  # one line, no traceback, no engine logs
    return lines[0]


def test_help_documents_every_option():
    out = run_cli("--help").stdout
    for option in OPTIONS:
        assert re.search(rf"^\s+{re.escape(option)}\b", out, re.M), option


def test_layer_out_of_range_fails_before_engine(tmp_path, smollm2):
    proc = run_cli(
        "--model", str(smollm2), "--data", DATA, "--output", str(tmp_path / "o"), "--layers", "2,99", check=False
    )
    line = _error_line(proc)
    assert "id 99 is out of range for a 30-layer model" in line and "0..29" in line
    assert not (tmp_path / "o").exists()


def test_bad_layer_syntax_and_tp(tmp_path, smollm2):
    line = _error_line(run_cli("--model", str(smollm2), "--data", DATA, "--layers", "2,x", check=False))
    assert "'x' is not an integer" in line
    line = _error_line(run_cli("--model", str(smollm2), "--data", DATA, "--tp", "2", check=False))
    assert "--tp 2 does not divide" in line and "use one of 1, 3" in line


def test_missing_model_and_data(tmp_path, smollm2):
    line = _error_line(run_cli("--model", str(tmp_path / "nope"), "--data", DATA, check=False))
    assert "--model" in line and "nope" in line
    line = _error_line(run_cli("--model", str(smollm2), "--data", str(tmp_path / "x.jsonl"), check=False))
    assert "data file not found" in line


def test_foreign_or_existing_output_is_refused(tmp_path, smollm2):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    line = _error_line(run_cli("--model", str(smollm2), "--data", DATA, "--output", str(foreign), check=False))
    assert "not an eagle-extract output" in line
    done = tmp_path / "done"
    done.mkdir()
    (done / "eagle_extract.json").write_text(json.dumps({}))
    line = _error_line(run_cli("--model", str(smollm2), "--data", DATA, "--output", str(done), check=False))
    assert "--overwrite" in line


def test_unfinished_run_with_other_settings_is_refused(tmp_path, smollm2):
    out = tmp_path / "o"
    out.mkdir()
    (out / ".eagle_extract_run.json").write_text(json.dumps({"model": str(smollm2), "aux_layer_ids": [1, 2]}))
    line = _error_line(run_cli("--model", str(smollm2), "--data", DATA, "--output", str(out), check=False))
    assert "unfinished run with a different" in line and "--overwrite" in line


def test_engine_args_that_would_disable_hooks_are_refused(tmp_path, smollm2):
    line = _error_line(
        run_cli("--model", str(smollm2), "--data", DATA, "--engine-arg", "enforce_eager=false", check=False)
    )
    assert "enforce_eager is fixed by eagle-extract" in line
