"""Rows per second served to speculators' own online client against offline extraction of the same rows.

    python benchmarks/online.py --model PATH [--dummy] --rows 512 --prompt-len 1024 --spool /dev/shm --spool /tmp
    (--model smollm2: the bundled SmolLM2; a --dummy model folder needs config.json and a tokenizer)

For each spool folder: offline, `eagle-extract` writes the rows into that folder (`--reps` runs, the engine
start not counted: the manifest's extract_s); online, one `eagle-extract serve` with its spool there, and
`--clients` processes (speculators' loader runs 12 worker processes a rank, each with its own client)
pulling every row through speculators' ArrowDataset and hs-connectors' FileTransfer (request, answer, load,
check, delete), `--reps` passes.  Rows
are random token ids of --prompt-len (a fixed seed), the same for both.  Prints a table; --json saves it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(n: int, length: int, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(100, vocab, (n, length), generator=g).tolist()


def _model_args(args) -> list[str]:
    extra = ["--engine-arg", "load_format=dummy"] if args.dummy else []
    return ["--model", args.model, "--dtype", args.dtype, *extra, *args.extra]


def offline(args, data: Path, folder: Path) -> float:
    """Rows per second of one extraction into `folder` (engine start not counted)."""
    out = Path(tempfile.mkdtemp(prefix="offline.", dir=folder))
    try:
        cmd = [sys.executable, "-m", "eagle_extract", *_model_args(args), "--data", str(data), "--data-format",
               "tokens", "--output", str(out), "--overwrite", "--no-disk-check"]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        manifest = json.loads((out / "eagle_extract.json").read_text())
        return manifest["num_samples"] / manifest["timing"]["extract_s"]
    finally:
        shutil.rmtree(out, ignore_errors=True)


class Serving:
    def __init__(self, args, folder: Path) -> None:
        self.port = _free_port()
        cmd = [sys.executable, "-m", "eagle_extract", "serve", *_model_args(args), "--port", str(self.port),
               "--spool", str(folder)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        while not any(line.startswith("serving ") for line in self.lines):
            if self.proc.poll() is not None:
                raise SystemExit("".join(self.lines))
            time.sleep(0.5)

    def stop(self) -> str:
        """Stop it; returns its last line (rows, engine calls, time in them and in the workers' drains)."""
        self.proc.terminate()
        self.proc.wait(timeout=60)
        time.sleep(0.5)
        return next((line.strip() for line in reversed(self.lines) if line.startswith("stopped: ")), "")


_DATASET = None  # each client process's own ArrowDataset, as each of speculators' data-loader workers has


def _client(datapath: str, port: int, model: str, max_len: int) -> None:
    global _DATASET
    from hs_connectors import FileTransfer
    from speculators.train.data import ArrowDataset

    _DATASET = ArrowDataset(max_len=max_len, datapath=datapath, transfer=FileTransfer(Path(datapath) / "hs"),
                            vllm_endpoint=f"http://127.0.0.1:{port}/v1", model=model, on_missing="generate",
                            train_ratio=1.0, split="train", request_timeout=600, max_retries=1)  # fmt: skip


def _fetch(index: int) -> str | None:
    """One row through speculators' client (request, answer, load, check, delete); None when it came."""
    item = _DATASET[index]
    return None if isinstance(item, dict) else str(item)


def _ready(_) -> bool:
    time.sleep(0.5)  # long enough that every process of the pool takes one
    return _DATASET is not None


def online(pool, rows: int) -> float:
    """Rows per second of one pass of the client processes over every row."""
    t0 = time.perf_counter()
    failed = [why for why in pool.map(_fetch, range(rows)) if why]
    seconds = time.perf_counter() - t0
    if failed:
        raise SystemExit(f"{len(failed)} rows failed, first: {failed[0]}")
    return rows / seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dummy", action="store_true", help="random weights (load_format=dummy)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--clients", type=int, default=12, help="client processes (speculators' --num-workers)")
    ap.add_argument("--spool", action="append", required=True, help="folder for both modes' files (repeatable)")
    ap.add_argument("--extra", nargs="*", default=[], help="further eagle-extract options for both modes")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from datasets import Dataset
    from transformers import AutoTokenizer

    if args.model == "smollm2":  # the bundled model, by the name the server then serves it under
        from eagle_extract.smollm2 import ensure_smollm2

        vocab = len(AutoTokenizer.from_pretrained(ensure_smollm2()))
    else:
        vocab = len(AutoTokenizer.from_pretrained(args.model))
    rows = _rows(args.rows, args.prompt_len, vocab)
    work = Path(tempfile.mkdtemp(prefix="online-bench."))
    data = work / "rows.jsonl"
    data.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    datapath = work / "dataset"
    ds = Dataset.from_dict({"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows],
                            "seq_len": [len(r) for r in rows]})  # fmt: skip
    ds.set_format("torch")
    ds.save_to_disk(str(datapath))
    results = []
    for spool in map(Path, args.spool):
        spool.mkdir(parents=True, exist_ok=True)
        off = [offline(args, data, spool) for _ in range(args.reps)]
        server = Serving(args, spool)
        try:
            init = (str(datapath), server.port, args.model, args.prompt_len + 1)
            with ProcessPoolExecutor(args.clients, mp_context=multiprocessing.get_context("spawn"),
                                     initializer=_client, initargs=init) as pool:  # fmt: skip
                assert all(pool.map(_ready, range(2 * args.clients)))  # every client started, before the clock
                on = [online(pool, args.rows) for _ in range(args.reps)]
        finally:
            said = server.stop()
        print(f"server: {said}", flush=True)
        row = {"spool": str(spool), "offline_rows_s": off, "online_rows_s": on, "server": said,
               "ratio": statistics.median(on) / statistics.median(off)}  # fmt: skip
        results.append(row)
        print(f"{spool}: offline {statistics.median(off):.1f} rows/s {off}, online {statistics.median(on):.1f} "
              f"rows/s {on}, online/offline {row['ratio']:.3f}", flush=True)  # fmt: skip
    print(f"{args.model}, {args.rows} rows x {args.prompt_len} tokens, {args.clients} client processes")
    print("| spool | offline rows/s | online rows/s | online/offline |")
    for r in results:
        off, on = statistics.median(r["offline_rows_s"]), statistics.median(r["online_rows_s"])
        print(f"| {r['spool']} | {off:.1f} | {on:.1f} | {r['ratio']:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
