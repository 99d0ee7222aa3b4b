"""Crash safety and verification: a SIGKILLed worker then a rerun, `verify` finding damage, `--repair`."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch
from datasets import load_from_disk
from safetensors.torch import load_file, save_file

from eagle_extract import verify
from eagle_extract.data.store import STORE
from eagle_extract.files.manifest import read_manifest
from eagle_extract.files.rowfile import LAYER_IDS, hidden_state_path, read_row, row_metadata
from eagle_extract.job.lock import MAIN
from eagle_extract.job.output import LOG, REPLACEMENT, RUN_FILE
from eagle_extract.runlog import NOTE, START

from .common import assert_documented, load_row, rel_err
from .conftest import BUDGET, ONE_PROCESS, run_cli

RUN = "During the run"  # docs/errors.md's section


def _tiny_args(model, data, out, *extra) -> list[str]:
    """The arguments of the tiny_tp1_out fixture's run, with another output folder."""
    return ["--model", str(model), "--data", str(data), "--output", str(out), "--dtype", "float32", *BUDGET, *extra]


def _assert_same_output(got, want):
    a, b = load_from_disk(str(got)).with_format(None), load_from_disk(str(want)).with_format(None)
    assert a["input_ids"] == b["input_ids"] and a["loss_mask"] == b["loss_mask"]
    names = sorted(p.name for p in (got / "hidden_states").iterdir())
    assert names == sorted(f"hs_{i}.safetensors" for i in range(len(b)))  # no gaps, no extras, no temp files
    for i in range(len(b)):
        x, y = load_row(got, i), load_row(want, i)
        assert torch.equal(x["token_ids"], y["token_ids"])
        assert rel_err(x["hidden_states"], y["hidden_states"]) < 1e-5


def test_clean_output_verifies(tiny_tp1_out):
    assert verify(tiny_tp1_out).problems == []
    proc = run_cli("verify", str(tiny_tp1_out))
    assert "passes every check" in proc.stdout


