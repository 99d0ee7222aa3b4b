"""One extraction run, top to bottom, and its capture loop.

Plan, prepare the output, start the engine, stream the rows through the capture loop, complete the
output (or this shard of it).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from . import output as out
from . import preflight, regenerate, shards
from .config import ExtractConfig
from .engine import start_engine
from .errors import ExtractError, engine_errors
from .hostmem import default_budget
from .plan import Plan, make_plan, plan_samples
from .runlog import RunLog, progress
from .stages import PartJoiner, check_layout
from .watch import HEARTBEAT_S, EngineWatch
from .writer import completed_rows


def run(cfg: ExtractConfig, log=print) -> dict:
    """Run a whole extraction (or one shard of it); `cfg` must be resolved().  Returns the manifest
    when the output is complete, else this shard's summary (with "complete": False)."""
    plan = make_plan(cfg)
    output = Path(cfg.output)
    rows = None if cfg.regenerate else _sized(plan, *plan_samples(plan))  # before anything is created
    with out.claimed(output, plan.shard):
        manifest = out.identical_complete(output, plan.identity, cfg.overwrite)
        if manifest:
            log(out.already_complete(output))
            return manifest
        target = out.writing_folder(output, plan.identity, cfg.overwrite)
        staged = replace(cfg, output=target, overwrite=cfg.overwrite and target == output)
        if not staged.overwrite:  # before the engine's log starts
            out.refuse_other_runs(target, plan.identity, plan.shard)
        log_path = output / out.log_name(plan.shard)
        watch = EngineWatch(cfg.stall_timeout or None, log_path)
        try:
            with RunLog(log_path, log) as run_log:
                watch.note = run_log.note
                result = _extract(replace(plan, cfg=staged), rows, run_log, watch)
        except ExtractError as exc:  # the same error (a DataError stays a ValueError), pointing at the log
            exc.args = (f"{exc} (the run's log: {log_path})",)
            raise
        finally:  # the engine has shut down (RunLog's exit let it go): nothing of it may hold GPUs now
            watch.reap()
        return out.replace_complete(target, output) if target != output else result


def _sized(plan: Plan, samples: list, report) -> tuple:
    """The rows, this job's share of them, and the disk check: rows a resumable run already wrote need no room."""
    cfg = plan.cfg
    mine = {i for i, s in enumerate(samples) if shards.owns(plan.shard, s.row)}
    already = set() if cfg.overwrite else completed_rows(Path(cfg.output), cfg.legacy)
    todo_tokens = sum(len(samples[i].input_ids) for i in mine - already)
    expected_bytes, free = preflight.check_disk(cfg, todo_tokens, plan.bytes_per_token())
    return samples, report, mine, todo_tokens, expected_bytes, free


def _extract(plan: Plan, rows: tuple | None, run_log: RunLog, watch: EngineWatch) -> dict:
    """The run itself, into `plan.cfg.output` (claimed); `rows` from _sized, None when --regenerate makes them."""
    try:
        return _extract_rows(plan, rows, run_log, watch)
    except BaseException:
        out.abandon_if_empty(Path(plan.cfg.output), plan.shard)
        raise


