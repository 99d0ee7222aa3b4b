"""`--dp N`: N engine replicas on one node, each extracting one shard of the rows.

Each replica is its own process running shard k/N of the same job (`shards.py`), on its own
devices: `--tp` GPUs each (CUDA_VISIBLE_DEVICES), or an equal slice of the CPU cores.  The
parent checks the input once, starts the replicas, shows one progress bar, and stops them all
if one fails.  Whichever replica finishes last completes the dataset files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from ..config import ExtractConfig
from ..data.formats import read_rows
from ..errors import ExtractError
from ..files.manifest import MANIFEST, read_manifest
from ..files.shards import SHARDS_DIR
from ..interrupts import stop_on_signals
from ..runlog import PROGRESS_FILE, progress, shared_progress
from .completion import merge
from .engine import cpu_thread_binding
from .lock import REPLICA_ENV
from .output import (
    already_complete,
    claimed,
    finish_run,
    forget_other_counts,
    identical_complete,
    log_name,
    prepare_output,
    refuse_foreign_files,
    replace_complete,
    writing_folder,
)
from .plan import make_plan
from .run import run
from .stream import expected_rows, first_chunks, first_counts


def device_slices(dp: int, tp: int, pp: int = 1) -> list[dict]:
    """Per replica: the environment that gives it its own devices, and (CPU) its cores."""
    import torch

    if torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        per = tp * pp
        if len(gpus) < dp * per:
            raise ExtractError(
                f"--dp {dp} --tp {tp} --pp {pp} needs {dp * per} GPUs, {len(gpus)} visible; lower --dp, --tp or --pp"
            )
        return [{"env": {"CUDA_VISIBLE_DEVICES": ",".join(gpus[k * per : (k + 1) * per])}} for k in range(dp)]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < dp * tp:
        raise ExtractError(f"--dp {dp} --tp {tp} needs {dp * tp} CPU cores, {len(cores)} available; lower --dp")
    per = len(cores) // dp
    slices = [cores[k * per : (k + 1) * per] for k in range(dp)]
    return [{"env": {"VLLM_CPU_OMP_THREADS_BIND": cpu_thread_binding(tp, s)}, "cores": s} for s in slices]


def _last_line(path: Path) -> str:
    lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()] if path.exists() else []
    return lines[-1] if lines else "no output"


def run_replicas(cfg: ExtractConfig, log=print) -> dict:
    """`cfg.dp` replicas of `cfg` (resolved), each a shard; returns the completed output's manifest."""
    dp = cfg.dp
    if cfg.shard or cfg.regenerate:
        raise ExtractError("--dp cannot be combined with --shard or --regenerate")
    plan = make_plan(cfg)  # every input check once, before any engine starts
    if cfg.overwrite:
        refuse_foreign_files(Path(cfg.output), cfg.data)
    read, usable, _, ended = first_counts(first_chunks(plan, read_rows(cfg.data)))
    expected = expected_rows(cfg, read, usable, ended)
    output = Path(cfg.output)
    slices = device_slices(dp, cfg.tp, cfg.pp)
    with claimed(output, None) as lock_fd:  # the replicas hold their shards' locks under this one
        manifest = identical_complete(output, plan.identity, cfg.overwrite, cfg.states)
        if manifest:
            log(already_complete(output))
            return manifest
        target = writing_folder(output, plan.identity, cfg.overwrite)
        prepare_output(target, plan.identity, cfg.overwrite and target == output)  # clears the folder once when asked
        finish_run(target, None)
        forget_other_counts(target, dp)
        _run_replicas(replace(cfg, output=target), slices, expected, log, lock_fd)
        manifest = read_manifest(target) if (target / MANIFEST).exists() else merge(target)
        return replace_complete(target, output) if target != output else manifest


def _run_replicas(cfg: ExtractConfig, slices: list[dict], total: int, log, lock_fd: int | None) -> None:
    """Start the replicas, each handed the folder's lock (held while any of them lives), and watch them."""
    dp, output = cfg.dp, Path(cfg.output)
    (output / SHARDS_DIR).mkdir(exist_ok=True)
    procs = []
    progress_files = [output / SHARDS_DIR / f".{k}-of-{dp}.progress" for k in range(dp)]
    try:
        for k, part in enumerate(slices):
            config = replace(cfg, shard=f"{k}/{dp}", overwrite=False).record()  # each takes 1/dp of --host-memory
            cores = part.get("cores")
            with open(output / SHARDS_DIR / f"{k}-of-{dp}.log", "w") as logfile:  # the child keeps its own handle
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "eagle_extract.job.replicas", json.dumps(config)],
                        env={**os.environ, **part["env"], "TQDM_DISABLE": "1", REPLICA_ENV: str(os.getpid()),
                             PROGRESS_FILE: str(progress_files[k])},  # fmt: skip
                        stdout=logfile,
                        stderr=subprocess.STDOUT,
                        preexec_fn=(lambda c=cores: os.sched_setaffinity(0, c)) if cores else None,
                        pass_fds=() if lock_fd is None else (lock_fd,),
                    )
                )
        log(f"{dp} replicas started ({', '.join(str(p.pid) for p in procs)}); logs in {output / SHARDS_DIR}")
        with progress(total, f"extract x{dp}", "row") as bar:
            while True:
                bar.update(max(0, shared_progress(progress_files) - bar.n))
                failed = [k for k, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed:
                    k = failed[0]
                    last = _last_line(output / SHARDS_DIR / f"{k}-of-{dp}.log")
                    if "the run's log" not in last:  # killed before it could say where its log is
                        last += f"; its run's log: {output / log_name((k, dp))}"
                    raise ExtractError(
                        f"replica {k} failed ({last}); every completed row is kept: rerun the same command to resume"
                    )
                if all(p.returncode == 0 for p in procs):
                    break
                time.sleep(1)
    finally:
        for path in progress_files:
            path.unlink(missing_ok=True)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:  # the folder's lock is theirs too: it is released only when they are gone
            while p.poll() is None:
                try:
                    p.wait()
                except KeyboardInterrupt:  # a second Ctrl-C: stop them harder, still wait
                    p.kill()


def _replica(config_json: str) -> int:
    """One replica's process: the parent passes its ExtractConfig as JSON."""
    stop_on_signals()
    cfg = ExtractConfig.from_options(**json.loads(config_json))
    where = os.environ.get("CUDA_VISIBLE_DEVICES") or f"CPU cores {sorted(os.sched_getaffinity(0))}"
    print(f"replica {cfg.shard} on {'GPUs ' if 'CUDA_VISIBLE_DEVICES' in os.environ else ''}{where}", flush=True)
    try:
        run(cfg)
    except ExtractError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("Error: interrupted; every completed row is kept", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_replica(sys.argv[1]))
