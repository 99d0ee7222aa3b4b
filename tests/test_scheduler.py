"""Rows that positions and token ids alone cannot tell apart, on the real engine: never written swapped.

vLLM's `long_prefill_token_threshold` cuts every running prompt's chunk, so several prompts are mid-prefill
at once at equal lengths, and vLLM moves requests between batch slots when others finish.  Twins (equal
length, different early tokens, identical after) then continue each other's partial prompts as far as
tokens and positions can say.  The matcher before this test gave each twin the other's states after the
cut (4 of 24 rows, checked against transformers); now those rows are run again.
"""

from __future__ import annotations

import json
import random

from .common import Reference, load_row, rel_err
from .conftest import ONE_PROCESS, extract


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


def _turn_rows(conversations: int = 4) -> list[dict]:
    """The first k turns of a conversation, four to a batch: each row a strict prefix of the next."""
    rng = random.Random(11)
    rows = []
    for _ in range(conversations):
        whole = [rng.randrange(100, 40000) for _ in range(160)]
        rows += [{"input_ids": whole[:k]} for k in (40, 80, 120, 160)]
    return rows


def test_twins_mid_prefill_in_swapped_slots_get_their_own_states(tmp_path_factory, tiny_llama):
    """Also rows that are each other's prefixes under a --host-memory too small to keep them all open:
    the prompts that do not fit are run again, and host memory stays within its bound (the code before
    this bound reached 786,432 bytes here: every open prompt was copied whatever the budget)."""
    data = tmp_path_factory.mktemp("twins") / "twins.jsonl"
    rows = _twin_rows() + _turn_rows()
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    limit_gib = 0.0002
    out = extract(
        tmp_path_factory, tiny_llama, data, "--data-format", "tokens", "--dtype", "float32", "--layers", "1,3",
        "--engine-arg", "long_prefill_token_threshold=16", "--max-num-batched-tokens", "64", "--batch-size", "4",
        "--host-memory", str(limit_gib), env=ONE_PROCESS,
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
    assert capture["dropped_partials"] > 0, capture
    per_token = 3 * 128 * 4  # slots x hidden x float32
    # the documented bound: the budget, one step's rows (64 tokens) and one open prompt alone (160 tokens)
    assert capture["host_peak_bytes"] <= int(limit_gib * 2**30) + (64 + 160) * per_token, capture


def test_a_step_budget_that_holds_the_longest_prompt_runs_each_whole_and_nothing_again(tmp_path_factory, tiny_llama):
    """The same rows under a step budget of the model length (201 tokens; a call's 8 rows hold about 800):
    eagle-extract starts vLLM with prompts unchunked, so none is split, no run can be read two ways, and the
    states still equal transformers'.  Chunked, this budget split every step's last prompt."""
    data = tmp_path_factory.mktemp("whole") / "rows.jsonl"
    rows = _twin_rows() + _turn_rows()
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = extract(tmp_path_factory, tiny_llama, data, "--data-format", "tokens", "--dtype", "float32", "--layers",
                  "1,3", "--batch-size", "8", "--seq-length", "200", "--max-num-batched-tokens", "201",
                  env=ONE_PROCESS)  # fmt: skip
    manifest = json.loads((out / "eagle_extract.json").read_text())
    capture = manifest["capture"]
    assert capture["split_requests"] == capture["ambiguous_runs"] == capture["redo_rows"] == 0, capture
    assert capture["settled_rows"] == len(rows), capture
    ref = Reference(tiny_llama)
    worst = max(
        rel_err(load_row(out, i)["hidden_states"], ref.slots(row["input_ids"], manifest["slot_layer_ids"]))
        for i, row in enumerate(rows)
    )
    assert worst < 1e-4, worst
