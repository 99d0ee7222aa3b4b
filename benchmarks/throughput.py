"""Side-by-side throughput: plain vLLM prefill against eagle-extract capture + writes, one engine.

    python benchmarks/throughput.py --model PATH [--dummy] --prompts 128 --prompt-len 1024 --reps 3
        [--storage-dtypes model,fp8] [--sync] [--num-layers N] [--host-memory GIB] [--engine-arg KEY=VALUE ...]

The engine is started once with eagle-extract's settings (eager, no prefix caching, the worker
extension). Each repetition runs (a) plain `generate(max_tokens=1)` with no hooks installed,
then (b) the same prompts with hooks installed and every file written, once per storage dtype
and writer thread count, and with --builtin (d) vLLM's own extract_hidden_states on a second
engine beside the first. a, b and d alternate, so drift (thermal, page cache) hits both.

The writers fsync every file, as an extraction does, so b's clock always holds the disk's writes of the
rows. With --sync it also waits for `os.sync()` (the folder's entries and anything else pending), and every repetition
also measures the disk's own sustained sequential write rate in the same folder (as many files in
parallel as writer threads, fsynced), so the writer's GB/s is reported as a fraction of the disk's.
Prints one table: tokens/s (median, min, max), the b/a ratio (median of per-repetition ratios),
bytes per token, GB/s written, the capture's peak host-memory budget use, the time b's clock spent in
its RPCs, summed over a pass (announcing the rows before each generate call; the drain after each, which
does not wait), the wait for the last writes at the pass's end, and the peak resident memory of the whole
process tree.

b runs as the CLI does: it announces each call's rows, runs the call and takes the writers' report without
waiting, and waits for the writes once, after its last call. b's rate counts that wait; "b before the last
wait" leaves it out. --calls N splits each pass, a's and b's (not d's: refused with --builtin), into N
generate calls, so the rows still being written when a call returns are written during the next: with
many calls, "before the last wait" is the steady state of a long run, whose last wait comes once.

--leave-out write,copy,store adds b variants that stop the capture short, to place its cost by
differences: `write` drops each finished row unwritten; `copy` also keeps each step's states off the
host (no pinned buffer, no device-to-host copy, no FP8 quantisation; token ids and positions are still
copied and assembled); `store` also skips the hooks' adds, so no step buffer is made and every step is
dropped at the stage's end (no positions, no assembly; the hooks still run).  They reach the worker's
capture with collective_rpc callables, so the engine runs with VLLM_ALLOW_INSECURE_SERIALIZATION=1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class PeakRSS:
    """Polls the summed resident memory of this process and all its children."""

    def __init__(self, every: float = 0.1) -> None:
        self.peak, self._stop, self._every = 0, threading.Event(), every
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            total = 0
            for p in [me, *me.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            self._stop.wait(self._every)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def transformers_baseline(args, prompts: list[list[int]], slots: list[int]) -> list[float]:
    """(c) The approach of the original EAGLE scripts: batched transformers forward passes with
    output_hidden_states, keeping the same slots on the host. Forward only, no disk: generous to c."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype, device = getattr(torch, args.dtype), "cuda" if torch.cuda.is_available() else "cpu"
    if args.dummy:  # random weights, as vLLM's load_format=dummy; built on the device directly
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
    model.eval()
    norm_input = {}
    model.model.norm.register_forward_pre_hook(lambda m, a: norm_input.__setitem__("x", a[0]))
    n = model.config.get_text_config().num_hidden_layers
    rates = []
    with torch.no_grad():
        for _ in range(args.reps):
            t = time.perf_counter()
            for start in range(0, len(prompts), args.hf_batch):
                ids = torch.tensor(prompts[start : start + args.hf_batch], device=device)
                out = model(ids, output_hidden_states=True)
                kept = [norm_input["x"] if i == n else out.hidden_states[i] for i in slots]
                torch.stack(kept, dim=2).cpu()
            rates.append(len(prompts) * args.prompt_len / (time.perf_counter() - t))
    del model, out, kept
    if device == "cuda":
        torch.cuda.empty_cache()  # give the memory back before vLLM measures what it may take
    return rates


