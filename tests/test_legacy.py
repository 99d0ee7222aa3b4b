"""--format speculators-legacy: speculators 0.3/0.4's data_{i}.pt files, layer ids translated.

That version numbered layer *outputs*: its id j is the output of decoder layer j, which is
transformers' output_hidden_states[j + 1] (and for the last layer, the final norm's input).
The check below is phrased in that numbering, against transformers in float32.
"""

from __future__ import annotations

import json

import torch
from datasets import load_from_disk

from eagle_extract.layers import legacy_layer_ids

from .common import Reference, rel_err
from .conftest import BUDGET, ONE_PROCESS, run_cli


def test_translation_of_ids():
    assert legacy_layer_ids([2, 30, 58, 61]) == [1, 29, 57, 60]


def test_legacy_files_hold_the_layer_outputs_their_ids_name(tmp_path, tiny_llama, mixed_conversations):
    out = tmp_path / "legacy"
    args = ["--model", str(tiny_llama), "--data", str(mixed_conversations), "--output", str(out)]
    run_cli(*args, "--dtype", "float32", "--layers", "1,3", "--format", "speculators-legacy", *BUDGET, env=ONE_PROCESS)
    manifest = json.loads((out / "eagle_extract.json").read_text())
    assert manifest["format"] == "speculators-legacy" and manifest["slot_layer_ids"] == [1, 3, 6]
    legacy_ids = manifest["legacy_layer_ids"]
    assert legacy_ids == [0, 2, 5]  # outputs of layers 0, 2 and 5 (the last of 6)
    assert not (out / "hidden_states").exists() or not any((out / "hidden_states").iterdir())
    ref = Reference(tiny_llama)
    rows = load_from_disk(str(out))
    worst = 0.0
    for i in range(len(rows)):
        sample = torch.load(out / f"data_{i}.pt", weights_only=True)
        assert torch.equal(sample["input_ids"], rows[i]["input_ids"]) and sample["input_ids"].dtype == torch.long
        assert torch.equal(sample["loss_mask"], rows[i]["loss_mask"])
        want = ref.slots(sample["input_ids"].tolist(), [j + 1 for j in legacy_ids])  # output of layer j
        assert len(sample["hidden_states"]) == 3
        for k, states in enumerate(sample["hidden_states"]):
            worst = max(worst, rel_err(states, want[:, k]))
    assert worst < 1e-4, worst
    assert "passes every check" in run_cli("verify", str(out)).stdout