def _extract_rows(plan: Plan, rows: tuple | None, run_log: RunLog, watch: EngineWatch) -> dict:
    cfg, output, log = plan.cfg, Path(plan.cfg.output), run_log.say
    llm, start_s, regenerated = None, 0.0, None
    changed = None if cfg.overwrite else out.other_releases(output, plan.identity, plan.shard)
    if changed:
        log(f"warning: {changed}")
    try:
        if rows is None:
            out.prepare_output(output, plan.identity, cfg.overwrite)
            with engine_errors():
                t0 = time.perf_counter()
                watch.expect_engine()
                llm = start_engine(cfg, cfg.seq_length + 1)
                start_s = _watched(llm, watch, t0)
                usable = [r for r, _, _ in plan.triples if r is not None][: cfg.max_samples]
                records, regenerated = regenerate.answers(llm, cfg, plan.tokenizer, usable, log, watch.beat)
            watch.pause()  # tokenizing the answers is the driver's own work
            bad = [(None, n, why) for r, n, why in plan.triples if r is None]
            triples = sorted([(r, r.row, None) for r in records] + bad, key=lambda t: t[1])
            rows = _sized(plan, *plan_samples(plan, triples))
        samples, report, mine, todo_tokens, expected_bytes, free = rows
        fresh = cfg.overwrite and not cfg.regenerate  # a regenerating run prepared (and cleared) the folder already
        done = out.prepare_output(output, plan.identity, fresh, plan.shard, mine)
        if done:
            log(f"checking the {len(done)} row files an interrupted run wrote")
        damaged = out.drop_damaged(
            output, {i: len(samples[i].input_ids) for i in done}, plan.slot_ids, plan.shape.hidden_size, cfg.legacy
        )
        done -= damaged
        todo = [(i, samples[i]) for i in sorted(mine - done)]
        part = f" (shard {cfg.shard}: {len(mine)} of them)" if plan.shard else ""
        resumed = f"; resuming, {len(done)} rows already written" if done else ""
        resumed += f" ({len(damaged)} damaged files are written again)" if damaged else ""
        log(
            f"{len(samples)} samples, {sum(len(s.input_ids) for s in samples)} tokens{part}; slots for layers "
            f"{plan.slot_ids}; about {expected_bytes / 2**20:.1f} MiB of hidden states to write "
            f"({free / 2**30:.1f} GiB free){resumed}"
        )
        with engine_errors():
            if llm is None:
                t0 = time.perf_counter()
                watch.expect_engine()
                llm = start_engine(cfg, max(len(s.input_ids) for s in samples) + 1)  # room for the sampled token
                start_s = _watched(llm, watch, t0)
            written, stats, extract_s = _capture(llm, plan, len(samples), todo, done, run_log.note, watch.beat)
    finally:
        watch.stop.set()  # before the engine goes: its processes end now
        llm = None  # the engine stops now, into the run's log (frames vLLM's imports keep alive would hold it)
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
        "redone_rows": len(damaged),
        "capture": stats,
    }
    if plan.shard is None:
        manifest = out.complete(plan, samples, report, [this_run], regenerated)
        out.finish_run(output, None)
        return manifest
    summary = {"shard": cfg.shard, "identity": plan.identity, "config": cfg.record(), **this_run}
    return out.complete_shard(plan, samples, report, summary, log)


def _watched(llm, watch: EngineWatch, t0: float) -> float:
    """Start watching the engine started at `t0`; returns the seconds it took to start.  (Not the frame
    that starts it: a traceback vLLM keeps from its start holds that frame, and with it its locals.)"""
    every = min(HEARTBEAT_S, (watch.stall_s or HEARTBEAT_S) / 4)  # several touches within any stall limit
    llm.collective_rpc("eagle_heartbeat", args=(str(watch.heartbeat), every))
    watch.start()
    return time.perf_counter() - t0


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
        "stats": reports[0]["stats"] if reports else {},
        # every pipeline stage settles every row: the stage that lost most tells
        "matching": [max((r["stats"].get(k, 0) for r in reports), default=0) for k in MATCH_COUNTS],
        "first_unmatched": min(
            (f for r in reports if (f := r["stats"].get("first_unmatched_row")) is not None), default=None
        ),
    }


MATCH_COUNTS = ("settled_rows", "unmatched_rows", "unmatched_tokens", "dropped_steps")
MATCH_WINDOW = 64  # rows: the run stops once half the rows settled last (at least 8 of them) went unmatched


def stopped_matching(history: list[tuple[int, int]]) -> tuple[int, int] | None:
    """(unmatched, settled) over the last MATCH_WINDOW or more settled rows when at least half of them,
    and at least 8, found no states; `history` holds the (settled, unmatched) totals after each batch."""
    settled, unmatched = history[-1]
    base = next((h for h in reversed(history) if settled - h[0] >= MATCH_WINDOW), (0, 0))
    rows, lost = settled - base[0], unmatched - base[1]
    return (lost, rows) if lost >= 8 and 2 * lost >= rows else None


def _check_matching(history: list[tuple[int, int]], first: int | None) -> None:
    lost = stopped_matching(history)
    if lost:
        raise ExtractError(
            f"rows stopped matching the captured states: {lost[0]} of the last {lost[1]} rows the engine ran got "
            f"none (first: row {first}), so the engine ran other tokens than the prompts or the hooks sit on "
            "layers the prompts do not run: with --decoder-path, name the text decoder's layers; without it, "
            "report this with the run's log; every completed row is kept"
        )


