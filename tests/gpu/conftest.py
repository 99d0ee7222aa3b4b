"""The GPU tests' options, their JSON report, and the fixtures they share.

Every test here is marked `gpu` and skipped where torch sees no CUDA device, before any fixture runs:
on a CPU machine these tests cost their collection only (no model is built, no engine starts).
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import pytest
import torch

NO_CUDA = "no CUDA device: the GPU checks run on a GPU machine (scripts/gpu_run.sh)"


def pytest_addoption(parser):
    group = parser.getgroup("gpu", "eagle-extract's GPU tests (tests/gpu)")
    group.addoption(
        "--gpu-work",
        type=Path,
        default=Path("/tmp/gpu-work"),
        help="where the GPU tests build models and write outputs; kept, so a rerun reuses the models",
    )
    group.addoption(
        "--gpu-report",
        type=Path,
        default=None,
        help="write each test's outcome and recorded figures here as JSON at the end of the session",
    )
    group.addoption("--kimi-layers", type=int, default=12,
                    help="decoder layers of Kimi-K2.5 as released (at least 7: its aux layers are 2, N/2, N-3); "
                    "vLLM 0.34 ran out of memory at 12 on one H200, 8 fits")  # fmt: skip
    group.addoption("--kimi-engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="a further --engine-arg for Kimi-K2.5 as released; repeatable")  # fmt: skip


def pytest_configure(config):
    layers = config.getoption("kimi_layers", 12)
    if not 2 < layers // 2 < layers - 3:
        raise pytest.UsageError(f"--kimi-layers {layers}: give at least 7, so that layers 2, N/2 and N-3 differ")


def pytest_collection_modifyitems(config, items):
    """One skip reason for every GPU test on a machine without CUDA, ahead of any other (a `skipif` put
    first: pytest weighs skipif marks before skip marks, in their order)."""
    if torch.cuda.is_available():
        return
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skipif(True, reason=NO_CUDA), append=False)


RESULTS: dict[str, dict] = {}


def pytest_runtest_logreport(report):
    """Each test's outcome, seconds and recorded figures, for --gpu-report."""
    entry = RESULTS.setdefault(
        report.nodeid, {"check": report.nodeid, "ok": False, "outcome": None, "detail": "", "figures": {}, "seconds": 0}
    )
    entry["seconds"] = round(entry["seconds"] + report.duration, 1)
    entry["figures"].update(report.user_properties)
    if entry["outcome"] not in (None, "passed"):  # the first phase that did not pass says what happened
        return
    if report.skipped and hasattr(report, "wasxfail"):
        entry["outcome"], entry["detail"] = "xfailed", report.wasxfail
    elif report.skipped:
        entry["outcome"] = "skipped"
        entry["detail"] = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    elif report.failed:
        entry["outcome"] = "failed" if report.when == "call" else "error"
        crash = getattr(report.longrepr, "reprcrash", None)
        entry["detail"] = crash.message if crash else str(report.longrepr)[-2000:]
    elif report.when == "call":
        entry["outcome"] = "xpassed" if hasattr(report, "wasxfail") else "passed"
    entry["ok"] = entry["outcome"] == "passed"


def pytest_sessionfinish(session):
    path = session.config.getoption("gpu_report", None)
    if path is None:
        return
    from ..conftest import RELEASE

    cuda = torch.cuda.is_available()
    env = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpus": torch.cuda.device_count(),
        "vllm": RELEASE,
        "torch": torch.__version__,
        "args": list(session.config.invocation_params.args),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"env": env, "results": list(RESULTS.values())}, indent=2, default=str))


@pytest.fixture
def record(record_property):
    """record(name, value): a figure of this test for the --gpu-report JSON (and the JUnit XML)."""
    return record_property


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    """A reference model left in this process (its hooks make a cycle) would starve the next engine."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def work(request) -> Path:
    path = request.config.getoption("gpu_work")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def kimi_layers(request) -> int:
    return request.config.getoption("kimi_layers")


@pytest.fixture(scope="session")
def kimi_engine_args(request) -> tuple[str, ...]:
    return tuple(x for arg in request.config.getoption("kimi_engine_arg") for x in ("--engine-arg", arg))


@pytest.fixture
def reference():
    """reference(path): transformers float32 on the GPU, with TF32 off (IEEE float32, as the engine's)."""
    from ..common import Reference

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return lambda path: Reference(path, device="cuda")
