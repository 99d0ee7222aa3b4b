"""The Python API: `extract` returns what it wrote, `verify` returns its findings, and bad input raises
ExtractError with the CLI's own line, before any engine starts."""

from __future__ import annotations

import json
import os

import pytest

from eagle_extract import ExtractError, extract, merge, verify
from eagle_extract.config import ExtractConfig

from .common import SAMPLE_DATA, assert_documented
from .conftest import run_cli

SECTION = "Before the engine starts"


def test_extract_returns_the_summary_of_what_it_wrote(smollm2_bf16_out, smollm2):
    summary = json.loads((smollm2_bf16_out.parent / "summary.json").read_text())
    manifest = json.loads((smollm2_bf16_out / "eagle_extract.json").read_text())
    assert summary["complete"] is True and summary["output"] == str(smollm2_bf16_out)
    assert summary["model"] == manifest["model"] == str(smollm2)  # the bundled model, as the default
    assert summary["rows"] == manifest["num_samples"] == manifest["config"]["max_samples"] == 20
    assert summary["tokens"] == manifest["num_tokens"] > 0
    assert summary["bytes_written"] == manifest["bytes_written"] > 0
    assert summary["aux_layer_ids"] == manifest["aux_layer_ids"] == [2, 15, 27]
    assert summary["skipped"] == manifest["skipped"] and summary["truncated"] == manifest["truncated"]
    assert manifest["config"]["max_num_batched_tokens"] == 128 and manifest["engine_args"] == {
        "max_num_batched_tokens": 128
    }
    report = verify(smollm2_bf16_out)
    assert report.ok and report.problems == [] and report.rows == []


def test_verify_returns_findings_instead_of_printing(tmp_path, capsys):
    report = verify(tmp_path)
    assert not report.ok and report.problems == [(None, "no eagle_extract.json: not an eagle-extract output")]
    assert capsys.readouterr().out == ""


def test_bad_input_raises_the_clis_line(tmp_path):
    data = str(SAMPLE_DATA / "sharegpt_dummy_conversations.json")
    with pytest.raises(ExtractError) as err:
        extract(data=data, output=tmp_path / "out", layers="2,99")
    cli = run_cli("--data", data, "--output", str(tmp_path / "out"), "--layers", "2,99", check=False)
    assert cli.returncode == 1 and cli.stderr.strip().splitlines()[-1] == f"Error: {err.value}"
    assert "id 99 is out of range for a 30-layer model" in str(err.value)
    with pytest.raises(ExtractError) as err:
        extract(seq_len=10)
    assert "seq_length" in str(err.value)
    assert_documented(SECTION, "(Python API) an option the CLI does not have", f"ExtractError: {err.value}")
    with pytest.raises(ExtractError) as err:
        extract(data=data, output=tmp_path / "out", storage_dtype="fp4")
    assert_documented(SECTION, "(Python API) a value the CLI would not offer", f"ExtractError: {err.value}")
    with pytest.raises(ExtractError, match="option tp='2': expected int"):
        extract(data=data, output=tmp_path / "out", tp="2")
    with pytest.raises(ExtractError, match="option strict=1: expected bool"):
        extract(data=data, output=tmp_path / "out", strict=1)
    with pytest.raises(ExtractError, match="--layers: id 99 is out of range"):  # the ids as a list
        extract(data=data, output=tmp_path / "out", layers=[2, 99])
    with pytest.raises(ExtractError, match="option output=None: expected str or PurePath"):
        extract(data=data, output=None)
    for call in (verify, merge):
        with pytest.raises(ExtractError, match="output=None: give the output folder as a str or a Path"):
            call(None)
        with pytest.raises(ExtractError, match="output='': an empty path; name the output folder"):
            call("")  # an unset variable: Path("") would be the current folder
    with pytest.raises(ExtractError, match="output=' ': an empty path; name the file or folder"):
        extract(data=data, output=" ")
    assert not (tmp_path / "out").exists()


def test_cli_and_api_share_names_and_defaults():
    """Every CLI option is an ExtractConfig field of the same name and default (--engine-arg KEY=VALUE
    pairs become the engine_args dict)."""
    from eagle_extract.faces.cli import extract_command

    parsed = extract_command.make_context("extract", []).params
    defaults = ExtractConfig()
    assert set(parsed) == set(defaults.__dataclass_fields__)
    assert parsed == {k: getattr(defaults, k) for k in parsed}
    pairs = ["--engine-arg", "gpu_memory_utilization=0.5", "--engine-arg", "quantization=fp8"]
    assert extract_command.make_context("extract", pairs).params["engine_args"] == {
        "gpu_memory_utilization": 0.5,
        "quantization": "fp8",
    }
    assert extract_command.make_context("extract", ["--no-disk-check"]).params["check_disk"] is False