def _damage(out):
    """Break rows 0-3 four different ways, add a stray file; return {row: expected words}."""
    p0 = hidden_state_path(out, 0)
    p0.write_bytes(p0.read_bytes()[: p0.stat().st_size // 2])  # truncated
    hidden_state_path(out, 1).unlink()  # deleted
    row2 = load_row(out, 2)
    save_file(
        {"hidden_states": row2["hidden_states"], "token_ids": row2["token_ids"] + 1}, str(hidden_state_path(out, 2))
    )
    row3, meta = read_row(hidden_state_path(out, 3))
    row3["hidden_states"][0, 0, 0] = float("nan")  # as an engine that made NaN wrote it: its checksum holds
    layer_ids = [int(i) for i in meta[LAYER_IDS].split(",")]
    save_file(row3, str(hidden_state_path(out, 3)), metadata=row_metadata(row3, layer_ids))
    shutil.copy(hidden_state_path(out, 4), hidden_state_path(out, 999))
    return {0: "unreadable", 1: "missing", 2: "token_ids differ", 3: "NaN", 999: "stray"}


def test_verify_finds_every_damage_and_repair_fixes_it(tmp_path, tiny_tp1_out):
    out = tmp_path / "damaged"
    shutil.copytree(tiny_tp1_out, out)
    expected = _damage(out)
    found = dict(verify(out).problems)
    assert set(found) == set(expected)
    for row, words in expected.items():
        assert words in found[row], (row, found[row])

    proc = run_cli("verify", str(out), check=False)
    assert proc.returncode == 1 and "5 problem(s)" in proc.stderr and "--repair" in proc.stderr

    untouched = hidden_state_path(out, 5).stat().st_mtime_ns
    hidden_state_path(out, 999).unlink()  # a stray file is the user's to remove, not a row to redo
    proc = run_cli("verify", "--repair", str(out), env=ONE_PROCESS)
    assert "repaired" in proc.stdout
    assert hidden_state_path(out, 5).stat().st_mtime_ns == untouched  # only broken rows were redone
    assert read_manifest(out)["resumed_rows"] == read_manifest(out)["num_samples"] - 4
    _assert_same_output(out, tiny_tp1_out)


def test_a_repair_that_cannot_run_changes_nothing(tmp_path, tiny_tp1_out):
    """The recorded data moved away, then edited: each repair is refused before a file is deleted."""
    from eagle_extract import repair
    from eagle_extract.errors import ExtractError
    from eagle_extract.files.manifest import write_manifest

    out = tmp_path / "damaged"
    shutil.copytree(tiny_tp1_out, out)
    manifest = read_manifest(out)
    data = tmp_path / "moved" / Path(manifest["config"]["data"]).name
    data.parent.mkdir()
    shutil.copy(manifest["config"]["data"], data)
    write_manifest(out, {**manifest, "config": {**manifest["config"], "data": str(data)}})
    hidden_state_path(out, 1).unlink()
    before = sorted(p.name for p in out.rglob("*"))

    data.rename(data.with_suffix(".away"))
    with pytest.raises(ExtractError, match=r"cannot repair .*: its recorded extraction cannot run again here \(.*"
                       r"\); nothing was changed$"):  # fmt: skip
        repair(out, [1])
    assert sorted(p.name for p in out.rglob("*")) == before
    data.with_suffix(".away").rename(data)
    with data.open("a") as f:
        f.write(data.read_text().splitlines()[0] + "\n")
    with pytest.raises(ExtractError, match=r"would now run with a different data_sha256 .*nothing was changed\)$"):
        repair(out, [1])
    assert sorted(p.name for p in out.rglob("*")) == before
    proc = run_cli("verify", str(out), check=False)
    assert proc.returncode == 1 and "1 problem(s)" in proc.stderr.splitlines()[-1], proc.stderr


def _fill(disk, leave: int):
    """Fill `disk` until it is full, then free `leave` bytes."""
    ballast = disk / "ballast"
    with open(ballast, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass
    os.truncate(ballast, max(0, ballast.stat().st_size - leave))
    return ballast


def test_full_disk_mid_run_stops_cleanly_and_resumes(small_disk, tiny_llama, mixed_conversations, tiny_tp1_out):
    out = small_disk / "out"
    args = _tiny_args(tiny_llama, mixed_conversations, out)
    proc = _start(args, small_disk.parent / "log")  # the log must not share the full disk
    try:
        _wait_for(lambda: (out / RUN_FILE).exists())  # the size check has passed
        ballast = _fill(small_disk, leave=200_000)  # room for a few rows, not for all of them
    finally:
        _finish(proc, "disk full", timeout=300)
    assert proc.returncode != 0
    assert not (out / "eagle_extract.json").exists()
    kept = sorted((out / "hidden_states").glob("hs_*.safetensors"))
    assert len(kept) < 24
    for path in kept:  # every file under a final name is whole
        assert load_file(str(path))["hidden_states"].shape[1:] == (3, 128)

    ballast.unlink()
    run_cli(*args)
    _assert_same_output(out, tiny_tp1_out)


def _start(args, log):
    """Start a run in its own process group, its output going to `log` (a pipe could fill and block it)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "eagle_extract", *args], stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    proc.log = log
    return proc


def _wait_for(condition, timeout=240):
    deadline = time.time() + timeout
    while not condition():
        if time.time() > deadline:
            raise AssertionError(f"waited {timeout} s in vain")
        time.sleep(0.02)


def _finish(proc, case: str, timeout=120):
    """Wait for the run to end; return the last line it showed, which must be the one-line error
    docs/errors.md gives for `case`."""
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [line for line in proc.log.read_text().splitlines() if line.strip()]
    assert lines, "the run showed nothing"
    assert_documented(RUN, case, lines[-1])  # the engine's noise is in the run's log, never last
    return lines[-1]


def _engine_processes(proc) -> list:
    def named(p):
        try:
            return p.name().startswith("VLLM::")
        except psutil.NoSuchProcess:
            return False

    return [p for p in psutil.Process(proc.pid).children(recursive=True) if named(p)]


def _workers_once_started(proc) -> tuple[list, list]:
    """The engine's processes and its workers, found before the rows come: on a 2-core CI machine the tiny
    model's 24 rows take 0.75 s, less than finding them after the first row can take."""
    _wait_for(lambda: any("Worker" in p.name() for p in _engine_processes(proc)))
    engine = _engine_processes(proc)
    return engine, [p for p in engine if "Worker" in p.name()]


def _alive(processes) -> list:
    def running(p):
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return [p.pid for p in processes if running(p)]


def test_a_hung_engine_is_stopped_after_the_stall_timeout_and_leaves_no_process(
    tmp_path, tiny_llama, mixed_conversations
):
    """A stopped (SIGSTOP) worker is alive and makes no progress, as in a stalled collective."""
    data = tmp_path / "long.jsonl"  # 20 times the rows, so the run cannot finish before its workers are stopped
    data.write_text(mixed_conversations.read_text() * 20)
    args = _tiny_args(tiny_llama, data, tmp_path / "o", "--batch-size", "1", "--stall-timeout", "8")
    before = set(Path(tempfile.gettempdir()).glob("eagle_extract_heartbeat.*"))
    proc = _start(args, tmp_path / "log")
    engine, workers = _workers_once_started(proc)
    _wait_for(lambda: list((tmp_path / "o" / "hidden_states").glob("hs_*.safetensors")))
    for worker in workers:
        worker.suspend()
    beats = set(Path(tempfile.gettempdir()).glob("eagle_extract_heartbeat.*")) - before
    assert len(beats) == 1 and time.time() - beats.pop().stat().st_mtime < 30  # the workers touch it as they step
    case = (
        "the run makes no progress for `--stall-timeout` seconds (default 1800; a stalled collective, a hung GPU, "
        "a writer blocked on a network filesystem, which blocks the forward pass through the host-memory budget)"
    )
    last = _finish(proc, case)
    assert proc.returncode == 1 and "--stall-timeout 8" in last and not _alive(engine)
    assert last in (tmp_path / "o" / "eagle_extract.log").read_text()
    assert set(Path(tempfile.gettempdir()).glob("eagle_extract_heartbeat.*")) <= before  # removed


def test_a_sigterm_while_the_engine_starts_ends_the_run_at_once_and_leaves_no_process(
    tmp_path, tiny_llama, mixed_conversations
):
    """vLLM's start-up wait takes the KeyboardInterrupt a signal raises for its own and waited on, 10 minutes,
    for an engine whose handshake it had cut short; the signal now stops the engine's processes instead."""
    started = time.time()
    proc = _start(_tiny_args(tiny_llama, mixed_conversations, tmp_path / "o"), tmp_path / "log")
    _wait_for(lambda: _engine_processes(proc))  # the engine core is starting: the driver waits for it in vLLM
    proc.send_signal(signal.SIGTERM)  # to the run's process alone, as `kill PID` sends it
    sent = time.time()
    _finish(proc, "SIGINT (Ctrl-C) or SIGTERM", timeout=90)
    assert proc.returncode == 1 and time.time() - sent < 30
    def the_runs(p):  # the run's session: the run started it, and vLLM's processes stay in it
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            return os.getsid(p.pid) == proc.pid and p.create_time() >= started - 1
        return False

    left = [p for p in psutil.process_iter() if the_runs(p)]
    psutil.wait_procs(left, timeout=10)  # helpers such as multiprocessing's resource tracker end a moment later
    assert not _alive(left)  # its engine core, and worker if any


STARTING = """
import os, signal, subprocess, sys, time
from eagle_extract.interrupts import stop_on_signals
from eagle_extract.job.engine import _signals_stop_the_start
stop_on_signals()
def titled(title):  # a process named `title` (its first 15 bytes), as vLLM's setproctitle names its own
    return subprocess.Popen([sys.executable, "-c", "import sys, time; open('/proc/self/comm', 'w').write(sys.argv[1])"
                             "; time.sleep(60)", title])
kept = titled("VLLM::before")  # running before the start: not this engine's
started = [kept]
try:
    with _signals_stop_the_start():
        os.kill(os.getpid(), signal.SIGTERM)  # before the engine has a process
        time.sleep(0.3)
        started.append(titled("tokenizer"))  # a new process that is not the engine's
        started.append(titled("VLLM::EngineCore"))
        started[-1].wait(timeout=20)
        print("engine", started[-1].returncode, flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
finally:
    said = [p.poll() for p in started[:2]]
    for p in started:
        p.kill()
print("kept", said[0], "other", said[1], "handler", signal.getsignal(signal.SIGTERM).__name__, flush=True)
"""


def test_a_signal_while_the_engine_starts_stops_its_processes_alone_and_is_the_interrupt():
    """No engine: processes titled as vLLM's, one started before the start, one after the signal."""
    proc = subprocess.run([sys.executable, "-c", STARTING], capture_output=True, text=True, timeout=60)
    said = proc.stdout.splitlines()
    assert said == ["engine -9", "interrupted", "kept None other None handler _interrupt"], (said, proc.stderr)


WATCHED = """
import time
from eagle_extract.job.watch import EngineWatch
watch = EngineWatch(stall_s=2.0)
watch.expect_engine()
watch.start()
t0 = time.time()
while time.time() - t0 < 6:  # an engine call of 6 s whose steps touch the heartbeat: progress
    watch.heartbeat.touch()
    time.sleep(0.2)
print(f"stepped {time.time() - t0:.1f} s", flush=True)
time.sleep(30)  # then nothing moves: a stall
"""


def test_engine_steps_count_as_progress_and_their_absence_as_a_stall(tmp_path):
    """The watch alone, in a process of its own (it ends the process): no driver beat for 6 s, but steps."""
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", WATCHED], capture_output=True, text=True)
    stepped = re.fullmatch(r"stepped ([\d.]+) s\n", proc.stdout)
    assert proc.returncode == 1 and stepped and float(stepped.group(1)) >= 6, (proc.stdout, proc.stderr)
    assert re.search(r"made no progress for \d+ s \(--stall-timeout 2\)", proc.stderr) and time.time() - t0 < 20


RAY_LEFT = """
import os, subprocess, sys, time
from eagle_extract.job.watch import EngineWatch
watch = EngineWatch()
watch.expect_engine()
titled = "import os, setproctitle, time; setproctitle.setproctitle(os.environ['T']); time.sleep(float(os.environ['S']))"
agent = subprocess.Popen([sys.executable, "-c", titled], env={**os.environ, "T": "ray::RuntimeEnvAgent", "S": "60"})
worker = subprocess.Popen([sys.executable, "-c", titled], env={**os.environ, "T": "ray::RayWorkerProc", "S": "4"})
time.sleep(2)  # both carry their titles now
print(agent.pid, flush=True)
watch.start()
time.sleep(60)
"""


def test_a_dead_ray_worker_ends_the_run_and_takes_rays_agents_with_the_engine():
    """vLLM's Ray workers (ray::RayWorkerProc) are watched like its own; Ray's agents are not watched but are
    stopped with the engine: on one H200 (vLLM 0.22, Ray 2.60) a killed Ray worker ended the run in 3.5 s,
    and Ray's DashboardAgent and RuntimeEnvAgent outlived it (docs/scaling.md)."""
    proc = subprocess.run([sys.executable, "-c", RAY_LEFT], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip().isdigit(), (proc.stdout, proc.stderr)
    agent = int(proc.stdout)
    try:
        assert proc.returncode == 1 and "the vLLM engine failed (engine process" in proc.stderr, proc.stderr
        time.sleep(1)  # the agent, orphaned now, is reaped by init
        assert not _alive([psutil.Process(agent)]) if psutil.pid_exists(agent) else True
    finally:
        if psutil.pid_exists(agent):
            psutil.Process(agent).kill()


def test_one_output_folder_through_a_failure_a_rival_a_dead_worker_a_power_cut_a_rerun_and_overwrites(
    tmp_path, tiny_llama, mixed_conversations, tiny_tp1_out
):
    """The misuse and accidents one output folder meets, in the order a user would meet them, on real
    runs of one command with --batch-size 1.  One request per generate call fixes vLLM's batch
    composition, so the resumed --overwrite run's bytes equal the first resumed run's (batched runs can differ in
    the last bits: the engine core may start stepping before all of a call's requests have arrived;
    see docs/results/NOTES_gpu_checks.md)."""
    out = tmp_path / "o"
    args = _tiny_args(tiny_llama, mixed_conversations, out, "--batch-size", "1")
    failing = ["--engine-arg", "max_num_seqs=0"]  # passes the checks, then vLLM refuses it while starting

    # a run that fails before writing a row leaves nothing that refuses a corrected, different command
    proc = run_cli(*args, "--max-samples", "6", *failing, check=False)
    case = "a failure after the checks (the engine refuses a setting, the engine dies, a full disk)"
    assert proc.returncode == 1 and "max_num_seqs" in proc.stderr and not (out / RUN_FILE).exists()
    assert not (out / STORE).exists()  # nor a token store: the corrected command's data may differ
    assert_documented(RUN, case, proc.stderr.strip().splitlines()[-1])
    assert "Traceback" in (out / LOG).read_text()  # the whole story is in the run's log

    # a --decoder-path naming nothing is found only once the model is loaded: the user's line, not vLLM's
    proc = run_cli(*args, "--max-samples", "6", "--decoder-path", "no.such.path", check=False)
    case = "`--decoder-path` names no module with decoder layers (found only once the engine has loaded the model)"
    assert proc.returncode == 1 and not (out / RUN_FILE).exists(), proc.stderr
    assert_documented(RUN, case, proc.stderr.strip().splitlines()[-1])

    # a second run into the folder is refused while the first one runs ...
    first = _start(args, tmp_path / "first.log")
    try:
        _wait_for(lambda: (out / MAIN).exists() and (out / MAIN).read_text())
        rival = run_cli(*args, check=False)
        engine, workers = _workers_once_started(first)
        assert len(engine) > len(workers), [p.name() for p in engine]
        _wait_for(lambda: len(list((out / "hidden_states").glob("hs_*.safetensors"))) >= 4)
        workers[0].kill()  # ... which then loses a worker: reported, not waited for
        _finish(first, "a worker process dies")
        assert first.returncode == 1 and not _alive(engine)  # the engine core too: nothing is left holding GPUs
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    lines = [line for line in rival.stderr.splitlines() if line.strip()]
    assert rival.returncode == 1 and len(lines) == 1, rival.stderr
    assert f"is being written by another eagle-extract run (pid {first.pid} on" in lines[0]
    assert_documented("Before the engine starts", "a second run into a folder a run is writing", lines[0])

    # a resume whose engine runs in another dtype than the rows so far (--dtype auto elsewhere) is refused, before
    # the engine starts: --dtype float32 runs as asked
    kept = sorted((out / "hidden_states").glob("hs_*.safetensors"))
    first = hidden_state_path(out, min(int(p.stem.split("_")[1]) for p in kept))
    original, tensors = first.read_bytes(), load_file(str(first))
    save_file({**tensors, "hidden_states": tensors["hidden_states"].bfloat16()}, str(first))
    refused = run_cli(*args, check=False)
    case = (
        "a resume whose engine runs in another dtype than the rows so far (`--dtype auto` chose otherwise on another "
        "GPU or vLLM, or a model whose config says float32, run first with `--dtype auto`, then with `--dtype float32`)"
    )
    assert_documented(RUN, case, refused.stderr.strip().splitlines()[-1])
    assert "runs in float32, but the" in refused.stderr and "are bfloat16" in refused.stderr
    *_, killed, this = (out / LOG).read_text().split(NOTE + START)
    vllm_logged = re.compile(r"\[\w+\.py:\d+\]")  # as vLLM's log lines name their source
    assert vllm_logged.search(killed) and not vllm_logged.search(this)  # the engine started for one, not the other
    first.write_bytes(original)

    # what a power cut can do to files whose names reached the disk before their bytes did
    assert 4 <= len(kept) < 24 and not (out / "eagle_extract.json").exists(), len(kept)
    kept[0].write_bytes(kept[0].read_bytes()[: kept[0].stat().st_size - 100])  # cut short
    kept[1].write_bytes(b"")  # emptied
    kept[2].write_bytes(kept[2].read_bytes()[:20])  # cut inside its header

    # the rerun finds them by their headers, writes them again, and shows only its own lines
    resumed = run_cli(*args)
    whole = len(kept) - 3
    assert f"resuming, {whole} rows already written (3 damaged files are written again)" in resumed.stdout
    assert read_manifest(out)["resumed_rows"] == whole and read_manifest(out)["redone_rows"] == 3
    assert read_manifest(out)["tokenized_rows"] == 0  # the killed run's token store held every row
    shown = (resumed.stdout + resumed.stderr).splitlines()
    assert resumed.stdout.splitlines()[-1].startswith("train on it: speculators train"), shown[-5:]
    assert not [line for line in shown if "WARNING" in line or "EngineCore" in line]  # only our lines ...
    assert "(EngineCore pid=" in (out / LOG).read_text()  # ... and the engine's in the run's log
    _assert_same_output(out, tiny_tp1_out)
    assert verify(out).ok
    first_run = tmp_path / "first"
    shutil.copytree(out, first_run)

    # rerunning the finished command has nothing to do
    again = run_cli(*args)
    assert "is already complete" in again.stdout and again.stdout.splitlines()[-1].startswith("train on it:")

    # --overwrite keeps the complete output, and the user's own files, until its replacement is complete:
    # a Ctrl-C stops the replacement (the engine's processes may die of it first: still the interrupt, not
    # the engine's failure), and the same command then resumes it
    (out / "notes.txt").write_text("mine")
    replacing = _start([*args, "--overwrite"], tmp_path / "replacing.log")
    staged = out / REPLACEMENT / "hidden_states"
    _wait_for(lambda: list(staged.glob("hs_*.safetensors")))
    os.killpg(replacing.pid, signal.SIGINT)  # Ctrl-C in a terminal: the engine's processes get it too
    _finish(replacing, "SIGINT (Ctrl-C) or SIGTERM")
    assert replacing.returncode == 1
    assert (out / REPLACEMENT / RUN_FILE).exists() and verify(out).ok and (out / "notes.txt").read_text() == "mine"
    for path in staged.glob("hs_*.safetensors"):  # a final name only ever holds a whole file
        assert load_file(str(path))["hidden_states"].shape[1:] == (3, 128)
    done = len(list(staged.glob("hs_*.safetensors")))
    assert f"resuming, {done} rows already written" in run_cli(*args, "--overwrite").stdout
    assert verify(out).ok and (out / "notes.txt").read_text() == "mine" and not (out / REPLACEMENT).exists()
    assert read_manifest(out)["config"]["output"] == str(out)
    for i in range(read_manifest(first_run)["num_samples"]):
        a, b = load_row(first_run, i), load_row(out, i)
        assert torch.equal(a["token_ids"], b["token_ids"])
        assert torch.equal(a["hidden_states"], b["hidden_states"])


def test_engine_failure_keeps_the_cause_of_a_multi_line_error_on_one_line():
    """vLLM's config errors are pydantic ValidationErrors whose first line only counts the errors."""
    from eagle_extract.errors import engine_failed

    exc = ValueError(
        "1 validation error for ModelConfig\n"
        "  Value error, Model architectures ['X'] failed to be inspected. [type=value_error]\n"
        "    For further information visit https://errors.example/value_error"
    )
    message = str(engine_failed(exc))
    assert "\n" not in message
    assert "ModelConfig Value error, Model architectures ['X'] failed to be inspected" in message
    assert "For further information" not in message and message.endswith("rerun the same command to resume")


def test_engine_failure_names_what_the_engine_process_logged_in_this_run(tmp_path):
    """vLLM's driver says only "See root cause above"; the line names the exception the engine process
    wrote to the run's log (lines as vLLM 0.24 wrote them on an H200,
    docs/results/gpu_checks_vllm-0.24.0_kimi_int4_after_moe_h200_2026-12-03.txt), never one an earlier
    run wrote into the same log."""
    from eagle_extract.errors import engine_failed

    log = tmp_path / "eagle_extract.log"
    earlier = f"2026-12-03 08:00:00 eagle-extract: {START}eagle-extract --model m\n" + (
        "(EngineCore pid=6495) NotImplementedError: MLA is not supported on CPU.\n")  # fmt: skip
    now = f"2026-12-03 08:33:40 eagle-extract: {START}eagle-extract --model m\n" + (
        "(EngineCore pid=1323) ERROR 12-03 08:34:02 [core.py:1231] ValueError: Free memory on device cuda:0 "
        "(125.73/139.8 GiB) on startup is less than desired GPU memory utilization (0.92, 128.62 GiB).\n"
        "(EngineCore pid=1323)     raise ValueError(\n"
        "(EngineCore pid=1323) RuntimeError: Engine core initialization failed. See root cause above.\n")  # fmt: skip
    exc = RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")
    log.write_text(earlier + now)
    message = str(engine_failed(exc, log))
    assert message.startswith("the vLLM engine failed (ValueError: Free memory on device cuda:0 (125.73/139.8 GiB)")
    log.write_text(earlier + now.split("\n", 1)[0] + "\n")  # this run's engine process logged nothing
    message = str(engine_failed(exc, log))
    assert message.startswith("the vLLM engine failed (RuntimeError: Engine core initialization failed.")
    assert "MLA" not in message and str(engine_failed(exc, tmp_path / "absent.log")) == message
    dead = RuntimeError("EngineCore encountered an issue. See stack trace (above) for the root cause.")
    worker = "\x1b[36m(Worker_TP1 pid=9)\x1b[0m torch.OutOfMemoryError: CUDA out of memory.\n"  # Ray colours it
    pointer = "(EngineCore_DP0 pid=7) Exception: WorkerProc failed. See stack trace for root cause.\n"
    log.write_text(now.split("\n", 1)[0] + "\n" + worker + pointer)
    said = str(engine_failed(dead, log))
    assert said.startswith("the vLLM engine failed (torch.OutOfMemoryError: CUDA out of memory.)")


def test_engine_failure_names_the_fix_for_humming_running_out_of_memory_while_loading(tmp_path):
    """vLLM 0.34's Humming INT4 MoE kernel unpacks a layer's experts while loading and runs out of GPU memory
    (lines as vLLM 0.34 wrote them on an H100 for Kimi-K2.5 at 7 layers, 2026-12-06,
    docs/results/kimi_int4_7l_marlin_then_humming_vllm-0.34.0_h100_2026-12-06.log): the line names moe_backend=marlin
    and leaves out torch's allocator advice; another out-of-memory error gets no such fix."""
    from eagle_extract.errors import engine_failed

    error = "(EngineCore pid=2430) ERROR 12-06 06:33:09 [core.py:1757] "
    oom = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 42.00 GiB. GPU 0 has a total capacity of "
        "79.18 GiB of which 18.23 GiB is free. Including non-PyTorch memory, this process has 60.94 GiB memory in "
        "use. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    )
    start = f"2026-12-06 06:32:41 eagle-extract: {START}eagle-extract --model kimi\n"
    traceback = f"{error}Traceback (most recent call last):\n"
    humming = f"{traceback}{error}    convert_to_humming_moe_kernel_format(\n"
    exc = RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")
    log = tmp_path / "eagle_extract.log"
    log.write_text(start + humming + error + oom + "\n")
    said = str(engine_failed(exc, log))
    assert said.startswith(
        "the vLLM engine failed (torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 42.00 GiB. GPU 0 has "
        "a total capacity of 79.18 GiB of which 18.23 GiB is free.), while vLLM unpacked"
    ), said
    assert "--engine-arg moe_backend=marlin" in said and "PYTORCH_CUDA_ALLOC_CONF" not in said and "\n" not in said
    log.write_text(start + error + oom + "\n")  # out of memory elsewhere: torch's whole message, no fix
    said = str(engine_failed(exc, log))
    assert "moe_backend" not in said and "Including non-PyTorch memory" in said
    retried = "(EngineCore pid=2430) WARNING [core.py:1] retried\n"
    log.write_text(start + humming + retried + traceback + error + oom + "\n")
    assert "moe_backend" not in str(engine_failed(exc, log))  # the Humming frames were another traceback's
