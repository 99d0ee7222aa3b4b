"""Two host-side suspects for the capture's cost beside a GPU's forward pass, measured without an engine.

    python benchmarks/capture_host_probes.py [--folder DIR] [--tokens 2048] [--hidden 7168] [--seconds 3]

gil       How late the main thread (standing in for the worker's forward pass, which launches the GPU's work)
          wakes from 1 ms sleeps while one writer thread writes Kimi-wide rows with `write_hidden_states` into
          --folder (tmpfs by default): a writer holding the GIL through a long call would show here as lateness
          of that call's length. Against the same sleeps with nothing running.
assemble  The assembler's Python per step: 128 prompts of --tokens random ids announced to the matcher, then read
          from steps of 16,384 tokens (8 prompts each) as the capture reads them (`RequestMatcher.add`).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle_extract.files.writer import write_hidden_states  # noqa: E402
from eagle_extract.worker.hostmem import ByteBudget, Held, Rows  # noqa: E402
from eagle_extract.worker.matching import RequestMatcher, segments  # noqa: E402


def wake_lateness(seconds: float) -> list[float]:
    """Milliseconds each 1 ms sleep overran, for `seconds`."""
    late, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        time.sleep(0.001)
        late.append((time.perf_counter() - t - 0.001) * 1e3)
    return late


def gil(folder: Path, tokens: int, hidden: int, seconds: float) -> None:
    (folder / "hidden_states").mkdir(parents=True, exist_ok=True)
    row, ids = torch.randn(tokens, 4, hidden).to(torch.bfloat16), list(range(tokens))
    stop, written = threading.Event(), [0]

    def write() -> None:
        while not stop.is_set():
            write_hidden_states(folder, written[0] % 8, row, ids, layer_ids=[1, 2, 3, 4])
            written[0] += 1

    for label, busy in (("nothing running", False), ("one writer thread", True)):
        thread = threading.Thread(target=write) if busy else None
        stop.clear()
        if thread:
            thread.start()
        late = sorted(wake_lateness(seconds))
        stop.set()
        if thread:
            thread.join()
        rows = f", {written[0]} rows of {row.nbytes / 1e6:.0f} MB written" if busy else ""
        p99 = late[int(len(late) * 0.99)]
        print(f"gil, {label}: late by {statistics.median(late):.2f} ms median, {p99:.2f} p99, {late[-1]:.2f} max{rows}")
    shutil.rmtree(folder)


def assemble(tokens: int) -> None:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 160_000, (tokens,), generator=g).tolist() for _ in range(128)]
    matcher, budget = RequestMatcher(), ByteBudget(1 << 40)
    for index, ids in enumerate(prompts):
        matcher.expect(index, ids)
    per_step = max(1, 16_384 // tokens)
    took = []
    for first in range(0, len(prompts), per_step):
        ids = torch.tensor(sum(prompts[first : first + per_step], []))
        positions = torch.cat([torch.arange(tokens)] * (len(ids) // tokens))
        held = Held(budget, 0, torch.empty(len(ids), 0), None)
        t = time.perf_counter()
        id_list = ids.tolist()
        for offset, length, start in segments(positions):
            matcher.add(id_list[offset : offset + length], start, Rows(held, offset, offset + length))
        matcher.prune()
        took.append((time.perf_counter() - t) * 1e3)
    rest = ", ".join(f"{x:.1f}" for x in took[1:])
    print(f"assemble: {len(ids):,} tokens a step, first step {took[0]:.1f} ms, then {rest} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", type=Path, default=Path("/dev/shm/eagle-probe"), help="gil's rows go here, removed")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    if args.folder.exists():
        raise SystemExit(f"capture_host_probes: {args.folder} exists: name a new folder (it is removed after)")
    gil(args.folder, args.tokens, args.hidden, args.seconds)
    assemble(args.tokens)


if __name__ == "__main__":
    main()