def _capture(llm, plan: Plan, total: int, todo: list, done: set[int], note, beat) -> tuple[set[int], dict, float]:
    """Stream the rows still to do through the engine; returns (rows written, capture stats, seconds).
    `note` puts each batch's counts in the run's log; `beat` tells the engine watch the run moves."""
    from vllm import SamplingParams, TokensPrompt

    cfg = plan.cfg
    # --host-memory is this job's on this machine: its pipeline stages' writing ranks share it
    host_memory = (int(cfg.host_memory * 2**30) if cfg.host_memory else default_budget()) // cfg.pp
    args = (str(cfg.output), plan.aux_ids, cfg.decoder_path, cfg.fp8, cfg.legacy, cfg.writer_threads, host_memory)
    installed = llm.collective_rpc("eagle_install", args=args)
    writers = [w for w in installed if w["writes"]]  # in rank order, as eagle_drain reports them
    try:
        check_layout(writers, plan.shape.num_layers, len(plan.slot_ids))
    except ValueError as exc:
        raise ExtractError(f"{exc}; report this as a bug with the model class {installed[0]['model_class']}") from None
    kept = out.kept_dtype(Path(cfg.output), min(done)) if done and not (cfg.fp8 or cfg.legacy) else None
    if kept and kept != writers[0]["dtype"]:
        raise ExtractError(
            f"the engine runs in {writers[0]['dtype']}, but the {len(done)} rows already written are {kept}; "
            f"resume where the engine runs in {kept} (--dtype auto can choose otherwise on another GPU or vLLM), "
            "or pass --overwrite to start over"
        )
    joiner = None
    if any(w["part"] for w in writers):  # pipeline stages: join their part files into rows
        masks = {i: s.loss_mask for i, s in todo} if cfg.legacy else None
        joiner = PartJoiner(Path(cfg.output), writers, cfg.fp8, masks)

    def record(report: dict, last: bool = False) -> None:
        if joiner is None:
            written.update(i for rows in report["written_by"] for i in rows)
            return
        try:
            joiner.add(report["written_by"])
            written.update(joiner.finish() if last else joiner.joined_so_far())
        except Exception as exc:  # a full disk, or stages that disagree: one line, like the writers'
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ExtractError(f"joining the pipeline stages' files: {why}") from None

    params = SamplingParams(max_tokens=1, temperature=0.0)
    written = set(done)
    beat()
    history = [(0, 0)]  # (settled, unmatched) rows after each batch
    t1 = time.perf_counter()
    with progress(total, "extract", "row", initial=len(done)) as bar:
        done_tokens, handed = 0, len(done)
        for batch in _batches(todo, cfg.batch_size):
            masks = [(i, s.loss_mask) for i, s in batch] if cfg.legacy else None
            llm.collective_rpc("eagle_expect", args=([(i, s.input_ids) for i, s in batch], masks))
            llm.generate([TokensPrompt(prompt_token_ids=s.input_ids) for _, s in batch], params, use_tqdm=False)
            got = _drain(llm, wait=False)
            record(got)
            beat()
            handed += len(batch)
            done_tokens += sum(len(s.input_ids) for _, s in batch)
            rate = f"{done_tokens / (time.perf_counter() - t1):,.0f}"
            settled, lost, lost_tokens, dropped = got["matching"]
            bar.update(len(written) - bar.n)  # rows on the disk, not rows handed to the engine
            bar.set_postfix(tok_s=rate, **({"unmatched": lost} if lost else {}))
            pending = handed - len(written)
            note(
                f"{len(written)}/{total} rows written ({handed} handed to the engine, {pending} pending); "
                f"unmatched: {lost} rows, {lost_tokens} tokens; {dropped} dropped steps; {rate} tok/s"
            )
            history.append((settled, lost))
            _check_matching(history, got["first_unmatched"])
        got = _drain(llm, wait=True)
        record(got, last=True)
        history.append(tuple(got["matching"][:2]))
        _check_matching(history, got["first_unmatched"])
        bar.update(len(written) - bar.n)
    extract_s = time.perf_counter() - t1
    llm.collective_rpc("eagle_remove")
    where = {
        "model_class": writers[0]["model_class"],
        "dtype": writers[0]["dtype"],
        "decoder_path": writers[0]["path"],
        "workers": len(installed),
        "stages": [[w["start"], w["end"]] for w in writers],
    }
    return written, {**got["stats"], **where}, extract_s
