"""What one `eagle-extract serve` holds as a trainer pulls rows from it for a long time: memory, descriptors,
threads and spool files of each of its processes, against the rows served.

    python benchmarks/server_soak.py --model PATH [--minutes 30] [--rows 4096] [--prompt-len 64] [--clients 4]
        [--mooncake]

A trainer pulls each row many times over days (speculators' loader asks again every epoch, since its client deletes
each file once read). Anything the server keeps per request, and never lets go of, grows with the rows served: this
measures that growth. `--clients` processes run speculators' own client (ArrowDataset and hs-connectors'
FileTransfer, as in `online.py`) over the `--rows` distinct rows again and again until `--minutes` have passed;
every `--every` seconds the server's process tree (the server, vLLM's engine core and worker; with --mooncake,
`serve --transfer mooncake` and its `mooncake_master` too) is sampled. Prints each sample and, per process, the
growth of its resident memory in bytes per row served, fitted over the samples after the first fifth of the run
(start-up and the allocator's warm-up left out). --json saves every sample.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from online import Master, Serving, _client, _fetch, _ready, _rows  # noqa: E402 - the same client as online.py's


def _tree(proc: psutil.Process, master: psutil.Process | None) -> dict[str, dict]:
    """Each process of the server's tree by its title: resident memory, descriptors, threads."""
    got = {}
    for p in [proc, *proc.children(recursive=True), *([master] if master else [])]:
        try:
            with p.oneshot():
                name = {proc.pid: "server", getattr(master, "pid", None): "mooncake_master"}.get(p.pid) or p.name()
                got[f"{name} ({p.pid})"] = {"rss": p.memory_info().rss, "fds": p.num_fds(), "threads": p.num_threads()}
        except psutil.Error:  # one that ended meanwhile
            pass
    return got


def _spool(folder: Path) -> tuple[int, int]:
    files = [p for p in folder.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files if p.exists())


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="checkpoint folder, or 'smollm2'")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--dummy", action="store_true", help="random weights (load_format=dummy)")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--rows", type=int, default=4096, help="distinct rows, pulled again and again")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--clients", type=int, default=4, help="client processes (speculators' --num-workers)")
    ap.add_argument("--every", type=float, default=30.0, help="seconds between samples")
    ap.add_argument("--spool", default=None, help="folder the server's spool goes in (default: a fresh temporary one)")
    ap.add_argument("--extra", type=shlex.split, action="extend", default=[],
                    help="more `eagle-extract serve` options: --extra='--tp 2'")  # fmt: skip
    ap.add_argument("--mooncake", action="store_true", help="serve through --transfer mooncake (loopback TCP)")
    ap.add_argument("--mooncake-segment-gib", type=float, default=4.0, help="the server's Mooncake segment")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from datasets import Dataset
    from transformers import AutoTokenizer

    if args.model == "smollm2":
        from eagle_extract.smollm2 import ensure_smollm2

        vocab = len(AutoTokenizer.from_pretrained(ensure_smollm2()))
    else:
        vocab = len(AutoTokenizer.from_pretrained(args.model))
    work = Path(tempfile.mkdtemp(prefix="soak."))
    spool = Path(args.spool) if args.spool else work / "spool"
    spool.mkdir(parents=True, exist_ok=True)
    rows = _rows(args.rows, args.prompt_len, vocab)
    datapath = work / "dataset"
    ds = Dataset.from_dict({"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows],
                            "seq_len": [len(r) for r in rows]})  # fmt: skip
    ds.set_format("torch")
    ds.save_to_disk(str(datapath))
    args.extra = [*args.extra, "--stall-timeout", "0"]  # online.Serving's own options come from args
    master = watched = None
    if args.mooncake:
        os.environ.setdefault("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")  # the server's and every client's
        master = Master()
        watched = psutil.Process(master.proc.pid)
        mooncake = ("--transfer", "mooncake", "--mooncake-master", master.address,
                    "--mooncake-global-segment-gib", str(args.mooncake_segment_gib))  # fmt: skip
    server = Serving(args, spool, *(mooncake if master else ()))
    served = 0
    samples: list[dict] = []
    done = threading.Event()

    def sample() -> None:
        files, nbytes = _spool(spool)
        samples.append({"t": time.time() - t0, "rows": served, "spool_files": files, "spool_bytes": nbytes,
                        "procs": _tree(psutil.Process(server.proc.pid), watched)})  # fmt: skip
        s = samples[-1]
        procs = s["procs"].items()
        mem = ", ".join(f"{k} {v['rss'] / 2**20:.0f} MiB {v['fds']} fds {v['threads']} thr" for k, v in procs)
        print(f"{s['t']:7.0f} s {s['rows']:8d} rows, spool {files} files: {mem}", file=sys.stderr, flush=True)

    def sampler() -> None:
        while not done.wait(args.every):
            sample()

    try:
        init = (str(datapath), server.port, args.model, args.prompt_len + 1, master and master.address)
        with ProcessPoolExecutor(args.clients, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_client, initargs=init) as pool:  # fmt: skip
            unready = [why for why in pool.map(_ready, range(2 * args.clients)) if why]
            if unready:
                raise SystemExit(f"{len(unready)} of {2 * args.clients} client checks failed, first: {unready[0]}")
            t0 = time.time()
            sample()
            threading.Thread(target=sampler, daemon=True).start()
            block = 64 * args.clients
            while time.time() - t0 < args.minutes * 60:
                start = served % args.rows
                failed = [why for why in pool.map(_fetch, [(start + i) % args.rows for i in range(block)]) if why]
                if failed:
                    raise SystemExit(f"{len(failed)} rows failed, first: {failed[0]}")
                served += block
            done.set()
            time.sleep(2)  # the last files collected
            sample()
    finally:
        said = server.stop()
        if master:
            master.stop()
        print(f"server: {said}", flush=True)

    steady = [s for s in samples if s["t"] >= samples[-1]["t"] / 5]
    names = [k for k in steady[-1]["procs"] if all(k in s["procs"] for s in steady)]
    print(f"{args.model}, {args.rows} distinct rows x {args.prompt_len} tokens, {args.clients} client processes, "
          f"{served} rows in {samples[-1]['t'] / 60:.1f} min ({served / samples[-1]['t']:.1f} rows/s)")  # fmt: skip
    print("| process | RSS first, MiB | RSS last, MiB | growth after the first fifth, bytes/row | fds first→last | "
          "threads first→last |")
    for name in names:
        xs = [s["rows"] for s in steady]
        ys = [s["procs"][name]["rss"] for s in steady]
        first, last = samples[0]["procs"].get(name, steady[0]["procs"][name]), steady[-1]["procs"][name]
        print(f"| {name} | {first['rss'] / 2**20:.0f} | {last['rss'] / 2**20:.0f} | {_slope(xs, ys):.1f} | "
              f"{first['fds']}→{last['fds']} | {first['threads']}→{last['threads']} |")  # fmt: skip
    print(f"spool files at the end: {samples[-1]['spool_files']} ({samples[-1]['spool_bytes']} bytes)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "served": served, "server": said,
                                               "samples": samples}, indent=1))  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
