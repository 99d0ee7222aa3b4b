"""The command line documents itself (errors: test_hostile_inputs.py)."""

from __future__ import annotations

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
    "--pp",
    "--max-samples",
    "--seq-length",
    "--dtype",
    "--batch-size",
    "--max-num-batched-tokens",
    "--engine-arg",
    "--decoder-path",
    "--trust-remote-code",
    "--overwrite",
    "--no-disk-check",
    "--storage-dtype",
]


def test_help_documents_every_option():
    out = run_cli("--help").stdout
    for option in OPTIONS:
        assert re.search(rf"^\s+{re.escape(option)}\b", out, re.M), option
