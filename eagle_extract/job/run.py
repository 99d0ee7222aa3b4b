"""One extraction run, top to bottom, and its capture loop.

Plan, tokenize the first rows and estimate the disk, prepare the output, start tokenizing the rest into
the token store, start the engine, feed it the store's rows as they come, complete the output (or
this shard of it).  `Todo` reads the rows still to write from the store as it fills; `Capture` hands them to
the engine's workers and settles the rows they write.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import replace
from pathlib import Path

from ..config import ExtractConfig
from ..data.formats import BadRow
from ..data.samples import read_records
from ..data.store import TokenStore, store_name
from ..errors import ExtractError, engine_errors
from ..files import shards
from ..files.rowfile import HIDDEN_DIR, completed_rows, header_dtype, header_problem, hidden_state_path
from ..runlog import RunLog, progress, share_progress
from ..worker.capture_spec import CaptureSpec, host_bytes_per_rank
from ..worker.model_nav import refuse_unfound_decoder
from ..worker.stages import PartJoiner, check_layout
from . import output as out
from . import preflight, regenerate, stream
from .completion import complete, complete_shard, reopen
from .engine import start_engine
from .plan import Plan, make_plan, refuse_changed_data
from .watch import HEARTBEAT_S, EngineWatch


def run(cfg: ExtractConfig, log=print, repair: list[int] | None = None) -> dict:
    """Run a whole extraction (or one shard of it); `cfg` must be resolved().  Returns the manifest
    when the output is complete, else this shard's summary (with "complete": False).  `repair`: rows of the
    complete output that `cfg` (its recorded extraction) wrote, deleted and written again; they and the manifest
    are deleted only once the checks made before the engine starts have passed and the output is held."""
    output = Path(cfg.output)
    try:
        plan = make_plan(cfg)
    except ExtractError as exc:
        if repair is None:
            raise
        raise ExtractError(
            f"cannot repair {output}: its recorded extraction cannot run again here ({exc}); nothing was changed"
        ) from None
    if cfg.overwrite:
        out.refuse_foreign_files(output, cfg.data)
    if plan.shard is None and not cfg.overwrite and (output / shards.ROWS_DIR).is_dir():
        raise ExtractError(
            f"--output {output} holds the rows of an unfinished sharded run (--shard or --dp), named by source row; "
            "finish it with its --shard or --dp command, or pass --overwrite to start over"
        )
    if cfg.regenerate:  # the answers come first: the conversations are tokenized after them
        source = list(read_records(cfg.data, cfg.data_format, cfg.strict, need_assistant=False))
        first = sized = None
    else:  # before anything is created: the first rows' errors, and the disk estimate from them
        kept = None if cfg.overwrite else TokenStore(output / store_name(plan.shard), change=False)
        vouched = (output / out.run_file(plan.shard)).exists()  # else prepare_output starts the store over
        resuming = kept is not None and bool(kept.chunks) and vouched  # its rows are not tokenized again
        own = stream.own_rows_only(cfg, plan.shard)  # a shard's own rows may all be skipped: the others' may not
        first = [] if resuming else stream.first_chunks(plan, stream.job_rows(cfg, plan.shard), require_usable=not own)
        source = None
        done = set() if cfg.overwrite else completed_rows(shards.rows_folder(output, plan.shard), cfg.legacy)
        sized = _sized(plan, first, done, kept)
    with out.claimed(output, plan.shard):
        if repair is not None:
            reopen(output, repair, plan.identity)
        manifest = out.identical_complete(output, plan.identity, cfg.overwrite, cfg.states)
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
                result = _extract(replace(plan, cfg=staged), (source, first, sized), run_log, watch)
        except ExtractError as exc:  # the same error (a DataError stays a ValueError), pointing at the log
            if log_path.exists():  # not when the output folder went with it
                exc.args = (f"{exc} (the run's log: {log_path})",)
            raise
        finally:  # the engine has shut down (RunLog's exit let it go): nothing of it may hold GPUs now
            watch.reap()
        return out.replace_complete(target, output) if target != output else result


def _sized(plan: Plan, first: list[list], done: set[int], kept: TokenStore | None) -> tuple[int, int, int, int]:
    """(rows expected in the dataset, this job's tokens still to do, their bytes, bytes free), estimated from the
    first chunks (or the rows a kept store holds) and the source's row count; refused when they cannot fit the
    disk."""
    cfg = plan.cfg
    if first:
        read, usable, tokens, ended = stream.first_counts(first)
        per_row = tokens / max(usable, 1)
    else:  # the kept store's: its own rows' tokens, and every row it read (for --max-samples: others' too)
        read, usable, ended, per_row = kept.read, kept.seen, kept.ended, kept.tokens / max(kept.usable, 1)
    expected = stream.expected_rows(cfg, read, usable, ended, plan.shard)
    share = 1 / plan.shard[1] if plan.shard else 1  # shards write at about one pace: done rows are theirs alike
    todo_rows = max(0.0, (expected - len(done)) * share)
    todo_tokens = round(todo_rows * per_row)
    expected_bytes, free = preflight.check_disk(cfg, todo_tokens, plan.bytes_per_token())
    return expected, todo_tokens, expected_bytes, free


def _extract(plan: Plan, source: tuple, run_log: RunLog, watch: EngineWatch) -> dict:
    """The run itself, into `plan.cfg.output` (claimed); `source` from run()."""
    try:
        return _extract_rows(plan, source, run_log, watch)
    except BaseException:
        out.abandon_if_empty(Path(plan.cfg.output), plan.shard)
        raise


def _extract_rows(plan: Plan, source: tuple, run_log: RunLog, watch: EngineWatch) -> dict:
    """Tokenize, capture and complete.  The engine is started here and let go here: no other frame, not even a
    helper's, may hold it (a traceback vLLM keeps from its start holds the frames that started it)."""
    cfg, output, log = plan.cfg, Path(plan.cfg.output), run_log.say
    (records, first, sized), rows = source, None
    llm, start_s, regenerated, tokenizing, written = None, 0.0, None, None, False
    _warn_of_other_rows(plan, log)
    try:
        if records is not None:
            out.prepare_output(output, plan.identity, cfg.overwrite)
            with engine_errors(run_log.path):
                t0 = time.perf_counter()
                watch.expect_engine()
                llm = start_engine(cfg, cfg.seq_length + 1, watch.leaves)
                start_s = _watched(llm, watch, t0)
                usable = [r for r, _, _ in records if r is not None][: cfg.max_samples]
                answered, regenerated = regenerate.answers(llm, cfg, plan.tokenizer, usable, log, watch.beat)
            watch.pause()  # tokenizing the answers is the driver's own work
            bad = [(n, BadRow(why)) for r, n, why in records if r is None]
            rows = sorted([(r.row, r) for r in answered] + bad, key=lambda t: t[0])
            first = stream.first_chunks(plan, rows)
            sized = _sized(plan, first, completed_rows(output, cfg.legacy), None)
        fresh = cfg.overwrite and not cfg.regenerate  # a regenerating run prepared (and cleared) the folder already
        done = out.prepare_output(output, plan.identity, fresh, plan.shard)
        if done and cfg.dtype in AS_ASKED:  # before the tokenizing workers start (a damaged first file: after)
            refuse_other_dtype(shards.rows_folder(output, plan.shard), done, cfg, cfg.dtype)
        store = TokenStore(output / store_name(plan.shard))
        tokenizing = _tokenizing(plan, store, rows, first)
        tokenizing.start()
        if done:
            log("checking the row files an interrupted run wrote")
        todo = Todo(plan, store, done)
        expected = sized[0]
        mine = -(-expected // plan.shard[1]) if plan.shard else expected
        log(_outlook(plan, sized, mine, tokenizing.processes, todo))
        if cfg.strict:  # every row is checked before the engine starts
            _wait_for_stream(store, log)
        batches = todo.batches(watch)
        with engine_errors(run_log.path):  # the stream's failures are one line here too
            first_batch = next(batches, None)  # None: nothing to write (a rerun of a finished shard, say): no engine
        stats, extract_s, handed, tokens, pending = {}, 0.0, 0, 0, set()
        if first_batch is not None and cfg.states == "none":  # the dataset files only: no engine
            for batch in itertools.chain([first_batch], batches):
                handed += len(batch)
                tokens += sum(len(ids) for _, ids, _ in batch)
            share_progress(todo.kept + handed)
        elif first_batch is not None:
            with engine_errors(run_log.path):
                if llm is None:
                    t0 = time.perf_counter()
                    watch.expect_engine()
                    context = plan.shape.context or cfg.seq_length + 1  # + 1: room for the sampled token
                    llm = start_engine(cfg, min(cfg.seq_length + 1, context), watch.leaves)
                    start_s = _watched(llm, watch, t0)
                batches = itertools.chain([first_batch], batches)
                got = _capture(llm, plan, todo, batches, mine, run_log.note, watch)
                stats, extract_s, handed, tokens, pending = got
        written = True  # the engine's answers are saved and its writers closed (eagle_remove)
    finally:
        if tokenizing is not None:
            tokenizing.stop()
        watch.stop.set()  # before the engine goes: its processes end now
        if written and llm is not None:
            watch.end_engine(plan.cfg.engine_args.get("distributed_executor_backend"))  # not in vLLM's ~5 s
        llm = None  # the engine stops now, into the run's log (frames vLLM's imports keep alive would hold it)
    missing = sorted(pending)
    if missing:
        raise ExtractError(
            f"{len(missing)} rows were never captured (first: row {missing[0]}); rerun, and report this as a bug"
        )
    this_run = {
        "engine_start_s": round(start_s, 2),
        "extract_s": round(extract_s, 2),
        "tokens": tokens,
        "rows": handed + todo.kept,
        "resumed_rows": todo.kept,
        "redone_rows": len(todo.damaged),
        "tokenized_rows": store.read - tokenizing.kept,  # source rows this run tokenized
        "waited_for_tokens_s": round(todo.waited_s, 2),  # the engine idle, waiting for the stream
        "capture": stats,
    }
    return _complete(plan, store, this_run, regenerated, log)


def _complete(plan: Plan, store: TokenStore, this_run: dict, regenerated, log) -> dict:
    """The output completed, and its manifest; a shard: recorded as finished, and the output completed when it
    is the last (else its summary, with "complete": False)."""
    cfg = plan.cfg
    refuse_changed_data(plan)
    if plan.shard is None:
        manifest = complete(plan, [store], [this_run], regenerated)
        out.finish_run(Path(cfg.output), None)
        return manifest
    summary = {"shard": cfg.shard, "identity": plan.identity, "config": cfg.record(), **this_run}
    return complete_shard(plan, store, summary, log)


def _warn_of_other_rows(plan: Plan, log) -> None:
    """Rows in the folder this run will not use: another release's, or (a shard's) rows named by dataset index."""
    output = Path(plan.cfg.output)
    if not plan.cfg.overwrite:
        for changed in (out.other_releases(output, plan.identity, plan.shard),
                        out.moved_model(output, plan.identity, plan.shard)):  # fmt: skip
            if changed:
                log(f"warning: {changed}")
    hidden = output / HIDDEN_DIR
    if plan.shard and hidden.is_dir() and next(os.scandir(hidden), None) is not None:
        log(
            f"warning: {hidden} holds rows named by dataset index (an unsharded run's, shards' of an eagle-extract "
            "before 2026-12-02, or a completion cut midway, which `eagle-extract merge` finishes); a shard does not "
            "reuse them"
        )


def _tokenizing(plan: Plan, store: TokenStore, answered: list | None, first: list) -> stream.Tokenizing:
    """The stream (not started yet) that fills `store`: from the regenerated rows when given, else from the
    source."""
    cfg, processes = plan.cfg, plan.cfg.tokenize_processes
    if processes is None:
        processes = stream.default_processes(0 if answered is not None else source_bytes(Path(cfg.data)), cfg.dp)
    processes = min(processes, len(os.sched_getaffinity(0)))  # each holds a tokenizer: more only cost memory
    rows = answered if answered is not None else stream.job_rows(cfg, plan.shard)
    return stream.Tokenizing(store, rows, plan, processes, first)


def _outlook(plan: Plan, sized: tuple, mine: int, processes: int, todo: Todo) -> str:
    """The line that opens the run: how much is coming, where it goes, what a resume keeps."""
    expected, _, expected_bytes, free = sized
    part = f" (shard {plan.cfg.shard}: about {mine} of them)" if plan.shard else ""
    kept = len(todo.done) if plan.shard is None else todo.kept
    resumed = f"; resuming, {kept} rows already written" if todo.done else ""
    resumed += f" ({len(todo.damaged)} damaged files are written again)" if todo.damaged else ""
    if plan.cfg.states == "none":
        return f"about {expected} samples{part}: the dataset files only (--states none), no hidden states{resumed}"
    return (
        f"about {expected} samples{part}, tokenized as the engine runs ({processes or 'no'} worker processes); "
        f"slots for layers {plan.slot_ids}; about {expected_bytes / 2**20:.1f} MiB of hidden states to write "
        f"({free / 2**30:.1f} GiB free){resumed}"
    )


def source_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def _wait_for_stream(store: TokenStore, log) -> None:
    """--strict: the whole source is tokenized (and checked) before the engine starts."""
    log("--strict: checking every row before the engine starts")
    with progress(None, "tokenize", "row") as bar:
        while store.wait(len(store.chunks), timeout=1.0) is not None or not store.ended:
            bar.update(store.read - bar.n)
        bar.update(store.read - bar.n)


def _keys(plan: Plan, store: TokenStore, chunk) -> list[int] | range:
    """The numbers `chunk`'s row files are named by: dataset indices, or (a shard's) source rows."""
    return store.meta(chunk.number)["rows"] if plan.shard else range(chunk.first, chunk.first + chunk.usable)


def _check_kept(plan: Plan, store: TokenStore, done: set[int]) -> tuple[int, set[int], int]:
    """(this job's kept rows, those of them whose file is damaged, deleted to be written again, and how many
    of the store's chunks were checked) among the rows the store holds now; a kept row past them (the store
    was deleted at completion, before a repair) is checked when the stream reaches it."""
    kept, damaged, chunks = 0, set(), list(store.chunks)
    for chunk in chunks:
        keys = _keys(plan, store, chunk)
        if done.isdisjoint(keys):
            continue
        for key, n in zip(keys, store.seq_lens(chunk)):
            if key in done:
                if _damaged(plan, key, n):
                    damaged.add(key)
                else:
                    kept += 1
    return kept, damaged, len(chunks)


def _damaged(plan: Plan, key: int, tokens: int) -> bool:
    """Whether the kept file of row `key` is not whole (a power cut can leave a final name on a torn or empty
    file); deleted, to be written again."""
    path = hidden_state_path(shards.rows_folder(plan.cfg.output, plan.shard), key, plan.cfg.legacy)
    if header_problem(path, tokens, len(plan.slot_ids), plan.shape.hidden_size, plan.cfg.legacy):
        path.unlink(missing_ok=True)
        return True
    return False


class Todo:
    """This job's rows still to write, read from the token store as the stream fills it.  The rows an earlier
    run wrote are checked on the way (a damaged file is deleted and its row written again); `kept` counts
    those found whole, `waited_s` the seconds spent waiting for the stream."""

    def __init__(self, plan: Plan, store: TokenStore, done: set[int]) -> None:
        self.plan, self.store = plan, store
        self.kept, self.damaged, self.checked_chunks = _check_kept(plan, store, done)
        self.done = done - self.damaged  # the rows already in the folder
        self.waited_s = 0.0

    def batches(self, watch: EngineWatch):
        """Batches of --batch-size; a batch goes as soon as the store has nothing more for now."""
        plan, store, batch, number = self.plan, self.store, [], 0
        while True:
            chunk = store.wait(number, timeout=0)
            if chunk is None and batch:  # the engine gets what there is rather than wait for a whole batch
                yield batch
                batch = []
                continue
            if chunk is None:  # a stream that stops moving is a stall like an engine that does (--stall-timeout)
                t0 = time.perf_counter()
                chunk = store.wait(number)
                self.waited_s += time.perf_counter() - t0
                watch.beat()
            if chunk is None:  # the stream ended before chunk `number` (wait() looks again once it ended)
                break
            number += 1
            checked = chunk.number < self.checked_chunks  # its kept rows were checked already
            if checked and self.done.issuperset(_keys(plan, store, chunk)):
                continue  # written before, and checked: not read again
            for index, row, ids, mask in store.rows(chunk):
                key = row if plan.shard else index
                if key in self.done and checked:
                    continue
                if key in self.done and not _damaged(plan, key, len(ids)):
                    self.kept += 1
                    continue
                batch.append((key, ids, mask))
                if len(batch) == plan.cfg.batch_size:
                    yield batch
                    batch = []
        if batch:
            yield batch


def _watched(llm, watch: EngineWatch, t0: float) -> float:
    """Start watching the engine started at `t0`; returns the seconds it took to start.  (Not the frame
    that starts it: a traceback vLLM keeps from its start holds that frame, and with it its locals.)"""
    every = min(HEARTBEAT_S, (watch.stall_s or HEARTBEAT_S) / 4)  # several touches within any stall limit
    llm.collective_rpc("eagle_heartbeat", args=(str(watch.heartbeat), every))
    watch.start()
    return time.perf_counter() - t0


def drain_workers(
    llm, wait: bool, finished: list[int] | None = None, patience: float = 0.0, expect: list | None = None
) -> dict:
    """Collect the writing workers' reports; `written_by` lists each writer's new rows, in rank order.
    `finished`: only these rows have run to their end (worker.eagle_drain), not every row announced;
    `patience`: without `wait`, how long a writer waits for a first row written; `expect`: (row, token ids)
    of the rows to announce once the workers have reported."""
    reports = [r for r in llm.collective_rpc("eagle_drain", args=(wait, finished, patience, expect)) if r is not None]
    errors = [e for r in reports for e in r["errors"]]
    if errors:
        raise ExtractError(errors[0])
    return {
        "written_by": [r["written"] for r in reports],
        "redo": sorted({i for r in reports for i in r["redo"]}),  # every pipeline stage reads the same steps
        "lost": sorted({i for r in reports for i in r["lost"]}),
        "failed": [f for r in reports for f in r.get("failed", ())],  # (row, why, errno): rows that failed alone
        "untrusted": any(r["untrusted"] for r in reports),
        "worker_s": max((r["worker_s"] for r in reports), default=0.0),
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


class Capture:
    """The capture installed on the engine's workers for one run: it hands the engine batches, settles the
    rows the writers report written (for pipeline stages, once their part files are joined) and runs again
    the rows a step may have mixed up.  The engine is an argument of each call, never kept: a
    failed run's frames are cleared so that the engine stops into the run's log, and nothing else may hold it."""

    def __init__(self, llm, plan: Plan) -> None:
        from vllm import SamplingParams

        cfg, self.folder = plan.cfg, shards.rows_folder(plan.cfg.output, plan.shard)
        spec = CaptureSpec(
            str(self.folder),
            tuple(plan.aux_ids),
            host_bytes_per_rank(cfg.host_memory, cfg.dp * cfg.pp),  # a --dp replica's cfg keeps --dp
            cfg.decoder_path,
            cfg.fp8,
            cfg.legacy,
            cfg.writer_threads,
        )
        self.installed = llm.collective_rpc("eagle_install", args=(spec.as_rpc(),))
        refuse_unfound_decoder(self.installed)
        self.writers = [w for w in self.installed if w["writes"]]  # in rank order, as eagle_drain reports them
        try:
            check_layout(self.writers, plan.shape.num_layers, len(plan.slot_ids))
        except ValueError as exc:
            model = self.installed[0]["model_class"]
            raise ExtractError(f"{exc}; report this as a bug with the model class {model}") from None
        self.cfg, self.joiner, self.masks = cfg, None, None
        if any(w["part"] for w in self.writers):  # pipeline stages: join their part files into rows
            self.masks = {} if cfg.legacy else None  # the legacy rows' loss masks, each until its row is joined
            self.joiner = PartJoiner(self.folder, self.writers, cfg.fp8, self.masks)
        self.params = SamplingParams(max_tokens=1, temperature=0.0)
        self.pending: dict[int, tuple] = {}  # row -> (ids, mask) handed to the engine, until its file is written
        self.handed = self.written = 0
        self.redo: list[int] = []  # rows to run again (finish)

    def run(self, llm, batch: list) -> dict:
        """Hand `batch`, (row, ids, mask) each, to the engine; returns the workers' report."""
        self.pending.update((i, (ids, mask)) for i, ids, mask in batch)
        self.handed += len(batch)
        return self._call(llm, batch)

    def finish(self, llm, note, watch: EngineWatch) -> dict:
        """Once the last batch ran: wait for the writers, and run the rows an ambiguous step may have mixed up
        again: first together, in batches (most were confused with one near-identical row, in a step that
        split prompts: a small call runs whole), then each row confused again alone, where nothing can be
        confused; returns the last report."""
        got = self._drain(llm, wait=True)
        together, alone = set(), set()
        while self.redo:
            rows, self.redo = sorted(set(self.redo)), []
            if alone.intersection(rows):
                raise ExtractError(
                    f"row {min(alone.intersection(rows))} was ambiguous even alone; report this as a bug"
                )
            self._record(got)  # the rows this drain reports written are settled before the loop drains again
            solo = [i for i in rows if i in together]
            batched = [i for i in rows if i not in together]
            together.update(batched)
            alone.update(solo)
            note(f"running {len(rows)} rows again ({len(solo)} one at a time): a step's runs could have been "
                 "more than one row's")  # fmt: skip
            size = self.cfg.batch_size
            for batch in [batched[k : k + size] for k in range(0, len(batched), size)] + [[i] for i in solo]:
                self._call(llm, [(i, *self.pending[i]) for i in batch])
                watch.beat()
            got = self._drain(llm, wait=True)
        self._record(got, last=True)
        return got

    def where(self) -> dict:
        """What the capture ran on, for the manifest."""
        first = self.writers[0]
        return {
            "model_class": first["model_class"],
            "dtype": first["dtype"],
            "decoder_path": first["path"],
            "workers": len(self.installed),
            "stages": [[w["start"], w["end"]] for w in self.writers],
        }

    def _call(self, llm, batch: list) -> dict:
        """One engine call, then the writers' report."""
        from vllm import TokensPrompt

        if self.masks is not None:
            self.masks.update((i, mask) for i, _, mask in batch)
        batch_masks = [(i, mask) for i, _, mask in batch] if self.cfg.legacy else None
        llm.collective_rpc("eagle_expect", args=([(i, ids) for i, ids, _ in batch], batch_masks))
        llm.generate([TokensPrompt(prompt_token_ids=ids) for _, ids, _ in batch], self.params, use_tqdm=False)
        got = self._drain(llm, wait=False)
        self._record(got)
        return got

    def _drain(self, llm, wait: bool) -> dict:
        got = drain_workers(llm, wait)
        self.redo.extend(got["redo"])
        return got

    def _record(self, report: dict, last: bool = False) -> None:
        """Settle the rows `report` says were written (joined first, for pipeline stages)."""
        if self.joiner is None:
            self._settle(i for rows in report["written_by"] for i in rows)
            return
        try:
            self.joiner.add(report["written_by"])
            self._settle(self.joiner.finish() if last else self.joiner.take_joined())
        except Exception as exc:  # a full disk, or stages that disagree: one line, like the writers'
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ExtractError(f"joining the pipeline stages' files: {why}") from None

    def _settle(self, rows) -> None:
        for i in rows:
            if self.pending.pop(i, None) is not None:
                self.written += 1


# --dtype values every vLLM release runs the engine in as asked, so a resume in another is refused before the
# model loads (float16 may run as bfloat16 where a platform lacks it; auto is the engine's choice)
AS_ASKED = ("bfloat16", "float32")


def refuse_other_dtype(folder: Path, done: set[int], cfg, runs_as: str) -> None:
    """The rows already in the folder and the engine's must be of one dtype."""
    kept_as = header_dtype(folder, min(done)) if not (cfg.fp8 or cfg.legacy) else None
    if kept_as and kept_as != runs_as:
        raise ExtractError(  # --dtype is in the run's settings: only auto, as where they were written, resumes
            f"the engine runs in {runs_as}, but the {len(done)} rows already written are {kept_as} (--dtype auto "
            f"chose that where they were written); resume with --dtype auto where it chooses {kept_as}, or pass "
            "--overwrite to start over"
        )


def _capture(llm, plan: Plan, todo: Todo, batches, total: int, note, watch: EngineWatch) -> tuple:
    """Stream the rows still to do through the engine, showing progress; returns (capture stats, seconds, how
    many rows were handed to the engine, their tokens, the rows handed but never written): the driver holds
    only the rows in flight.  `note` puts each batch's counts in the run's log; `total` is this job's
    estimated row count, for the progress display."""
    capture = Capture(llm, plan)
    if todo.done:
        refuse_other_dtype(capture.folder, todo.done, capture.cfg, capture.writers[0]["dtype"])
    watch.beat()
    history = [(0, 0)]  # (settled, unmatched) rows after each batch
    t1 = time.perf_counter()
    with progress(total, "extract", "row", initial=todo.kept) as bar:
        tokens = 0
        for batch in batches:
            got = capture.run(llm, batch)
            watch.beat()
            tokens += sum(len(ids) for _, ids, _ in batch)
            rate = f"{tokens / (time.perf_counter() - t1):,.0f}"
            settled, lost, lost_tokens, dropped = got["matching"]
            on_disk = todo.kept + capture.written  # rows on the disk, not rows handed to the engine
            share_progress(on_disk)
            bar.total = max(bar.total or 0, todo.kept + capture.handed)
            bar.update(on_disk - bar.n)
            bar.set_postfix(tok_s=rate, **({"unmatched": lost} if lost else {}))
            note(
                f"{on_disk}/about {bar.total} rows written ({capture.handed} handed to the engine this run, "
                f"{len(capture.pending)} pending); unmatched: {lost} rows, {lost_tokens} tokens; "
                f"{dropped} dropped steps; {rate} tok/s; {todo.waited_s:.1f} s waiting for the tokenizer"
            )
            history.append((settled, lost))
            _check_matching(history, got["first_unmatched"])
        got = capture.finish(llm, note, watch)
        history.append(tuple(got["matching"][:2]))
        _check_matching(history, got["first_unmatched"])
        bar.total = todo.kept + capture.handed  # known now that the stream ended
        bar.update(todo.kept + capture.written - bar.n)
        share_progress(todo.kept + capture.written)
    extract_s = time.perf_counter() - t1
    llm.collective_rpc("eagle_remove")
    return {**got["stats"], **capture.where()}, extract_s, capture.handed, tokens, capture.pending
