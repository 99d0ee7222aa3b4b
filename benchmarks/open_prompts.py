"""Host memory when rows are each other's prefixes (the first k turns of a conversation, `--host-memory`).

    python benchmarks/open_prompts.py [--model smollm2] --conversations 4 --turns 16 --turn-len 100 \
        --host-memory 0.05 --batch-size 64

Every row of a conversation is a strict prefix of the next, so while the longer ones run, the shorter ones'
states stay open in host memory.  Runs the CLI once per --host-memory (the engine start not counted: the
manifest's extract_s) and prints the budget, the peak, the open prompts that did not fit and the rows run
again.  Rows are random token ids (a fixed seed).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=16)
    ap.add_argument("--turn-len", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--host-memory", type=float, action="append", required=True, help="GiB; repeat to compare")
    args = ap.parse_args()
    rng = random.Random(3)
    rows = []
    for _ in range(args.conversations):
        whole = [rng.randrange(100, 40000) for _ in range(args.turns * args.turn_len)]
        rows += [{"input_ids": whole[: k * args.turn_len]} for k in range(1, args.turns + 1)]
    print(f"{len(rows)} rows of {args.turn_len} to {args.turns * args.turn_len} tokens, batch {args.batch_size}")
    print(
        "| --host-memory | budget bytes | peak bytes | peak / budget | open prompts dropped | rows run again "
        "| extract s |"
    )
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "turns.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        for run, gib in enumerate(args.host_memory):
            out = Path(tmp) / f"out-{run}"
            cmd = [sys.executable, "-m", "eagle_extract", "--model", args.model, "--data", str(data),
                   "--data-format", "tokens", "--output", str(out), "--batch-size", str(args.batch_size),
                   "--host-memory", str(gib)]  # fmt: skip
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            manifest = json.loads((out / "eagle_extract.json").read_text())
            c = manifest["capture"]
            budget, peak = c["host_budget_bytes"], c["host_peak_bytes"]
            print(f"| {gib} | {budget:,} | {peak:,} | {peak / budget:.2f} | {c.get('dropped_partials', '-')} "
                  f"| {c['redo_rows']} | {manifest['timing']['extract_s']:.1f} |")


if __name__ == "__main__":
    main()
