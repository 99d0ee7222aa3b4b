"""The server's engine loop: continuous batching of HTTP requests into one engine through the same capture
core as extraction (worker extension, hooks, matcher, writer), each request answered with its row's file."""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ExtractError, RequestError
from ..files.rowfile import hidden_state_path
from ..files.spool import Spool
from ..worker.capture_spec import CaptureSpec, host_bytes_per_rank
from ..worker.model_nav import refuse_unfound_decoder
from .engine import start_engine
from .run import drain_workers
from .watch import EngineWatch


@dataclass(eq=False)
class _Job:
    ids: list[int]
    nbytes: int
    future: Future
    index: int = -1
    followers: list = field(default_factory=list)  # requests for the same prompt, given links to its file
    retried: bool = False  # run again once with other rows: next time it runs alone



STOPPING = "the server is stopping; send the request to a running server"
STALL_S = 30.0  # a row the engine finished that has no file after this long (not a slow disk): hold, settle
PATIENCE_S = 0.005  # with the engine empty and rows waiting for their files: a look waits this long for one


class EngineLoop(threading.Thread):
    """Continuous batching: requests join the engine's running batch as they arrive, through the engine
    under vLLM's `LLM` (`add_request`, `step`), and each is answered as soon as its file is written.
    Identical prompts in flight run once; the others get a hard link to its file (a run serves the first
    row waiting for its tokens, so two in flight could not be told apart).  When the matcher distrusts a
    run, or a finished row has no file after STALL_S, no new request is taken until the engine has run
    empty; then every row announced is settled, and those left are run again: together, then any left again
    alone, once.  An engine that runs empty otherwise settles its rows without waiting for the disk: each
    file is answered as it is written, and new requests come in meanwhile.  The workers are asked once a step
    (the engine core serves an RPC only between its steps): that look also announces the step's new rows."""

    def __init__(self, llm, spool: Spool, batch_size: int, watch: EngineWatch, note) -> None:
        super().__init__(daemon=True, name="eagle-serve-engine")
        import queue

        self.llm, self.spool, self.batch_size, self.watch, self.note = llm, spool, batch_size, watch, note
        self.jobs: queue.Queue[_Job] = queue.Queue()
        self.stopping = threading.Event()
        self.failed: str | None = None
        self._numbers = itertools.count()
        self.rows = self.tokens = self.redone = 0
        self.abandoned = 0  # requests whose client went away before their answer: not run, or their file removed
        self._count_lock = threading.Lock()  # abandoned is counted from the engine thread and the event loop
        self._closing = threading.Lock()
        self._closed = False  # the loop has ended: submit refuses
        self.steps, self.step_s, self.drain_s = 0, 0.0, 0.0  # engine steps, and seconds in them and in drains
        self.idle_s = 0.0  # of drain_s: with the engine empty, its rows' files being written
        self.worker_s = 0.0  # of drain_s: the slowest writing worker's own seconds in each look
        self.starved_s = 0.0  # with nothing in flight, waiting for a request
        self._inflight: dict[int, _Job] = {}  # by row number: announced, not yet answered
        self._leaders: dict[tuple[int, ...], _Job] = {}  # the job running each prompt in flight
        self._running: set[int] = set()  # row numbers the engine has not finished
        self._finished_at: dict[int, float] = {}  # finished by the engine, no file yet
        self._parked: list[_Job] = []  # to run again once the engine is empty
        self._held: list[_Job] = []  # admitted by the look that began a hold: taken first once it ends
        self._hold = False  # take no new request until the engine is empty
        self._unsettled = False  # rows announced since the last settle
        self._finished: list[int] = []  # finished by the engine (or refused by vLLM) since the workers were told

    def submit(self, ids: list[int], nbytes: int) -> Future:
        job = _Job(ids, nbytes, Future())
        with self._closing:  # the loop takes no job once it has ended: refused here, never left waiting
            if self.failed or self._closed or self.stopping.is_set():
                raise self._refusal()
            self.jobs.put(job)
        return job.future

    def _refusal(self) -> RequestError:
        """What a request the loop will not run is answered: the engine's failure, or the server's stop."""
        return RequestError(f"the engine failed: {self.failed}" if self.failed else STOPPING, status=503)

    def run(self) -> None:
        engine = self.llm.llm_engine
        try:
            while not (self.stopping.is_set() and self.jobs.empty() and not self._owed()):
                if self.stopping.is_set():  # what has not reached the engine is refused at once; the rest answered
                    for job in [*self._held, *self._queued()]:
                        self._fail(job, self._refusal())
                    self._held = []
                fresh = [] if self._hold else self._admit()
                if self._running or fresh:
                    # one look at the workers a step (each look waits for the engine core's step in progress):
                    # the rows the last step finished, or with the engine empty every row announced (settled
                    # without waiting for the disk), told; the files written heard; the new rows announced
                    settle = not self._running and self._unsettled
                    finished, self._finished = self._finished, []
                    self._unsettled = self._unsettled and not settle
                    self._number(fresh)
                    self._answer(self._drain(False, None if settle else finished, expect=self._rows(fresh)))
                    if self._hold and fresh:  # that look held new requests: they wait for the settle, numbered anew
                        for job in fresh:
                            del self._inflight[job.index]
                            self._finished.append(job.index)  # announced: the workers are told it will not run
                        self._held, fresh = fresh + self._held, []
                    self._add(engine, fresh)
                    if self._running:
                        self._finished += self._step(engine)
                    continue
                if self._inflight and not self._hold and not self._parked:
                    # the engine is empty, its rows wait only for their files: settle them without waiting
                    # for the disk (their files, and any row lost, come in at later looks), answer each file
                    # as it is written, and let new requests in between looks
                    settle, self._unsettled, self._finished = self._unsettled, False, []  # a settle covers these
                    before = self.drain_s
                    got = self._drain(False, None if settle else [], PATIENCE_S)
                    self.idle_s += self.drain_s - before
                    self._answer(got)
                    self._hold = self._hold or self._stalled()
                    continue
                # the engine is empty and a row is distrusted, parked or stalled (or nothing is in flight):
                # settle every row announced, waiting for the disk, run again what is left and fail what
                # still has no states; then new requests may come in again
                if self._unsettled or self._parked or self._inflight:
                    self._unsettled, self._finished = False, []
                    self._answer(self._drain(True, None))
                    self._run_again(engine)
                    for index in list(self._inflight):  # every row is settled now: none may wait on
                        self._fail(self._inflight.pop(index), RequestError("no states were captured", status=500))
                self._hold = False
                if not self._inflight:
                    self.watch.pause()  # idle: no time limit until the next request
        except BaseException as exc:  # the watch's reason, where it saw the engine die first, stays the reason
            self.failed = self.failed or (str(exc) if isinstance(exc, ExtractError) else f"{type(exc).__name__}: {exc}")
            self.note(f"engine loop failed: {self.failed}")
        with self._closing:
            self._closed = True
        for job in [*self._inflight.values(), *self._parked, *self._held, *self._queued()]:
            self._fail(job, self._refusal())

    def engine_died(self, why: str) -> None:
        """From the engine's watch, in a process that outlives its engine (a Ray Serve replica): every request
        held is answered 503 now, whether or not this loop's thread is blocked on the dead engine."""
        self.failed = self.failed or why
        with self._closing:
            self._closed = True
        for job in self._queued():  # never reached this loop's thread: answered and released here
            self._fail(job, self._refusal())
        for job in [*list(self._inflight.values()), *list(self._parked), *list(self._held)]:  # the thread's to
            for each in [job, *job.followers]:  # release, if it ever leaves the dead engine
                with contextlib.suppress(InvalidStateError):
                    each.future.set_exception(self._refusal())

    def waiting(self) -> int:
        """Requests taken by the server, not yet in the engine."""
        return self.jobs.qsize() + len(self._held)

    def _owed(self) -> bool:
        """Requests taken that still wait for their answer."""
        return bool(self._inflight or self._parked or self._held)

    def _queued(self) -> list[_Job]:
        import queue

        jobs = []
        while True:
            try:
                jobs.append(self.jobs.get_nowait())
            except queue.Empty:
                return jobs

    def _admit(self) -> list[_Job]:
        """The waiting requests to take into the engine, those held back at a hold first, up to --batch-size
        rows in it at once (waiting a little for one when there is nothing else to do), less those whose prompt
        is in flight already: they follow it."""
        import queue

        room = self.batch_size - len(self._running)
        fresh, self._held = self._held[:room], self._held[room:]  # leaders of their prompts already
        jobs = []
        idle = not self._running and not self._inflight and not fresh
        while len(fresh) + len(jobs) < room:
            wait = 0.2 if idle and not jobs else 0.0  # nothing else to do: wait a little for a request
            t0 = time.perf_counter()
            try:
                jobs.append(self.jobs.get(timeout=wait) if wait else self.jobs.get_nowait())
            except queue.Empty:
                break
            finally:
                self.starved_s += time.perf_counter() - t0 if wait else 0.0
        for job in jobs:
            if job.future.cancelled():  # its client went away before it reached the engine: it never runs
                self.spool.release(job.nbytes)
                self.count_abandoned()
                continue
            leader = self._leaders.get(key := tuple(job.ids))
            if leader is not None:
                leader.followers.append(job)
            else:
                self._leaders[key] = job
                fresh.append(job)
        if fresh:
            self.watch.beat()
        return fresh

    def _number(self, jobs: list[_Job]) -> None:
        """Give each job a fresh row number; from here it is in flight, to be answered or failed."""
        for job in jobs:
            job.index = next(self._numbers)
            self._inflight[job.index] = job
        self._unsettled = self._unsettled or bool(jobs)

    @staticmethod
    def _rows(jobs: list[_Job]) -> list[tuple[int, list[int]]]:
        return [(job.index, job.ids) for job in jobs]

    def _add(self, engine, jobs: list[_Job]) -> None:
        """Hand announced jobs to the engine; a prompt vLLM refuses fails its request, the rest go on."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0)
        for job in jobs:
            try:
                engine.add_request(str(job.index), TokensPrompt(prompt_token_ids=job.ids), params)
            except Exception as exc:  # vLLM's checks refused the prompt (not all raise ValueError): it fails alone
                said = (str(exc).splitlines() or [""])[0][:300]
                self._fail(self._inflight.pop(job.index), RequestError(f"vLLM refused the prompt: {said}"))
                self._finished.append(job.index)  # announced: the workers are told it will not run
                continue
            self._running.add(job.index)

    def _step(self, engine) -> list[int]:
        """One engine step; returns the row numbers it finished."""
        t0 = time.perf_counter()
        outputs = engine.step()
        self.step_s += time.perf_counter() - t0
        self.steps += 1
        self.watch.beat()
        finished = [int(str(o.request_id).partition("-")[0]) for o in outputs if o.finished]  # vLLM adds a suffix
        self._running.difference_update(finished)
        now = time.monotonic()
        self._finished_at.update((i, now) for i in finished if i in self._inflight)
        self._hold = self._hold or self._stalled()  # a finished row without a file: settle once the engine is empty
        return finished

    def _stalled(self) -> bool:
        now = time.monotonic()
        return any(now - at > STALL_S for at in self._finished_at.values())

    def _drain(self, wait: bool, finished: list[int] | None, patience: float = 0.0, expect: list | None = None) -> dict:
        t0 = time.perf_counter()
        got = drain_workers(self.llm, wait, finished, patience, expect)
        self.drain_s += time.perf_counter() - t0
        self.worker_s += got["worker_s"]
        if got["untrusted"]:
            self._hold = True
        return got

    def _run_again(self, engine) -> None:
        """The rows left after a settle run again: first together, --batch-size at a time (most were confused
        with one near-identical row in a step that split prompts; a small batch runs whole), then each row
        left again alone, where an engine of one prompt cannot confuse it.  A row that fails alone is failed
        to its client."""
        while self._parked:  # the rows not yet taken stay parked: if the engine fails, they are failed with it
            jobs = [job for job in self._parked if not job.retried][: self.batch_size] or self._parked[:1]
            for job in jobs:
                self._parked.remove(job)
                self.redone += not job.retried  # rows, not runs: a row run again alone after its batch counts once
                job.retried = True
            self._number(jobs)
            self.llm.collective_rpc("eagle_expect", args=(self._rows(jobs), None))
            self._add(engine, jobs)
            while self._running:
                self._step(engine)
            self._answer(self._drain(True, None), final=len(jobs) == 1)
        self._unsettled, self._finished = False, []
        self._finished_at.clear()

    def summary(self) -> str:
        mean = self.tokens / self.steps if self.steps else 0
        return (f"{self.rows} rows served ({self.tokens:,} tokens) in {self.steps} engine steps ({mean:,.0f} tokens "
                f"each; {self.step_s:.1f} s in the steps, {self.drain_s:.1f} s waiting for the workers, "
                f"{self.idle_s:.1f} s of it with the engine empty while files were written), "
                f"{self.redone} run again, {self.abandoned} abandoned by their clients")  # fmt: skip

    def _answer(self, got: dict, final: bool = False) -> None:
        """Answer the rows written; rows settled without a file, and rows the matcher handed back, are run
        again at the next settle (`final`: this was a row's run alone, so they fail)."""
        for index in (i for rows in got["written_by"] for i in rows):
            job = self._inflight.pop(index, None)
            self._finished_at.pop(index, None)
            path = hidden_state_path(self.spool.root, index).resolve()
            if job is None:  # a prompt vLLM refused, served by another's run: nobody asked for it
                path.unlink(missing_ok=True)
                continue
            self._done(job, path)
        for index, why, code in got["failed"]:  # its file could not be written: that request fails, the server goes on
            job = self._inflight.pop(index, None)
            self._finished_at.pop(index, None)
            if job is not None:
                status = 507 if code == errno.ENOSPC else 500
                self._fail(job, RequestError(f"the row's states could not be written: {why}", status=status))
        for index in [*got["lost"], *got["redo"]]:
            job = self._inflight.pop(index, None)
            self._finished_at.pop(index, None)
            if job is None:
                continue
            if final:
                self._fail(job, RequestError("no states could be captured for this prompt", status=500))
            else:
                self._parked.append(job)
                self._hold = True

    def _done(self, job: _Job, path: Path) -> None:
        """The prompt's file is written: link it for each follower, count the file and its links as one, then
        answer each (the readers delete them)."""
        self._leaders.pop(tuple(job.ids), None)
        followers, job.followers = job.followers, []
        answers = [(job, path)]
        for follower in followers:
            link = hidden_state_path(self.spool.root, next(self._numbers)).resolve()
            try:
                os.link(path, link)
            except OSError as exc:
                self._fail(follower, RequestError(f"cannot link the prompt's file in the spool ({exc.strerror})", 500))
                continue
            answers.append((follower, link))
        try:
            self.spool.written([p for _, p in answers], sum(j.nbytes for j, _ in answers))
        except OSError as exc:  # removed from the spool before its answer went out (or unreadable): fail them, not
            for answered, p in answers:  # the loop, and leave no file the spool does not count
                with contextlib.suppress(OSError):
                    p.unlink(missing_ok=True)
                self._fail(answered, RequestError(f"the row's file left the spool before it was answered "
                                                  f"({exc.strerror})", 500))  # fmt: skip
            return
        for answered, p in answers:
            try:
                answered.future.set_result(str(p))
            except InvalidStateError:  # its client went away (a cancelled request): nobody will read it
                self.spool.remove(p)
                self.count_abandoned()
                continue
            self.rows += 1
            self.tokens += len(answered.ids)

    def count_abandoned(self) -> None:
        with self._count_lock:
            self.abandoned += 1

    def _fail(self, job: _Job, error: RequestError) -> None:
        if self._leaders.get(tuple(job.ids)) is job:
            del self._leaders[tuple(job.ids)]
        for follower in job.followers:
            self._fail(follower, error)
        job.followers = []
        self.spool.release(job.nbytes)
        try:
            job.future.set_exception(error)
        except InvalidStateError:  # answered already (engine_died), or cancelled: its client went away
            if job.future.cancelled():
                self.count_abandoned()


def capture_engine(cfg, max_model_len: int, folder: Path, aux_ids: list[int], watch: EngineWatch):
    """The server's engine, started under `watch` with the capture installed, writing rows into `folder`."""
    watch.expect_engine()
    llm = start_engine(cfg, max_model_len, watch.leaves)
    llm.collective_rpc("eagle_heartbeat", args=(str(watch.heartbeat), 2.0))
    watch.start()
    watch.pause()
    spec = CaptureSpec(
        str(folder),
        tuple(aux_ids),
        host_bytes_per_rank(cfg.host_memory, cfg.pp),
        cfg.decoder_path,
        cfg.fp8,
        writer_threads=cfg.writer_threads,
        durable=False,
        rows_fail_alone=True,
    )
    installed = llm.collective_rpc("eagle_install", args=(spec.as_rpc(),))
    refuse_unfound_decoder(installed)
    if not any(w["writes"] for w in installed):
        raise ExtractError("no worker installed the capture; report this as a bug with the run's log")
    return llm
