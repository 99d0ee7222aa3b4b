"""Rows per second served to speculators' own online client against offline extraction of the same rows.

    python benchmarks/online.py --model PATH [--dummy] --rows 512 --prompt-len 1024 --spool /dev/shm --spool /tmp
    (--model smollm2: the bundled SmolLM2; a --dummy model folder needs config.json and a tokenizer)
    [--mooncake] [--no-offline] [--replicas 1 2] [--fp8]

For each spool folder: offline, `eagle-extract` writes the rows into that folder (`--reps` runs, the engine
start not counted: the manifest's extract_s); online, one `eagle-extract serve` with its spool there, and
`--clients` processes (speculators' loader runs 12 worker processes a rank, each with its own client)
pulling every row through speculators' ArrowDataset and hs-connectors' FileTransfer (request, answer, load,
check, delete), `--reps` passes.  With --mooncake, then the same through `serve --transfer mooncake`: a
`mooncake_master` on loopback TCP, each client reading with speculators' own mooncake backend (hs-connectors'
MooncakeTransfer); the spool then only holds each row until it is put.  Rows are random token ids of
--prompt-len (a fixed seed), the same for all.  --replicas 1 2: the file-spool server with each number of
replicas (`serve --replicas`, on Ray Serve past 1), one after the other in the same run.  --clients 96 48: each
count's processes in turn against each server (one offline, one server start for all).  Prints a table,
then where a row's time went in each pass of the first server (its /metrics: the engine's seconds in steps, in
looks at its workers and starved of requests, a row's seconds in the server; each client's own clock: a row's
seconds there); --json saves it all.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shlex
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
    extra += ["--storage-dtype", "fp8"] if args.fp8 else []
    return ["--model", args.model, "--dtype", args.dtype, *extra, *args.extra]


def offline(args, data: Path, folder: Path) -> float:
    """Rows per second of one extraction into `folder` (engine start not counted)."""
    out = Path(tempfile.mkdtemp(prefix="offline.", dir=folder))
    try:
        cmd = [sys.executable, "-m", "eagle_extract", *_model_args(args), "--data", str(data), "--data-format",
               "tokens", "--output", str(out), "--overwrite", "--no-disk-check",
               "--seq-length", str(args.prompt_len)]  # whole rows: the CLI's default cuts them at 2,048  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        manifest = json.loads((out / "eagle_extract.json").read_text())
        if manifest["truncated"] or manifest["num_samples"] != args.rows:
            raise SystemExit(f"offline wrote {manifest['num_samples']} of {args.rows} rows ({manifest['skipped']} "
                             f"skipped), {manifest['truncated']} cut short")  # fmt: skip
        return manifest["num_samples"] / manifest["timing"]["extract_s"]
    finally:
        shutil.rmtree(out, ignore_errors=True)


class Serving:
    def __init__(self, args, folder: Path, *extra: str) -> None:
        self.port = _free_port()
        cmd = [sys.executable, "-m", "eagle_extract", "serve", *_model_args(args), "--port", str(self.port),
               "--spool", str(folder), *extra]  # fmt: skip
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


class Master:
    """A `mooncake_master` on loopback (its package's own binary, however Mooncake was installed)."""

    def __init__(self) -> None:
        port = _free_port()
        self.address = f"127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "mooncake.cli", f"--rpc_port={port}", "--rpc_address=127.0.0.1",
               f"--metrics_port={_free_port()}", "--enable_metric_reporting=false"]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise SystemExit("mooncake_master did not start")
                time.sleep(0.1)
        raise SystemExit("mooncake_master did not listen within 30 s")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


_DATASET = None  # each client process's own ArrowDataset, as each of speculators' data-loader workers has


def _transfer(datapath: str, master: str | None, fp8: bool):
    """The file reader (FP8 files dequantised, as `--hidden-states-backend fp8` reads them), or the mooncake one as
    `speculators train --hidden-states-backend mooncake` builds it."""
    if master is None:
        from hs_connectors.transfer import FileTransfer, FP8Transfer

        return (FP8Transfer if fp8 else FileTransfer)(Path(datapath) / "hs")
    from hs_connectors.transfer import MooncakeBackend

    args = argparse.Namespace(mooncake_master=master, mooncake_metadata_server="P2PHANDSHAKE", mooncake_protocol="tcp",
                              mooncake_device="", mooncake_global_segment_gib=CLIENT_SEGMENT_GIB,
                              mooncake_local_buffer_gib=CLIENT_SEGMENT_GIB)  # fmt: skip
    return MooncakeBackend.from_train_args(args, datapath)


CLIENT_SEGMENT_GIB = 1.0  # each client's own segment (speculators mounts one per data-loader worker)


_SETUP_ERROR = None  # why this client process could not build its dataset (a pool's initializer that raises
# breaks the whole pool, and its traceback goes only to the process's stderr)


