"""speculators' FP8 layout: float8_e4m3fn values and one float32 scale per token, value = fp8 * scale."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
SCALES = "hidden_states_scales"


def to_fp8(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, K, H] states to (float8_e4m3fn values, float32 scales [T, 1, 1]) on `hidden`'s own device:
    the GPU in the capture path, the CPU where pipeline stages are joined.  Both do the same float32
    arithmetic, so both give the same bytes.  Each slot is divided straight into the FP8 output: for
    bf16, fp16 and float32 states the division computes in float32 (the scale's dtype) and casts as it
    stores, so on a GPU no float32 copy of the states is made and they are read twice, not five times."""
    # max |x| per token without a full-size |x| temporary; exact in any dtype (a max of exact values)
    amax = torch.linalg.vector_norm(hidden, ord=float("inf"), dim=(1, 2), keepdim=True).float()
    # a tensor divisor, filled on the device (no host copy, no sync): CUDA divides by a Python number as
    # a multiplication by its reciprocal, which rounds differently from the CPU (seen on the H200)
    scale = (amax / torch.full((), torch.finfo(FP8).max, device=amax.device)).clamp(min=1e-12)
    out = torch.empty(hidden.shape, dtype=FP8, device=hidden.device)
    for k in range(hidden.shape[1]):
        torch.div(hidden[:, k], scale[:, 0], out=out[:, k])
    return out, scale
