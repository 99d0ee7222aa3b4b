"""The independent reference: Hugging Face transformers on the same weights, in float32.

Slot for id L < n is `output_hidden_states[L]`; the final slot (id n) is the *input* of
the final norm, captured with a forward pre-hook, because transformers' last
`output_hidden_states` entry is taken after the norm (FACTS §2).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file


class Reference:
    def __init__(self, model_path: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.num_layers = self.model.config.num_hidden_layers
        self._norm_input = None
        self.model.model.norm.register_forward_pre_hook(self._grab)

    def _grab(self, module, args):
        self._norm_input = args[0].detach().clone()

    @torch.no_grad()
    def slots(self, input_ids: list[int], layer_ids: list[int]) -> torch.Tensor:
        """[T, K, H] float32 for the given ids; id n means the final norm's input."""
        out = self.model(torch.tensor([input_ids]), output_hidden_states=True)
        hs = out.hidden_states
        cols = [self._norm_input[0] if i == self.num_layers else hs[i][0] for i in layer_ids]
        return torch.stack(cols, dim=1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def load_row(out: Path, i: int) -> dict:
    return load_file(str(Path(out) / "hidden_states" / f"hs_{i}.safetensors"))
