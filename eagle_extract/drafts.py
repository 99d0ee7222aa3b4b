"""The draft kinds speculators 0.9 trains from these states: each kind's training flags, and how vLLM serves it.

Every kind reads the same rows (`hidden_states` at the auxiliary layer ids, the final slot apart), so one output
trains them all; speculators defaults every kind but mtp to the EAGLE-3 ids, and mtp reads the final slot alone.
"""

from __future__ import annotations

from .config import DRAFT_KINDS

# vLLM's speculative `method` for each kind's draft folder (0.32: vllm/config/speculative.py; a P-EAGLE draft is
# served as an EAGLE-3 one with `parallel_drafting`, as vLLM's own reading of a speculators folder does).  mtp is not
# served from speculators' draft folder: `speculators stitch-mtp` puts its weights back into the verifier, which
# vLLM serves with method "mtp".
VLLM_METHOD = {"eagle3": "eagle3", "peagle": "eagle3", "dflash": "dflash", "dflash2": "dflash", "dspark": "dspark"}


def train_flags(kind: str, aux_ids: list[int]) -> list[str]:
    """`speculators train` flags that pick the kind and the layers the output holds."""
    if kind not in DRAFT_KINDS:
        raise ValueError(f"--speculator-type {kind}: choose one of {', '.join(DRAFT_KINDS)}")
    layers = [] if kind == "mtp" else ["--target-layer-ids", *map(str, aux_ids)]  # mtp fixes its own: the final slot
    return ["--speculator-type", kind, *layers]


def missing_layers(kind: str, asked: list[int], aux_ids: list[int]) -> list[int]:
    """The layer ids a training command asks for that the output does not hold (none for mtp, which reads the
    final slot every output has)."""
    return [] if kind == "mtp" else [i for i in asked if i not in aux_ids]


def speculative_config(kind: str, draft: str, config: dict) -> dict | None:
    """vLLM's --speculative-config for a trained draft folder whose config.json is `config`; None for mtp."""
    method = VLLM_METHOD.get(kind)
    if method is None:
        return None
    proposals = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    served = {"method": method, "model": draft, "num_speculative_tokens": proposals[0].get("speculative_tokens", 3)}
    return {**served, "parallel_drafting": True} if kind == "peagle" else served