def builtin_engine(args, slots: list[int], store: Path, extra: dict):
    """(d) vLLM's own `extract_hidden_states` method with `ExampleHiddenStatesConnector` (GPU only):
    the same slots (vLLM's ids count layer outputs, so the final slot is the layer count)."""
    from vllm import LLM

    return LLM(
        model=args.model,
        tensor_parallel_size=args.tp,
        dtype=args.dtype,
        enforce_eager=True,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,  # the connector refuses chunked prefill
        max_model_len=args.prompt_len + 1,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": slots}},
        },
        kv_transfer_config={
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(store)},
        },
        **extra,
    )


def wait_for_files(outputs) -> None:
    """Block until the connector's writer threads have finished every file (its per-file flock)."""
    import fcntl

    for out in outputs:
        path = (out.kv_transfer_params or {}).get("hidden_states_path")
        if path:
            with open(path + ".lock") as lock:
                fcntl.flock(lock, fcntl.LOCK_SH)


def gpu_memory() -> str | None:
    """Used / total memory of each visible GPU while the engines hold theirs (nvidia-smi)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    pairs = (line.split(",") for line in out.splitlines())
    return "; ".join(f"{int(used) / 1024:.1f}/{int(total) / 1024:.1f} GiB" for used, total in pairs)


def disk_write_rate(folder: Path, nbytes: int, streams: int, block: int = 64 << 20) -> float:
    """GB/s of `streams` files written side by side into `folder`, `nbytes` in all, each fsynced; the disk is
    started on each block as it is written (as the row writer does), so it never idles while the page cache fills."""
    from concurrent.futures import ThreadPoolExecutor

    from eagle_extract.files.safetensors_stream import start_writeback

    folder.mkdir(parents=True, exist_ok=True)
    data = os.urandom(block)
    blocks = max(1, nbytes // block // streams)

    def write(k: int) -> None:
        with open(folder / f".disk-probe-{k}", "wb", buffering=0) as f:
            for n in range(blocks):
                left = memoryview(data)
                while left:
                    left = left[f.write(left) :]
                start_writeback(f.fileno(), n * block, block)
            os.fsync(f.fileno())

    os.sync()  # what the last run deleted or wrote is not charged to the probe
    t = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(write, range(streams)))
    os.sync()  # the files' metadata too, as the rows' figures count theirs
    seconds = time.perf_counter() - t
    for k in range(streams):
        (folder / f".disk-probe-{k}").unlink()
    os.sync()
    return blocks * block * streams / seconds / 1e9


STOPPED = {
    "write": "rows dropped unwritten",
    "copy": "no host copy (nor FP8 quantisation), nothing written",
    "store": "no step buffer, adds or assembly (every step dropped), nothing written",
}


def leave_out(worker, stage: str) -> None:
    """(Run on the worker by collective_rpc) stop the installed capture short at `stage` (module docstring)."""
    import torch

    from eagle_extract.worker.hostmem import Held

    if not getattr(worker, "_eagle", None):  # a rank that does not write
        return
    capture, _ = worker._eagle
    capture.on_complete = lambda *row: None  # every variant drops its rows unwritten
    if stage in ("copy", "store"):

        def held_nothing(staging):  # a host step buffer (CPU engine) has its bytes taken already: give them back
            taken = staging.nbytes if staging.device.type == "cpu" else 0
            return Held(capture.budget, taken, torch.empty((staging.shape[0], 0)), None)

        capture._to_held = held_nothing
    if stage == "store":
        capture._store = lambda column, hidden, residual: None


def layer_cut(model: str, layers: int, where: Path) -> str:
    """A copy of `model`'s config.json with its first `layers` layers (dummy weights only); a multimodal
    wrapper's (Kimi-K2.5's) layers are its text_config's."""
    config = json.loads((Path(model) / "config.json").read_text())
    if "text_config" in config:
        config["text_config"] = {**config["text_config"], "num_hidden_layers": layers}
    else:
        config["num_hidden_layers"] = layers
    folder = where / f"{Path(model).name}-{layers}l"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def stats(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dummy", action="store_true", help="random weights from config.json (load_format=dummy)")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", default=None)
    ap.add_argument("--out", type=Path, default=Path("/tmp/eagle-bench"))
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument(
        "--transformers",
        action="store_true",
        help="also time (c): transformers output_hidden_states on the same prompts, before vLLM starts",
    )
    ap.add_argument(
        "--builtin",
        action="store_true",
        help="also time (d): vLLM's extract_hidden_states + ExampleHiddenStatesConnector, a second engine (GPU)",
    )
    ap.add_argument("--hf-batch", type=int, default=8, help="batch size of the transformers baseline")
    ap.add_argument(
        "--writer-threads",
        default="0",
        help="comma-separated writer thread counts, 0 for eagle-extract's default: b runs once per count in every "
        "repetition (the first is reported as b)",
    )
    ap.add_argument("--storage-dtypes", default="model", help="comma-separated: model, fp8; b runs once per each")
    ap.add_argument("--sync", action="store_true", help="b's clock includes os.sync(); the disk is measured too")
    ap.add_argument("--num-layers", type=int, default=None, help="cut the model to its first N layers (--dummy)")
    ap.add_argument("--host-memory", type=float, default=None, help="the capture's host-memory budget, GiB")
    ap.add_argument(
        "--calls", type=int, default=1, help="split each pass into this many generate calls (the CLI's pattern)"
    )
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE", help="as the CLI's, repeatable")
    ap.add_argument(
        "--leave-out",
        default="",
        help="comma-separated stages (write, copy, store): b also runs stopped short at each (module docstring)",
    )
    args = ap.parse_args()
    stops = [x for x in args.leave_out.split(",") if x]
    if set(stops) - set(STOPPED):
        ap.error(f"--leave-out takes write, copy and store, not {args.leave_out!r}")
    if not 1 <= args.calls <= args.prompts:
        ap.error(f"--calls {args.calls}: give from 1 to --prompts ({args.prompts}) generate calls a pass")
    if args.calls > 1 and args.builtin:
        ap.error("--calls with --builtin: d runs one generate call a pass; leave one of them out")
    if stops:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the callables above travel to the worker
    if args.num_layers:
        args.model = layer_cut(args.model, args.num_layers, args.out.parent)

    import torch
    from transformers import AutoConfig
    from vllm import SamplingParams, TokensPrompt

    from eagle_extract.config import ExtractConfig
    from eagle_extract.faces.cli import parse_engine_args
    from eagle_extract.files.writer import default_writer_threads
    from eagle_extract.job.engine import start_engine
    from eagle_extract.layers import parse_layer_ids
    from eagle_extract.worker.capture_spec import CaptureSpec, host_bytes_per_rank

    text = AutoConfig.from_pretrained(args.model).get_text_config()
    aux = parse_layer_ids(args.layers, text.num_hidden_layers)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(100, text.vocab_size - 100, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)
    ]
    tokens = args.prompts * args.prompt_len
    hf = transformers_baseline(args, prompts, aux + [text.num_hidden_layers]) if args.transformers else []
    extra = {"skip_tokenizer_init": True, **parse_engine_args(tuple(args.engine_arg))}
    if args.dummy:
        extra["load_format"] = "dummy"
    if args.builtin:  # two engines side by side on the same GPUs
        extra["gpu_memory_utilization"] = 0.42
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        cfg = ExtractConfig(model=args.model, tp=args.tp, dtype=args.dtype, engine_args=extra)
        llm = start_engine(cfg, max_model_len=args.prompt_len + 1)
        start_s = time.perf_counter() - t0
        params = SamplingParams(max_tokens=1, detokenize=False)
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        n = len(batch)
        calls = [range(k * n // args.calls, (k + 1) * n // args.calls) for k in range(args.calls)]  # sizes within 1
        llm.generate(batch[:8], params, use_tqdm=False)  # warm-up
        store = args.out.with_name(args.out.name + "-builtin")
        builtin = builtin_engine(args, aux + [text.num_hidden_layers], store, extra) if args.builtin else None
        if builtin:
            builtin.generate(batch[:8], params, use_tqdm=False)
        threads = [int(x) for x in args.writer_threads.split(",")]
        # every b variant: storage dtype, writer threads, the stage it stops short at ("" for none)
        runs = [(d, n, "") for d in args.storage_dtypes.split(",") for n in threads]
        runs += [(d, threads[0], stop) for d in args.storage_dtypes.split(",") for stop in stops]
        by_run: dict[tuple[str, int, str], list[float]] = {r: [] for r in runs}
        # seconds a pass: announcing, the drains that do not wait, the last wait
        rpc_s: dict[tuple[str, int, str], list[tuple[float, float, float]]] = {r: [] for r in runs}
        steady: dict[tuple[str, int, str], list[float]] = {r: [] for r in runs}  # tokens/s before the last wait
        written: dict[tuple[str, int, str], int] = {}
        host_peak: dict[tuple[str, int, str], int] = {}
        plain, vllm_own, vllm_written, disk = [], [], [], []
        budget = host_bytes_per_rank(args.host_memory, 1)
        for rep in range(args.reps):
            t = time.perf_counter()
            for call in calls:
                llm.generate(batch[call.start : call.stop], params, use_tqdm=False)
            plain.append(tokens / (time.perf_counter() - t))

            for storage, n, stop in runs:
                shutil.rmtree(args.out, ignore_errors=True)
                os.sync()  # the last run's deletions and writes are not charged to this one
                spec = CaptureSpec(str(args.out), tuple(aux), budget, fp8=storage == "fp8", writer_threads=n or None)
                llm.collective_rpc("eagle_install", args=(spec.as_rpc(),))
                if stop:
                    llm.collective_rpc(leave_out, args=(stop,))
                t = time.perf_counter()
                expect_s = drain_s = 0.0
                reports = []
                for call in calls:  # as the CLI: announce, generate, take the report without waiting
                    t_expect = time.perf_counter()
                    llm.collective_rpc("eagle_expect", args=([(i, prompts[i]) for i in call],))
                    t_generate = time.perf_counter()
                    llm.generate(batch[call.start : call.stop], params, use_tqdm=False)
                    t_drain = time.perf_counter()
                    reports += [r for r in llm.collective_rpc("eagle_drain", args=(False,)) if r][:1]  # first writer
                    expect_s += t_generate - t_expect
                    drain_s += time.perf_counter() - t_drain
                t_wait = time.perf_counter()
                reports += [r for r in llm.collective_rpc("eagle_drain", args=(True,)) if r][:1]  # every write done
                if args.sync:
                    os.sync()
                by_run[storage, n, stop].append(tokens / (time.perf_counter() - t))
                steady[storage, n, stop].append(tokens / (t_wait - t))
                rpc_s[storage, n, stop].append((expect_s, drain_s, time.perf_counter() - t_wait))
                llm.collective_rpc("eagle_remove")
                errors = [e for r in reports for e in r["errors"]]
                assert not errors and sum(len(r["written"]) for r in reports) == (0 if stop else args.prompts), errors
                written[storage, n, stop] = sum(f.stat().st_size for f in (args.out / "hidden_states").iterdir())
                peak = max(host_peak.get((storage, n, stop), 0), reports[-1]["stats"]["host_peak_bytes"])
                host_peak[storage, n, stop] = peak
            if args.sync:
                shutil.rmtree(args.out, ignore_errors=True)
                disk.append(disk_write_rate(args.out, written[runs[0]], threads[0] or default_writer_threads()))
            if builtin:
                shutil.rmtree(store, ignore_errors=True)
                store.mkdir(parents=True)
                t = time.perf_counter()
                wait_for_files(builtin.generate(batch, params, use_tqdm=False))
                vllm_own.append(tokens / (time.perf_counter() - t))
                vllm_written.append(sum(f.stat().st_size for f in store.glob("*.safetensors")))
        held = gpu_memory()
    shutil.rmtree(args.out, ignore_errors=True)
    capture = by_run[runs[0]]
    ratios = [b / a for a, b in zip(plain, capture)]
    figures_hf = (
        {"transformers_tok_s": hf, "b_over_c": statistics.median(capture) / statistics.median(hf)} if hf else {}
    )
    if vllm_own:
        figures_hf.update(
            vllm_builtin_tok_s=vllm_own,
            b_over_d=statistics.median(capture) / statistics.median(vllm_own),
            builtin_bytes_per_token=vllm_written[-1] / tokens,
        )

    def label(r):
        return f"{r[0]}, {r[1] or default_writer_threads()} writer threads" + (f", {STOPPED[r[2]]}" if r[2] else "")

    def gbps(r):
        return statistics.median(by_run[r]) * written[r] / tokens / 1e9

    per_token = written[runs[0]] / tokens
    figures = {
        "model": args.model,
        "dummy": args.dummy,
        "tp": args.tp,
        "dtype": args.dtype,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "reps": args.reps,
        "calls": len(calls),
        "sync": args.sync,
        "slots": aux + [text.num_hidden_layers],
        "engine_start_s": round(start_s, 1),
        "plain_tok_s": plain,
        "extract_tok_s": capture,
        "ratios": ratios,
        "writer_threads": threads[0] or default_writer_threads(),
        "runs": {
            label(r): {
                "tok_s": v,
                "ratios": [b / a for a, b in zip(plain, v)],
                "bytes_per_token": written[r] / tokens,
                "write_GBps": None if r[2] else gbps(r),
                "of_disk": gbps(r) / statistics.median(disk) if disk and not r[2] else None,
                "host_peak_GiB": host_peak[r] / 2**30,
                "before_last_wait_tok_s": steady[r],
                "before_last_wait_ratios": [b / a for a, b in zip(plain, steady[r])],
                "expect_rpc_s": [e for e, _, _ in rpc_s[r]],  # summed over the pass's calls
                "drain_rpc_s": [d for _, d, _ in rpc_s[r]],
                "last_wait_s": [w for _, _, w in rpc_s[r]],
            }
            for r, v in by_run.items()
        },
        "disk_GBps": disk,
        "bytes_per_token": per_token,
        "write_GBps": gbps(runs[0]),
        "host_budget_GiB": budget / 2**30 if budget else None,
        "peak_rss_GiB": mem.peak / 2**30,
        "gpu_memory": held,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        **figures_hf,
    }
    print(
        f"\n{len(calls)} generate call(s) a pass\n| run | tokens/s median (min-max) | b/a | b/a before the last wait "
        "| GB/s written | of the disk's | peak host budget use | expect, drain RPC ms a pass | last wait ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| a: plain generate(max_tokens=1) | {stats(plain)} | 1 | | | | | | |")
    for r, v in by_run.items():
        each = [b / a for a, b in zip(plain, v)]
        ratio = f"{statistics.median(each):.3f} ({', '.join(f'{x:.3f}' for x in each)})"
        share = f"{gbps(r) / statistics.median(disk):.2f}" if disk and not r[2] else "-"
        rate = "-" if r[2] else f"{gbps(r):.2f}"
        expect_ms, drain_ms, wait_ms = (statistics.median(x) * 1e3 for x in zip(*rpc_s[r]))
        before = statistics.median(b / a for a, b in zip(plain, steady[r]))
        print(
            f"| b: eagle-extract, {label(r)}{', synced' if args.sync else ''} | {stats(v)} | {ratio} | {before:.3f} | "
            f"{rate} | {share} | {host_peak[r] / 2**30:.2f} GiB | {expect_ms:.1f}, {drain_ms:.1f} | {wait_ms:.1f} |"
        )
    if disk:
        spread = f"{statistics.median(disk):.2f} ({min(disk):.2f}-{max(disk):.2f})"
        print(f"| disk: {threads[0] or default_writer_threads()} files side by side, fsynced | GB/s {spread} |")
    if hf:
        print(f"| c: transformers output_hidden_states, batch {args.hf_batch}, no disk | {stats(hf)} |")
        print(f"b/c {figures_hf['b_over_c']:.2f}")
    if vllm_own:
        print(f"| d: vLLM extract_hidden_states + ExampleHiddenStatesConnector, files written | {stats(vllm_own)} |")
        print(f"b/d {figures_hf['b_over_d']:.3f}; d wrote {figures_hf['builtin_bytes_per_token']:,.0f} B/token")
    print(
        f"b/a median {statistics.median(ratios):.3f} (per-rep {', '.join(f'{r:.3f}' for r in ratios)}); "
        f"{per_token:,.0f} B/token; peak RSS of process tree {figures['peak_rss_GiB']:.1f} GiB; "
        f"engine start {start_s:.0f} s"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
