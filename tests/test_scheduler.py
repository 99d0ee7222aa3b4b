"""Rows that positions and token ids alone cannot tell apart, on the real engine: never written swapped.

vLLM's `long_prefill_token_threshold` cuts every running prompt's chunk, so several prompts are mid-prefill
at once at equal lengths, and vLLM moves requests between batch slots when others finish.  Twins (equal
length, different early tokens, identical after) then continue each other's partial prompts as far as
tokens and positions can say.  The matcher before this test gave each twin the other's states after the
cut (4 of 24 rows, checked against transformers); now those rows are run again alone.
"""

from __future__ import annotations

import json
import random

from .common import Reference, load_row, rel_err
from .conftest import extract


def _twin_rows(pairs: int = 6) -> list[dict]:
    rng = random.Random(7)
    rows = []
    for _ in range(pairs):
        twin = [rng.randrange(100, 40000) for _ in range(115)]
        other = list(twin)
        other[25:28] = [rng.randrange(100, 40000) for _ in range(3)]
        short = [[rng.randrange(100, 40000) for _ in range(rng.randrange(20, 40))] for _ in range(2)]
        rows += [short[0], twin, other, short[1]]
    return [{"input_ids": ids} for ids in rows]


def test_twins_mid_prefill_in_swapped_slots_get_their_own_states(tmp_path_factory, tiny_llama):
    data = tmp_path_factory.mktemp("twins") / "twins.jsonl"
    rows = _twin_rows()
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = extract(
        tmp_path_factory, tiny_llama, data, "--data-format", "tokens", "--dtype", "float32", "--layers", "1,3",
        "--engine-arg", "long_prefill_token_threshold=16", "--max-num-batched-tokens", "64", "--batch-size", "4",
    )  # fmt: skip
    manifest = json.loads((out / "eagle_extract.json").read_text())
    ref = Reference(tiny_llama)
    layer_ids = manifest["slot_layer_ids"]
    worst = 0.0
    for i, row in enumerate(rows):
        got = load_row(out, i)
        assert got["token_ids"].tolist() == row["input_ids"]
        worst = max(worst, rel_err(got["hidden_states"], ref.slots(row["input_ids"], layer_ids)))
    assert worst < 1e-4, worst
    capture = manifest["capture"]
    assert capture["ambiguous_runs"] > 0 and capture["redo_rows"] > 0, capture  # the case was reached
