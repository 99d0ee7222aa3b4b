"""The command line documents itself: every option has help and a row in the README (errors:
test_hostile_inputs.py)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _table_options(heading: str) -> set[str]:
    """The options the first cells of the README table whose header row starts with `heading` name."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {heading} |"))
    found = set()
    for line in itertools.takewhile(lambda line: line.startswith("|"), lines[start + 2 :]):
        found |= set(re.findall(r"`(--[a-z0-9-]+)", line.split("|")[1]))
    return found


def _command_options(command) -> dict[str, str]:
    return {opt: param.help or "" for param in command.params for opt in param.opts if opt.startswith("--")}


def test_every_option_has_help_and_a_readme_row_and_every_row_an_option():
    from eagle_extract.cli import extract_command, serve_command

    extract, serve = _command_options(extract_command), _command_options(serve_command)
    assert not [o for o, text in {**extract, **serve}.items() if not text.strip()]
    assert _table_options("option") == set(extract)
    assert _table_options("serve option") == set(serve) - set(extract)
    assert "--states" in _table_options("option") and "--spool-ttl" in _table_options("serve option")
