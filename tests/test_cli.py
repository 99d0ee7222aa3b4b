"""Each option is declared once, in config.py: the commands and their --help are made from the declarations,
and the README's tables are held to them here (errors: test_hostile_inputs.py)."""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import MISSING, fields
from pathlib import Path
from typing import get_args

import pytest

from eagle_extract.config import ExtractConfig, ServeOptions, option_name, options_of
from eagle_extract.errors import ExtractError
from eagle_extract.job.preflight import check_ranges

README = Path(__file__).resolve().parents[1] / "README.md"


def _table(heading: str) -> list[tuple[str, str]]:
    """(option, default cell without backticks) of each row of the README table whose header row starts with
    `heading`, in order."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {heading} |"))
    rows = []
    for line in itertools.takewhile(lambda line: line.startswith("|"), lines[start + 2 :]):
        name, default = line.split("|")[1:3]
        one = re.fullmatch(r"`(--[a-z0-9-]+)[^`]*`", name.strip())
        assert one, f"README: one option a row, not {name.strip()}"
        rows.append((one.group(1), default.strip().replace("`", "")))
    return rows


def _readme_default(f) -> str:
    """The default as the README gives it: a flag is off; a None or an empty dict is --help's words or nothing."""
    if f.type is bool:
        return "off"
    if f.metadata["shown"] or f.default is None or f.default is MISSING:
        return f.metadata["shown"] or ""
    return f"{f.default:g}" if isinstance(f.default, float) else str(f.default)


@pytest.mark.parametrize("heading, declared", [
    ("option", options_of("extract")),
    ("serve option", [f for f in options_of("serve") if "extract" not in f.metadata["faces"]]),
])  # fmt: skip
def test_the_readme_tables_give_every_declared_option_in_order_with_its_default(heading, declared):
    rows = _table(heading)
    assert [name for name, _ in rows] == [option_name(f) for f in declared]
    wrong = [
        (name, cell, _readme_default(f))
        for f, (name, cell) in zip(declared, rows)
        if cell != _readme_default(f) and not cell.startswith(_readme_default(f) + " (")
    ]
    assert not wrong, "README default cells that are not the declared defaults: (option, cell, declared)"


def test_the_readme_names_the_extraction_options_serve_takes():
    text = " ".join(README.read_text().split())
    sentence = text[text.index("`serve` also takes the model options of extraction:") :].split(". ")[0]
    shared = [option_name(f) for f in options_of("serve") if "extract" in f.metadata["faces"]]
    assert set(re.findall(r"`(--[a-z0-9-]+)`", sentence)) == set(shared)


def test_each_commands_help_lists_the_options_it_takes_with_their_help():
    """From the rendered --help: a command that lost an option, or an option whose help did not reach click,
    fails here (whitespace aside: click wraps the lines)."""
    from click.testing import CliRunner

    from eagle_extract.faces.cli import SERVE_HELP, extract_command, serve_command

    for command, face in ((extract_command, "extract"), (serve_command, "serve")):
        assert [p.opts[0] for p in command.params] == [option_name(f) for f in options_of(face)]
        shown = "".join(CliRunner().invoke(command, ["--help"]).output.split())
        own = SERVE_HELP if face == "serve" else {}
        missing = [option_name(f) for f in options_of(face)
                   if "".join(own.get(f.name, f.metadata["help"]).split()) not in shown]  # fmt: skip
        shown_defaults = [f.metadata["shown"] for f in options_of(face) if f.metadata["shown"]]
        assert not missing and all(f"[default:{''.join(s.split())}]" in shown for s in shown_defaults), missing
    serve_help = " ".join(CliRunner().invoke(serve_command, ["--help"]).output.split())
    seq_length = serve_help[serve_help.index("--seq-length") :].split(" --")[0]
    assert "context less one" in seq_length and "2048" not in seq_length, seq_length  # serve's own default


def _outside(f):
    """A value just outside the field's declared range, NaN for a float."""
    meta = f.metadata
    if float in (get_args(f.type) or (f.type,)):
        return math.nan
    return meta["at_least"] - 1 if meta["at_least"] is not None else meta["at_most"] + 1