def test_a_model_too_shallow_for_the_default_layers_is_refused_before_the_engine(tmp_path):
    from .tiny_models import BASE

    model = tmp_path / "two-layer"
    model.mkdir()
    config = {**BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2}
    (model / "config.json").write_text(json.dumps(config))
    data = str(SAMPLE_DATA / "sharegpt_dummy_conversations.json")
    cli = run_cli("--model", str(model), "--data", data, "--output", str(tmp_path / "out"), check=False)
    last = cli.stderr.strip().splitlines()[-1]
    assert cli.returncode == 1 and last.startswith("Error: a 2-layer model has no default --layers"), cli.stderr
    assert_documented(SECTION, "a model of under 3 layers and no `--layers` (the defaults fall outside it)", last)
    assert not (tmp_path / "out").exists()


def test_the_record_holds_absolute_paths_and_an_odd_auto_map_hashes(tmp_path, monkeypatch):
    """A repair, a merge or the trainer may run from another folder than the extraction did."""
    from eagle_extract.job.plan import model_sha256

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"auto_map": ["modeling_x.X"]}))
    monkeypatch.chdir(tmp_path)
    record = ExtractConfig(model="model", data="rows.jsonl", output="out").record()
    assert (record["model"], record["data"], record["output"]) == tuple(
        str(tmp_path / name) for name in ("model", "rows.jsonl", "out")
    )
    assert ExtractConfig(model="org/name", data="rows.jsonl", output="out").record()["model"] == "org/name"
    assert len(model_sha256(tmp_path / "model")) == 64  # an auto_map that is no mapping names no module


def test_repair_and_merge_of_a_complete_output_say_what_they_did_and_change_nothing_else(smollm2_bf16_out):
    from eagle_extract import repair

    before = (smollm2_bf16_out / "eagle_extract.json").stat().st_mtime_ns
    refusals = ((None, r"^rows=None: give the row indices"), ([3, 99, 20], r"^rows \[20, 99\]: .* has rows 0 to 19;"))
    for rows, said in refusals:
        with pytest.raises(ExtractError, match=said) as err:
            repair(smollm2_bf16_out, rows)
        assert_documented(SECTION, "(Python API) `repair` without rows, or with rows the output does not have",
                          f"ExtractError: {err.value}")  # fmt: skip
    said = []
    summary = merge(smollm2_bf16_out, log=said.append)  # its last shard, or one run, completed it: a success
    assert summary.complete and summary.rows == 20 and said == [
        f"{smollm2_bf16_out} is already complete (check it with `eagle-extract verify {smollm2_bf16_out}`)"
    ]
    proc = run_cli("merge", str(smollm2_bf16_out), check=False)
    assert proc.returncode == 0 and "is already complete" in proc.stdout, (proc.stdout, proc.stderr)
    assert (smollm2_bf16_out / "eagle_extract.json").stat().st_mtime_ns == before


def test_paths_the_api_takes_and_paths_no_line_can_name(tmp_path, smollm2):
    import os
    from pathlib import Path

    assert ExtractConfig.from_options(model=Path(smollm2)).model == str(smollm2)  # as data and output take one
    bad = os.fsdecode(b"rows\xff.jsonl")  # a name the shell passed as bytes
    for option in ("data", "output"):
        with pytest.raises(ExtractError) as err:
            extract(**{option: tmp_path / bad}, model=str(smollm2))
        assert_documented(SECTION, "a path whose name is not UTF-8", f"Error: {err.value}")
    assert list(tmp_path.iterdir()) == []  # nothing made, no lock file


def test_a_data_file_rewritten_while_the_run_read_it_is_never_recorded_as_read(tmp_path, smollm2):
    from eagle_extract.job.plan import make_plan, refuse_changed_data

    data = tmp_path / "rows.jsonl"
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    data.write_text(json.dumps(row) + "\n")
    plan = make_plan(ExtractConfig(model=str(smollm2), data=data, output=tmp_path / "o").resolved())
    refuse_changed_data(plan)  # unchanged
    os.utime(data)  # touched, the same bytes: the digest says it is the same file
    refuse_changed_data(plan)
    data.write_text(json.dumps({**row, "messages": row["messages"][:1] + [{"role": "assistant", "content": "No"}]}))
    with pytest.raises(ExtractError) as err:
        refuse_changed_data(plan)
    assert_documented("During the run", "the data file changed while the run read it (rewritten or replaced: a "
                      "`--states none` run's seconds, a stream of hours)", f"Error: {err.value}")  # fmt: skip


SPAWNED = """
import multiprocessing, sys
from eagle_extract import repair

if __name__ == "__main__":  # as vLLM starts its engine: a spawned process imports this script again
    child = multiprocessing.get_context("spawn").Process(target=print)
    child.start()
    child.join()
    print("child exit", child.exitcode)
else:
    repair("out", [0])  # the spawned process's import reaches it, as it reaches a call without the main guard
"""


def test_an_api_call_reached_again_in_a_spawned_process_is_one_line_naming_the_guard(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(SPAWNED)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.stdout.strip() == "child exit 1", (proc.stdout, proc.stderr)
    assert proc.stderr.strip().splitlines() == [
        f"Error: eagle_extract.repair() ran again in a process vLLM started, which imports {script} anew: put the "
        'call under `if __name__ == "__main__":`'
    ]
    assert_documented(SECTION, "(Python API) `extract()` or `repair()` at a script's top level, without the main guard",
                      proc.stderr.strip())  # fmt: skip
