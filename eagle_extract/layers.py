"""Layer ids in vLLM's EAGLE-3 convention (FACTS §2), checked before any engine starts.

Id L is the residual stream entering decoder layer L (transformers' output_hidden_states[L]);
id n = num_hidden_layers is the last layer's output before the final norm and is always
written as the final slot.
"""

from __future__ import annotations

import re

from .errors import ExtractError

CONVENTION = (
    "vllm-eagle3: slot for id L is the residual stream entering decoder layer L "
    "(= transformers output_hidden_states[L]); the last slot, id num_hidden_layers, is the "
    "last decoder layer's output before the final norm"
)


class LayerError(ExtractError, ValueError):
    pass


def default_aux_ids(num_layers: int) -> list[int]:
    ids = sorted({2, num_layers // 2, num_layers - 3})
    if ids[0] < 0 or ids[-1] >= num_layers:  # under 3 layers the EAGLE-3 ids fall outside the model
        raise LayerError(
            f"a {num_layers}-layer model has no default --layers (EAGLE-3's 2, n//2 and n-3 give {ids}); "
            f"pass --layers with ids from 0 to {num_layers - 1}"
        )
    return ids


def parse_layer_ids(text: str | None, num_layers: int) -> list[int]:
    """'2,30,58' → [2, 30, 58]; None → the EAGLE-3 default (2, n//2, n-3)."""
    if text is None or not text.strip():
        return default_aux_ids(num_layers)
    ids = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise LayerError(
                f"--layers: an empty id in {text!r} (two commas together, or one at an end); give comma-separated "
                "ids like 2,15,27"
            )
        if not re.fullmatch(r"[+-]?[0-9]+", part):  # int() would read 1_5 as 15 and ٣ as 3
            raise LayerError(f"--layers: '{part}' is not an integer; give comma-separated ids like 2,15,27")
        ids.append(int(part))
    valid = f"valid auxiliary ids are 0..{num_layers - 1} (the final slot, {num_layers}, is always written)"
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise LayerError(f"--layers: id {bad[0]} is out of range for a {num_layers}-layer model; {valid}")
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise LayerError(f"--layers: id {dupes[0]} is given twice; list each layer once")
    return sorted(ids)


def legacy_layer_ids(slot_ids: list[int]) -> list[int]:
    """speculators 0.3/0.4 numbered layer outputs: our id L (the input of layer L, which is the
    output of layer L-1) is their L-1, and the final slot n (last layer's output) is their n-1."""
    return [layer - 1 for layer in slot_ids]