def _client(datapath: str, port: int, model: str, max_len: int, master: str | None, fp8: bool) -> None:
    global _DATASET, _SETUP_ERROR
    try:
        from speculators.train.data import ArrowDataset

        _DATASET = ArrowDataset(max_len=max_len, datapath=datapath, transfer=_transfer(datapath, master, fp8),
                                vllm_endpoint=f"http://127.0.0.1:{port}/v1", model=model, on_missing="generate",
                                train_ratio=1.0, split="train", request_timeout=600, max_retries=1)  # fmt: skip
    except BaseException as exc:  # noqa: BLE001 - reported by _ready, in the driver's output
        _SETUP_ERROR = f"{type(exc).__name__}: {exc}"


def _fetch(index: int) -> tuple[str | None, float]:
    """One row through speculators' client (request, answer, load, check, delete): None when it came, else
    why not; and the seconds it took in this client."""
    t0 = time.perf_counter()
    item = _DATASET[index]
    return (None if isinstance(item, dict) else str(item)), time.perf_counter() - t0


def _scrape(port: int) -> dict[str, float]:
    """The server's own counters (`GET /metrics`), eagle_extract_* samples by name."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return {name: float(value) for name, _, value in (line.rpartition(" ") for line in text.splitlines())
            if name.startswith("eagle_extract_") and "{" not in name}  # fmt: skip


def _ready(_) -> str | None:
    """None once this client is set up, else why not."""
    time.sleep(0.5)  # long enough that every process of the pool takes one
    return None if _DATASET is not None else (_SETUP_ERROR or "not set up")


def online(pool, rows: int, port: int | None) -> dict:
    """One pass of the client processes over every row: its rows per second, and where a row's time went (the
    server's counters from `port`; None with replicas, whose /metrics each answer for one replica alone)."""
    before = _scrape(port) if port else {}
    t0 = time.perf_counter()
    done = list(pool.map(_fetch, range(rows)))
    seconds = time.perf_counter() - t0
    failed = [why for why, _ in done if why]
    if failed:
        raise SystemExit(f"{len(failed)} rows failed, first: {failed[0]}")
    client = sorted(s for _, s in done)
    took = {"rows_s": rows / seconds, "seconds": seconds, "client_row_s_median": client[len(client) // 2],
            "client_row_s_p90": client[int(len(client) * 0.9)]}  # fmt: skip
    if not port:
        return took
    delta = {k: v - before.get(k, 0.0) for k, v in _scrape(port).items()}
    served = delta["eagle_extract_row_seconds_count"]
    return {
        **took,
        "server_row_s_mean": delta["eagle_extract_row_seconds_sum"] / served if served else None,
        "engine_step_s": delta["eagle_extract_engine_step_seconds_total"],
        "engine_wait_s": delta["eagle_extract_engine_wait_seconds_total"],
        "engine_wait_worker_s": delta["eagle_extract_engine_wait_worker_seconds_total"],
        "engine_starved_s": delta["eagle_extract_engine_starved_seconds_total"],
        "engine_steps": delta["eagle_extract_engine_steps_total"],
    }


def serve_pass(
    args, datapath: Path, spool: Path, master: str | None = None, replicas: int = 1
) -> tuple[dict[int, list[dict]], str]:
    """One server (the file transfer, or the mooncake one through `master`) and, for each `--clients` count in
    turn, that many client processes' `--reps` passes over every row: each count's passes' figures (`online`), and
    the server's last line (its whole run, every count's)."""
    extra = () if master is None else ("--transfer", "mooncake", "--mooncake-master", master,
                                       "--mooncake-global-segment-gib", str(args.mooncake_segment_gib))  # fmt: skip
    extra += ("--replicas", str(replicas)) if replicas > 1 else ()
    server = Serving(args, spool, *extra)
    kind = ("mooncake" if master else "file") + (f", {replicas} replicas" if replicas > 1 else "")
    on = {}
    try:
        init = (str(datapath), server.port, args.model, args.prompt_len + 1, master, args.fp8)
        for clients in args.clients:
            with ProcessPoolExecutor(clients, mp_context=multiprocessing.get_context("spawn"),
                                     initializer=_client, initargs=init) as pool:  # fmt: skip
                unready = [why for why in pool.map(_ready, range(2 * clients)) if why]  # before the clock
                if unready:
                    raise SystemExit(f"{len(unready)} of {2 * clients} client checks failed, first: {unready[0]}")
                port = server.port if replicas == 1 else None
                on[clients] = [online(pool, args.rows, port) for _ in range(args.reps)]
            print(f"{spool}, {kind} server, {clients} clients, passes: {json.dumps(on[clients])}", flush=True)
    finally:
        said = server.stop()
    print(f"server ({kind}): {said}", flush=True)
    return on, said


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dummy", action="store_true", help="random weights (load_format=dummy)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--clients",
        type=int,
        nargs="+",
        default=[12],
        help="client processes (speculators' --num-workers); several counts take turns on one server",
    )
    ap.add_argument("--spool", action="append", required=True, help="folder for both modes' files (repeatable)")
    ap.add_argument("--fp8", action="store_true", help="FP8 storage (--storage-dtype fp8) in both modes")
    ap.add_argument(
        "--extra", type=shlex.split, action="extend", default=[], help="more eagle-extract options: --extra='--tp 2'"
    )
    ap.add_argument("--mooncake", action="store_true", help="also serve through --transfer mooncake (loopback TCP)")
    ap.add_argument("--mooncake-segment-gib", type=float, default=16.0, help="the server's Mooncake segment")
    ap.add_argument("--no-offline", action="store_true", help="online passes only")
    ap.add_argument("--replicas", type=int, nargs="+", default=[1], help="serve with each number of replicas")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    for name, counts in (("--clients", args.clients), ("--replicas", args.replicas)):
        if len(set(counts)) < len(counts):
            ap.error(f"{name} {' '.join(map(str, counts))}: give each count once")
    config_file = Path(args.model) / "config.json"  # the shape a dummy run was cut to, kept beside its figures
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    config = config.get("text_config", config)
    shape = {k: config[k] for k in ("hidden_size", "num_hidden_layers", "n_routed_experts") if k in config}
    if args.fp8 and args.mooncake:
        ap.error("--fp8 with --mooncake: serve refuses FP8 rows over Mooncake")
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
    if args.mooncake:
        os.environ.setdefault("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")  # the server's and every client's
    results = []
    for spool in map(Path, args.spool):
        spool.mkdir(parents=True, exist_ok=True)
        off = [] if args.no_offline else [offline(args, data, spool) for _ in range(args.reps)]
        file_passes, said = serve_pass(args, datapath, spool, replicas=args.replicas[0])
        more = {k: serve_pass(args, datapath, spool, replicas=k) for k in args.replicas[1:]}
        if args.mooncake:
            master = Master()
            try:
                mooncake = serve_pass(args, datapath, spool, master.address)
            finally:
                master.stop()
        for clients, passes in file_passes.items():
            on = [p["rows_s"] for p in passes]
            row = {"spool": str(spool), "clients": clients, "offline_rows_s": off, "online_rows_s": on,
                   "online_passes": passes, "server": said, "server_clients": args.clients,
                   "ratio": statistics.median(on) / statistics.median(off) if off else None}  # fmt: skip
            for k, (by_clients, replicas_said) in more.items():
                row[f"server_replicas_{k}"] = replicas_said
                row[f"online_rows_s_replicas_{k}"] = [p["rows_s"] for p in by_clients[clients]]
            if args.mooncake:
                row["mooncake_passes"], row["mooncake_server"] = mooncake[0][clients], mooncake[1]
                row["mooncake_rows_s"] = [p["rows_s"] for p in row["mooncake_passes"]]
                row["mooncake_vs_file"] = statistics.median(row["mooncake_rows_s"]) / statistics.median(on)
            results.append(row)
            print(f"{spool}, {clients} clients: {json.dumps(row)}", flush=True)
    print(f"{args.model}, {args.rows} rows x {args.prompt_len} tokens")
    if len(args.replicas) > 1:
        print("| spool | clients | " + " | ".join(f"online rows/s, {k} replicas" for k in args.replicas) + " |")
        for r in results:
            each = [r["online_rows_s"]] + [r[f"online_rows_s_replicas_{k}"] for k in args.replicas[1:]]
            print(
                f"| {r['spool']} | {r['clients']} | " + " | ".join(f"{statistics.median(x):.1f}" for x in each) + " |"
            )
    print(
        "| spool | clients | offline rows/s | online rows/s (file) | online/offline | mooncake rows/s | mooncake/file |"
    )
    for r in results:
        off = f"{statistics.median(r['offline_rows_s']):.1f}" if r["offline_rows_s"] else "-"
        ratio = f"{r['ratio']:.3f}" if r["ratio"] else "-"
        mc = "- | -"
        if args.mooncake:
            mc = f"{statistics.median(r['mooncake_rows_s']):.1f} | {r['mooncake_vs_file']:.3f}"
        print(
            f"| {r['spool']} | {r['clients']} | {off} | {statistics.median(r['online_rows_s']):.1f} | {ratio} | {mc} |"
        )
    print(
        "| spool | clients | pass | rows/s | engine busy / waiting for workers / of it in the workers / starved (s) "
        "| row in server, mean (s) "
        "| row in client, median / p90 (s) |"
    )
    for r in results:
        for i, p in enumerate(r["online_passes"]):
            keys = ("engine_step_s", "engine_wait_s", "engine_wait_worker_s", "engine_starved_s")
            eng = " / ".join("-" if p.get(k) is None else f"{p[k]:.2f}" for k in keys)
            srv = "-" if p.get("server_row_s_mean") is None else f"{p['server_row_s_mean']:.3f}"
            print(
                f"| {r['spool']} | {r['clients']} | {i + 1} | {p['rows_s']:.1f} | {eng} of {p['seconds']:.2f} | {srv} "
                f"| {p['client_row_s_median']:.3f} / {p['client_row_s_p90']:.3f} |"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "model_shape": shape, "results": results}, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