@pytest.mark.parametrize("cls", [ExtractConfig, ServeOptions])
def test_a_value_outside_a_declared_range_gets_one_line_naming_its_option(cls):
    ranged = [f for f in fields(cls) if any(f.metadata.get(k) is not None for k in ("at_least", "above", "at_most"))]
    assert ranged
    for f in ranged:
        with pytest.raises(ExtractError) as err:
            check_ranges(cls(**{f.name: _outside(f)}))
        assert option_name(f) in str(err.value) and "\n" not in str(err.value), (f.name, str(err.value))
    check_ranges(cls())  # the defaults are inside


def test_the_serve_command_printed_for_a_dataset_without_states_parses_back_to_its_capture():
    """`--states none` ends by printing the server that captures what the output would hold: the line goes
    through serve's own parser to the manifest's options (fp8 storage, TP, the step budget, the decoder, remote
    code, engine arguments of every JSON kind, a string that reads as JSON kept a string)."""
    from eagle_extract.faces import cli

    engine_args = {"max_num_seqs": 8, "kv_cache_dtype": "fp8", "tokenizer_mode": "123",
                   "hf_overrides": {"a": [1, "x"]}}  # fmt: skip
    config = {"tp": 2, "pp": 2, "decoder_path": "language_model.model", "trust_remote_code": True,
              "max_num_batched_tokens": 512, "engine_args": engine_args}  # fmt: skip
    manifest = {"model": "/models/m v2", "aux_layer_ids": [2, 15, 27], "dtype": "bfloat16", "seq_length": 4096,
                "storage_dtype": "float8_e4m3fn", "config": config}  # fmt: skip
    args = cli.serve_args(manifest)
    assert args[:2] == ["eagle-extract", "serve"]
    params = cli.serve_command.make_context("serve", args[2:]).params
    assert {k: params[k] for k in ("model", "layers", "dtype", "seq_length", "storage_dtype", "tp", "decoder_path",
                                   "trust_remote_code", "max_num_batched_tokens", "engine_args")} == {  # fmt: skip
        "model": "/models/m v2", "layers": "2,15,27", "dtype": "bfloat16", "seq_length": 4096, "storage_dtype": "fp8",
        "tp": 2, "decoder_path": "language_model.model", "trust_remote_code": True, "max_num_batched_tokens": 512,
        "engine_args": {"max_num_seqs": 8, "kv_cache_dtype": "fp8", "tokenizer_mode": "123",
                        "hf_overrides": {"a": [1, "x"]}},
    }  # fmt: skip
    plain = cli.serve_args({**manifest, "storage_dtype": "bfloat16", "config": {"tp": 1, "pp": 1}})
    assert not {"--storage-dtype", "--tp", "--decoder-path", "--trust-remote-code", "--engine-arg",
                "--max-num-batched-tokens"} & set(plain)  # fmt: skip


def test_a_mistyped_command_line_is_one_line_naming_the_help_to_read():
    """click's own usage error is four lines (the usage, a hint, a blank line, the error): here one, in a
    real process, with click's exit status 2.  An empty path (an unset shell variable) is one too: it would
    mean the current folder."""
    import subprocess
    import sys

    for args, said, command in (  # `python -m eagle_extract` names itself so
        (["--dtype", "garbage"], "Invalid value for '--dtype': 'garbage' is not one of", "extract"),
        (["verify"], "Missing argument 'OUTPUT'.", "verify"),
        (["serve", "--no-such-option"], "No such option '--no-such-option'", "serve"),
        (["--output", ""], "Invalid value for '--output': an empty or blank path; name the file", "extract"),
        (["serve", "--spool", " "], "Invalid value for '--spool': an empty or blank path; name the file", "serve"),
    ):
        proc = subprocess.run([sys.executable, "-m", "eagle_extract", *args], capture_output=True, text=True)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith(f"Error: {said}") and lines[0].endswith(f"eagle_extract {command} --help`)"), lines
    proc = subprocess.run([sys.executable, "-m", "eagle_extract", "serve", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "--spool-ttl" in proc.stdout
