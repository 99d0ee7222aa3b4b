"""The Python API: `extract` returns what it wrote, `verify` returns its findings, and bad input raises
ExtractError with the CLI's own line, before any engine starts."""

from __future__ import annotations

import json

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
