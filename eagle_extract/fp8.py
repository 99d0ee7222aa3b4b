"""speculators' FP8 layout: float8_e4m3fn values and one float32 scale per token, value = fp8 * scale."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
SCALES = "hidden_states_scales"


def to_fp8(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """On `hidden`'s own device (the GPU in the capture path, the CPU where stages are joined), with the
    same float32 arithmetic on both, so both give the same bytes.  One slot at a time: the float32
    temporary is one [T, H] slice, not the whole [T, K, H]."""
    dims = tuple(range(1, hidden.dim()))
    amax = hidden.abs().amax(dim=dims, keepdim=True).float()  # exact in any dtype: max of exact values
    # a tensor divisor: CUDA divides by a Python number as a multiplication by its reciprocal, which
    # rounds differently from the CPU's true division (seen on the H200: no row matched)
    scale = (amax / torch.tensor(torch.finfo(FP8).max, device=amax.device)).clamp(min=1e-12)
    if hidden.dim() < 3:
        return (hidden.float() / scale).to(FP8), scale
    out = torch.empty(hidden.shape, dtype=FP8, device=hidden.device)
    for k in range(hidden.shape[1]):
        out[:, k] = (hidden[:, k].float() / scale[:, 0]).to(FP8)
    return out, scale
