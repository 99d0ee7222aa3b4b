"""How fast a run of N conversations gets its first row on the disk, and how much memory its driver holds.

Writes synthetic ShareGPT rows (4 turns of Zipf-distributed pseudo-words, distinct per row,
about 590 SmolLM2 tokens each, as in issue #20's measurement), runs the CLI on them for a while
and stops it with SIGINT.  Measured
per run, polled every 0.25 s:
  first_file_s    start to the first hs_*.safetensors on the disk
  driver_rss_mib  the driver's peak RSS (the eagle-extract process; the engine's processes and the
                  tokenizing workers are counted apart)
  workers_mib     the tokenizing worker processes' peak RSS, summed
  tokenize_rows_s source rows tokenized per second (the token store's markers), engine_rows_s rows
                  written per second after the first, both over the run's window
  waited_s        the seconds the capture loop waited for the tokenizer (the run's log)

    python benchmarks/streaming.py --rows 10000 100000 1000000 --seconds 120 [--old /path/to/old/checkout]

`--old` also runs another checkout of eagle-extract (PYTHONPATH) on the same files, side by side.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

SYLLABLES = [c + v for c in "bcdfghklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou", "er")]


def _words(n: int = 20_000) -> tuple[list[str], list[float]]:  # (words, cumulative weights)
    """A vocabulary of pseudo-words of 1 to 4 syllables with Zipf weights, like a language's: the
    tokenizer meets common words often and rare ones seldom (the bundled conversations know 118 words)."""
    rng = random.Random(0)
    words = sorted({"".join(rng.choices(SYLLABLES, k=rng.randint(1, 4))) for _ in range(n)})
    rng.shuffle(words)
    return words, list(itertools.accumulate(1 / (k + 1) for k in range(len(words))))


def write_rows(path: Path, rows: int) -> Path:
    """Distinct 4-turn conversations of those words, about 590 SmolLM2 tokens each; kept for the next run."""
    if path.exists():
        return path
    (words, cumulative), tmp = _words(), path.with_suffix(".tmp")
    turns = [("human", 17), ("gpt", 66), ("human", 17), ("gpt", 66)]
    with open(tmp, "w") as f:
        for i in range(rows):
            rng = random.Random(i)
            said = [" ".join(rng.choices(words, cum_weights=cumulative, k=n)) + "." for _, n in turns]
            said[0] = f"({i}) {said[0]}"
            f.write(json.dumps({"conversations": [{"from": w, "value": v} for (w, _), v in zip(turns, said)]}) + "\n")
    tmp.rename(path)
    return path


def _store_read(out: Path) -> int:
    markers = sorted(out.glob(".eagle_extract_tokens*/chunk_*.json"))
    for marker in reversed(markers):
        try:
            return json.loads(marker.read_text())["read"]
        except (OSError, ValueError):
            continue
    return 0


def _tokenizer_worker(process) -> bool:
    """A spawned worker that is not one of the engine's (vLLM titles its own VLLM::...)."""
    return "spawn_main" in " ".join(process.cmdline()) and not process.name().startswith("VLLM")


def run_once(command: list[str], env: dict, out: Path, seconds: float) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    driver = psutil.Process(proc.pid)
    peak = workers_peak = 0
    first = None
    read_at_first = files_at_first = 0
    hidden = out / "hidden_states"
    while proc.poll() is None:
        try:
            peak = max(peak, driver.memory_info().rss)
            workers = [c for c in driver.children(recursive=True) if _tokenizer_worker(c)]
            workers_peak = max(workers_peak, sum(w.memory_info().rss for w in workers))
        except psutil.Error:
            pass
        files = sum(1 for _ in os.scandir(hidden)) if hidden.is_dir() else 0
        if first is None and files:
            first, read_at_first, files_at_first = time.perf_counter() - t0, _store_read(out), files
        if first is not None and time.perf_counter() - t0 > first + seconds:
            proc.send_signal(signal.SIGINT)
            break
        time.sleep(0.25)
    window = time.perf_counter() - t0 - (first or 0)
    read, files = _store_read(out), sum(1 for _ in os.scandir(hidden)) if hidden.is_dir() else 0
    proc.wait()
    log = (out / "eagle_extract.log").read_text(errors="replace") if (out / "eagle_extract.log").exists() else ""
    waited = re.findall(r"([\d.]+) s waiting for the tokenizer", log)
    return {
        "first_file_s": round(first, 1) if first else None,
        "driver_rss_mib": round(peak / 2**20),
        "workers_mib": round(workers_peak / 2**20),
        "tokenize_rows_s": round((read - read_at_first) / window, 1) if first and window else None,
        "tokenized_rows": read,
        "engine_rows_s": round((files - files_at_first) / window, 2) if first and window else None,
        "waited_s": float(waited[-1]) if waited else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--seconds", type=float, default=120.0, help="how long each run goes on after its first file")
    parser.add_argument("--work", type=Path, default=Path("/tmp/eagle-streaming"))
    parser.add_argument("--old", type=Path, help="another checkout to run side by side (its PYTHONPATH)")
    parser.add_argument("args", nargs="*", help="extra eagle-extract arguments (after --)")
    a = parser.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    builds = [("this", Path(__file__).resolve().parents[1])]
    builds += [("old", a.old)] if a.old else []
    columns = "first file s | driver peak RSS MiB | workers MiB | tokenized rows/s | engine rows/s | waited s"
    print(f"| rows | build | {columns} |")
    print("|---|---|---|---|---|---|---|---|")
    for rows in a.rows:
        data = write_rows(a.work / f"rows_{rows}.jsonl", rows)
        for name, root in builds:
            out = a.work / f"out_{rows}_{name}"
            subprocess.run(["rm", "-rf", str(out)], check=True)
            env = {**os.environ, "PYTHONPATH": str(root)}
            command = [sys.executable, "-m", "eagle_extract", "--data", str(data), "--output", str(out), *a.args]
            r = run_once(command, env, out, a.seconds)
            print(
                f"| {rows:,} | {name} | {r['first_file_s']} | {r['driver_rss_mib']} | {r['workers_mib']} | "
                f"{r['tokenize_rows_s']} ({r['tokenized_rows']:,} rows) | {r['engine_rows_s']} | {r['waited_s']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
