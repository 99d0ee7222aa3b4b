"""vLLM's executors on one GPU (docs/scaling.md): with Ray (gpu/requirements-ray.lock) the extension
installs through Ray's workers and its rows equal the multiprocess executor's bitwise; with either executor
the engine watch sees a killed worker end the run in one line, and the same command resumes to the same bits.
One request per generate call fixes the batches, hence the bits."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .runs import REPO, child_env, extract, extracted, root_cause, rows_compared

NEEDS_RAY = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="no Ray (gpu/requirements-ray.lock)")
pytestmark = pytest.mark.gpu

ROWS = 300
INFO = {"VLLM_LOGGING_LEVEL": "INFO"}  # the run's log then shows the executor vLLM built


def with_backend(name: str) -> tuple[str, ...]:
    return ("--dtype", "bfloat16", "--batch-size", "1", "--max-samples", str(ROWS),
            "--engine-arg", f"distributed_executor_backend={name}")  # fmt: skip


@pytest.fixture(scope="module")
def data() -> Path:
    from eagle_extract.config import bundled_data

    return bundled_data()


@pytest.fixture(scope="module")
def mp_rows(smollm2, data, work) -> Path:
    """SmolLM2 bf16 rows from the multiprocess executor: the reference of every test here."""
    return extracted(smollm2, data, work / "exec-mp", *with_backend("mp"))


@NEEDS_RAY
def test_ray_rows_equal_the_multiprocess_executors(smollm2, data, work, mp_rows, record):
    """The extension reaches Ray's workers: the same rows, bit for bit."""
    out = extracted(smollm2, data, work / "exec-ray", *with_backend("ray"), env=INFO)
    worst, same, ids, n = rows_compared(out, mp_rows)
    log = (out / "eagle_extract.log").read_text()
    said = [line.split("] ", 1)[-1].strip() for line in log.splitlines() if re.search(r"Ray|ray\.", line)]
    record("bitwise_equal", f"{same}/{n}")
    record("token_files_equal", ids)
    record("ray_lines", f"{len(said)} Ray lines in the run's log, first: {said[0][:120] if said else 'none'}")
    assert same == n and ids, f"{same} of {n} rows bitwise equal to mp's, token files equal {ids}"


@pytest.fixture(scope="module", params=[pytest.param("ray", marks=NEEDS_RAY), "mp"])
def killed(request, smollm2, data, work) -> dict:
    """A run of `backend` whose worker is killed once two rows are on the disk: what was seen after."""
    import psutil
    from safetensors.torch import load_file

    from eagle_extract.job.watch import _running

    backend = request.param
    out = work / f"exec-{backend}-killed"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "eagle_extract", "--model", str(smollm2), "--data", str(data), "--output", str(out),
           *with_backend(backend)]  # fmt: skip
    log = work / "exec-killed.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**child_env("0"), **INFO}, cwd=REPO,
                                start_new_session=True)  # fmt: skip
    engine, titles = [], {}
    try:
        t_start = time.time()
        while len(list((out / "hidden_states").glob("hs_*.safetensors"))) < 2:
            if time.time() - t_start > 400 or proc.poll() is not None:
                raise RuntimeError(f"no rows after {time.time() - t_start:.0f} s: {root_cause(log.read_text())}")
            time.sleep(0.05)
        for p in psutil.Process(proc.pid).children(recursive=True):
            try:  # a short-lived descendant (an idle Ray worker) can be gone already
                titles[p.pid] = (" ".join(p.cmdline()) or p.name()).strip()[:60]
                engine.append(p)
            except psutil.Error:
                pass
        worker = next((p for p in engine if re.search(r"ray::RayWorker|VLLM::Worker", titles[p.pid])), None)
        if worker is None:
            raise RuntimeError(f"no worker among the run's processes: {sorted(set(titles.values()))}")
        t0 = time.time()
        worker.kill()
        proc.wait(timeout=120)
        after = time.time() - t0
        time.sleep(5)
        # what the watch stops: vLLM's processes and Ray's own (ray::); Ray's daemons die with the engine core
        alive = sorted(titles[p.pid] for p in engine if _running(p) and re.search(r"VLLM|Worker|ray::", titles[p.pid]))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        for p in engine:  # whatever is left must not hold the GPU for the next test
            try:
                p.kill()
            except psutil.Error:
                pass
    rows = sorted((out / "hidden_states").glob("hs_*.safetensors"))
    return {
        "backend": backend,
        "out": out,
        "worker": titles[worker.pid],
        "engine_processes": len(engine),
        "exit": proc.returncode,
        "exit_after_s": round(after, 1),
        "last_line": [line for line in log.read_text().splitlines() if line.strip()][-1],
        "rows": len(rows),
        "rows_whole": sum(load_file(str(path))["hidden_states"].shape[1] == 4 for path in rows),
        "alive_5s_later": alive,
    }


def test_killed_worker_ends_the_run_in_one_line(killed, record):
    """The engine watch ends the run with exit 1 and one line saying to rerun; no engine process is left
    5 s later, and every row written is whole."""
    for key in ("worker", "engine_processes", "exit", "exit_after_s", "last_line", "rows", "rows_whole"):
        record(key, killed[key])
    record("alive_5s_later", killed["alive_5s_later"])
    last = killed["last_line"]
    assert killed["exit"] == 1, killed
    assert last.startswith("Error: the vLLM engine failed") and "rerun the same command to resume" in last, last
    assert not killed["alive_5s_later"], f"still alive 5 s later: {killed['alive_5s_later']}"
    assert killed["rows_whole"] == killed["rows"], f"{killed['rows_whole']} of {killed['rows']} rows kept whole"


def test_same_command_resumes_to_the_same_bits(killed, smollm2, data, mp_rows, record):
    """Rerun as the line says, the killed run resumes and ends with every row bitwise equal to mp's."""
    t0 = time.perf_counter()
    out = killed["out"]
    rc, log = extract(smollm2, data, out, *with_backend(killed["backend"]), env=INFO, overwrite=False)
    record("seconds", round(time.perf_counter() - t0))
    assert rc == 0, root_cause(log)
    resuming = re.search(r"resuming, \d+ rows already written", log)
    worst, same, ids, n = rows_compared(out, mp_rows)
    record("resume_line", resuming[0] if resuming else None)
    record("bitwise_equal", f"{same}/{n}")
    record("token_files_equal", ids)
    assert resuming, "no resume line"
    assert same == n == ROWS and ids, f"{same} of {n} rows bitwise equal to mp's; token files equal {ids}"
