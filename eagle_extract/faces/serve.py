"""`eagle-extract serve`: speculators' online trainer asks for each row's states over HTTP.

The OpenAI-style routes speculators 0.9's loader calls (`GET /v1/models`, `POST /v1/completions`, and
`POST /v1/chat/completions` for text messages) answer with `kv_transfer_params.hidden_states_path`: a row
file in the spool, in the offline layout (`hidden_states` [T, K, H], `token_ids`; FP8 with its scales),
complete before the answer goes out, so the reader's lock wait finds no lock.  The reader deletes it.

One engine thread feeds the requests into the engine's running batch as they arrive (continuous
batching), through the same capture core as extraction (worker extension, hooks, matcher, writer); rows
the matcher cannot bind for sure are run again.  The spool is bounded in bytes: a request waits for room, and files a
trainer never collected are removed after `--spool-ttl` seconds and at shutdown.  With `--transfer mooncake` each
row's file is put into a Mooncake store instead, and the answer carries the object's manifest (mooncake.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import math
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field, replace
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..config import ExtractConfig, ServeOptions
from ..data.formats import DataError
from ..data.samples import check_template
from ..errors import ExtractError, engine_errors
from ..files.rowfile import hidden_state_path
from ..interrupts import interrupted, note_interrupt
from ..job.plan import model_layers
from ..job.preflight import check_options, check_ranges, check_weights, load_tokenizer
from ..job.run import drain_workers
from ..job.watch import EngineWatch
from ..runlog import RunLog
from ..worker.capture_spec import CaptureSpec, host_bytes_per_rank
from ..worker.model_nav import refuse_unfound_decoder
from .mooncake import MooncakeObjects, StoreUnavailable

SPOOL_SHARE = 0.5  # of the spool filesystem's free space, the default --spool-bytes
SERVE_LENGTH = 32767  # the longest prompt served without --seq-length, where the model's context is longer


class BadRequest(Exception):
    """An answer of status `status` (400 unless said) with OpenAI's error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


def check_serve_options(cfg: ExtractConfig, opts: ServeOptions) -> None:
    if cfg.legacy:
        raise ExtractError("--format speculators-legacy: the server writes speculators' online layout only")
    check_ranges(opts)
    if opts.api_key is not None and not opts.api_key.strip():
        raise ExtractError("--api-key is empty; give the bearer token clients send, or leave it out")
    if opts.api_key is not None and not (opts.api_key.isascii() and opts.api_key.isprintable()
                                         and opts.api_key == opts.api_key.strip()):  # fmt: skip
        raise ExtractError(
            "--api-key holds a character an HTTP header cannot carry (a control character such as a newline, "
            "a non-ASCII one, or spaces at its ends); give the token alone"
        )
    if not opts.host.strip():
        raise ExtractError(
            "--host is empty, which would listen on every address; give the address to listen on (0.0.0.0 for "
            "every one)"
        )
    if opts.mooncake:
        opts.mooncake.check()
        if cfg.fp8:
            raise ExtractError(
                "--storage-dtype fp8 with --transfer mooncake: speculators' Mooncake reader does not dequantise "
                "FP8 rows; leave out --storage-dtype fp8, or use --transfer file"
            )


def _port_free(host: str, port: int) -> None:
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise ExtractError(f"--host {host} --port {port}: cannot listen there ({exc.strerror}); pass another --port")


class Spool:
    """Our folder in the spool: state files the trainer collects (and deletes).  `reserve` waits while
    the files written and the rows in flight would pass `limit` bytes; an uncollected file goes after
    `ttl` seconds; `clear` removes every file of ours."""

    def __init__(self, root: Path, limit: int, ttl: float) -> None:
        self.root, self.limit, self.ttl = root, limit, ttl
        self._files: dict[Path, tuple[int, float]] = {}  # written, not yet seen gone: bytes, time written
        self._bytes = 0  # of those files and of the rows in flight
        self._waiting: list[object] = []  # requests waiting for room, first come first
        self._cond = threading.Condition()
        self.expired = 0

    def used(self) -> int:
        return self._bytes

    def reserve(self, nbytes: int, give_up: threading.Event) -> None:
        """Wait for room, in the order the requests came (small rows must not starve a long one); a row larger
        than the whole spool goes when the spool is empty."""
        ticket = object()
        with self._cond:
            self._waiting.append(ticket)
            try:
                while not give_up.is_set() and (
                    self._waiting[0] is not ticket or self._bytes and self._bytes + nbytes > self.limit
                ):
                    self._cond.wait(0.5)
                    self._sweep()
            finally:
                self._waiting.remove(ticket)
                self._cond.notify_all()
            self._bytes += nbytes

    def written(self, path: Path, reserved: int) -> None:
        size = path.stat().st_size
        with self._cond:
            self._bytes += size - reserved
            self._files[path] = (size, time.monotonic())

    def hold(self, path: Path) -> None:
        """`path` is ours now, not the trainer's (going into the Mooncake store, which may make it wait for room
        past the TTL): it is never swept, and its bytes count until it is gone."""
        with self._cond:
            if path in self._files:
                self._files[path] = (self._files[path][0], math.inf)

    def release(self, reserved: int) -> None:
        with self._cond:
            self._bytes -= reserved
            self._cond.notify_all()

    def _sweep(self) -> None:
        now = time.monotonic()
        for path, (size, at) in list(self._files.items()):
            if path.exists() and now - at > self.ttl:
                path.unlink(missing_ok=True)
                self.expired += 1
            if not path.exists():
                del self._files[path]
                self._bytes -= size
        self._cond.notify_all()

    def sweep(self) -> None:
        with self._cond:
            self._sweep()

    def waiting(self) -> int:
        """Files written and not yet collected."""
        with self._cond:
            self._sweep()
            return len(self._files)

    def clear(self) -> None:
        """Remove every state file of ours, written or half-written (the writer's temporary names)."""
        shutil.rmtree(hidden_state_path(self.root, 0).parent, ignore_errors=True)
        with self._cond:
            self._files.clear()
            self._bytes = 0


@dataclass(eq=False)
class _Job:
    ids: list[int]
    nbytes: int
    future: Future
    index: int = -1
    followers: list = field(default_factory=list)  # requests for the same prompt, given links to its file
    retried: bool = False  # run again once with other rows: next time it runs alone


UNPARSED_TEMPLATE = "this server's chat template does not parse; send the prompt's token ids to /v1/completions"
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
        self.steps, self.step_s, self.drain_s = 0, 0.0, 0.0  # engine steps, and seconds in them and in drains
        self.idle_s = 0.0  # of drain_s: with the engine empty, its rows' files being written
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
        if self.failed:
            raise BadRequest(f"the engine failed: {self.failed}", status=503)
        job = _Job(ids, nbytes, Future())
        self.jobs.put(job)
        if self.failed:  # the loop failed meanwhile and may have emptied the queue before this job came: none waits
            for queued in self._queued():
                self._fail(queued, BadRequest(f"the engine failed: {self.failed}", status=503))
        return job.future

    def run(self) -> None:
        engine = self.llm.llm_engine
        try:
            while not (self.stopping.is_set() and self.jobs.empty() and not self._owed()):
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
                        self._fail(self._inflight.pop(index), BadRequest("no states were captured", status=500))
                self._hold = False
                if not self._inflight:
                    self.watch.pause()  # idle: no time limit until the next request
        except BaseException as exc:
            self.failed = str(exc) if isinstance(exc, ExtractError) else f"{type(exc).__name__}: {exc}"
            self.note(f"engine loop failed: {self.failed}")
            for job in [*self._inflight.values(), *self._parked, *self._held, *self._queued()]:
                self._fail(job, BadRequest(f"the engine failed: {self.failed}", status=503))

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
            try:
                jobs.append(self.jobs.get(timeout=0.2) if idle and not jobs else self.jobs.get_nowait())
            except queue.Empty:
                break
        for job in jobs:
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
            except ValueError as exc:  # vLLM's own check refused the prompt: that request fails, the rest go on
                said = (str(exc).splitlines() or [""])[0][:300]
                self._fail(self._inflight.pop(job.index), BadRequest(f"vLLM refused the prompt: {said}"))
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
                f"{self.redone} run again")  # fmt: skip

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
        for index in [*got["lost"], *got["redo"]]:
            job = self._inflight.pop(index, None)
            self._finished_at.pop(index, None)
            if job is None:
                continue
            if final:
                self._fail(job, BadRequest("no states could be captured for this prompt", status=500))
            else:
                self._parked.append(job)
                self._hold = True

    def _done(self, job: _Job, path: Path) -> None:
        """The prompt's file is written: link it for each follower, then answer (the reader deletes it)."""
        self._leaders.pop(tuple(job.ids), None)
        followers, job.followers = job.followers, []
        for follower in followers:
            link = hidden_state_path(self.spool.root, next(self._numbers)).resolve()
            try:
                os.link(path, link)
            except OSError as exc:
                self._fail(follower, BadRequest(f"cannot link the prompt's file in the spool ({exc.strerror})", 500))
                continue
            self._settled(follower, link)
        self._settled(job, path)

    def _settled(self, job: _Job, path: Path) -> None:
        try:
            self.spool.written(path, job.nbytes)
        except OSError as exc:  # removed from the spool before its answer went out (or unreadable): fail it, not
            with contextlib.suppress(OSError):  # the loop, and leave no file the spool does not count
                path.unlink(missing_ok=True)
            self._fail(job, BadRequest(f"the row's file left the spool before it was answered ({exc.strerror})", 500))
            return
        self.rows += 1
        self.tokens += len(job.ids)
        try:
            job.future.set_result(str(path))
        except InvalidStateError:  # its client went away (a cancelled request): nobody will read it
            path.unlink(missing_ok=True)

    def _fail(self, job: _Job, error: BadRequest) -> None:
        if self._leaders.get(tuple(job.ids)) is job:
            del self._leaders[tuple(job.ids)]
        for follower in job.followers:
            self._fail(follower, error)
        job.followers = []
        self.spool.release(job.nbytes)
        try:
            job.future.set_exception(error)
        except InvalidStateError:  # cancelled meanwhile: nobody waits for it
            pass


def _error(status: int, message: str, param: str | None = None):
    kinds = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed"}
    body = {"message": message, "type": kinds.get(status, "ServerError"), "param": param, "code": status}
    return JSONResponse({"error": body}, status_code=status)


class Requests:
    """Checks a request body and turns it into prompt token ids, as the engine will be given them."""

    def __init__(self, name: str, tokenizer, longest: int, bytes_per_token: int, unparsed: str | None = None) -> None:
        self.name, self.tokenizer, self.longest = name, tokenizer, longest
        self.vocab, self.bytes_per_token = len(tokenizer), bytes_per_token
        self.unparsed = unparsed  # the chat template does not parse: every chat request's answer

    def tokens(self, body: dict, chat: bool) -> list[int]:
        """The prompt's token ids; what the tokenizer or the chat template refuses is the request's fault."""
        try:
            return self.messages(body) if chat else self.prompt(body)
        except BadRequest:
            raise
        except (TypeError, ValueError, UnicodeError, RecursionError) as exc:
            said = (str(exc).splitlines() or [""])[0][:200]
            raise BadRequest(f"the tokenizer cannot encode the prompt ({type(exc).__name__}: {said})") from None

    def model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.name:
            raise BadRequest(f"the model `{model}` does not exist; this server serves `{self.name}`", param="model")

    def prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"] if prompt else []
        elif isinstance(prompt, list):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise BadRequest("prompt: give one list of integer token ids, or one string", param="prompt")
            ids = prompt
        else:
            raise BadRequest("prompt: give one list of integer token ids, or one string", param="prompt")
        return self.checked(ids, "prompt")

    def messages(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages: give a non-empty list of {role, content} messages", param="messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("content", ""), str):
                raise BadRequest(
                    "messages: only text content is served (eagle-extract serve has no multimodal processor); "
                    "give each message's content as a string",
                    param="messages",
                )
        if self.unparsed:
            raise BadRequest(f"messages: {self.unparsed}", param="messages")
        try:
            ids = self.tokenizer.apply_chat_template(
                messages,
                tokenize=True,
                add_generation_prompt=bool(body.get("add_generation_prompt", False)),
                continue_final_message=bool(body.get("continue_final_message", False)),
                return_dict=False,
            )
        except Exception as exc:
            said = " ".join(str(exc).split())[:300]  # jinja2's syntax errors add a line of their own
            raise BadRequest(f"messages: the chat template refused them ({type(exc).__name__}: {said})") from None
        if isinstance(ids, dict):
            ids = ids["input_ids"]
        return self.checked(list(ids), "messages")

    def checked(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise BadRequest(f"{param}: the prompt is empty", param=param)
        bad = next((t for t in ids if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise BadRequest(f"{param}: token id {bad} is outside the vocabulary of {self.vocab}", param=param)
        if len(ids) > self.longest:
            raise BadRequest(
                f"{param}: {len(ids)} tokens, longer than the {self.longest} this server takes (--seq-length, and "
                "the model's context less one)",
                param=param,
            )
        return ids


def make_app(
    loop: EngineLoop,
    spool: Spool,
    requests: Requests,
    api_key: str | None,
    seq_length: int,
    objects: MooncakeObjects | None = None,
):
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    give_up = threading.Event()
    app.state.give_up = give_up

    @app.exception_handler(BadRequest)
    async def _bad(request, exc: BadRequest):
        return _error(exc.status, str(exc), exc.param)

    @app.exception_handler(HTTPException)
    async def _http(request, exc: HTTPException):
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return _error(exc.status_code, message.get(exc.status_code, str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):
        return _error(400, "the request body is not a JSON object")

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            return _error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
        return await call_next(request)

    async def body_of(request: Request) -> dict:
        try:
            body = await request.json()
        except (ValueError, RecursionError):
            raise BadRequest("the request body is not valid JSON (or nests too deeply)") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body is not a JSON object")
        requests.model(body)
        return body

    async def states(ids: list[int]) -> tuple[str, dict]:
        """The row's name and the answer's kv_transfer_params: its file's path, or its Mooncake object's manifest
        (put from the writers' own threads: waiting for room there holds no thread a spool reservation needs)."""
        nbytes = len(ids) * requests.bytes_per_token
        await asyncio.to_thread(spool.reserve, nbytes, give_up)
        try:
            future = loop.submit(ids, nbytes)
        except BaseException:
            spool.release(nbytes)
            raise
        path = await asyncio.wrap_future(future)
        if objects is None:
            return Path(path).stem, {"hidden_states_path": path}
        spool.hold(Path(path))
        try:
            manifest = await asyncio.get_running_loop().run_in_executor(objects.pool, objects.put, Path(path), give_up)
        except StoreUnavailable as exc:
            raise BadRequest(str(exc), status=503) from None
        except FileNotFoundError:  # removed by hand before it was stored: this row fails, not the server
            raise BadRequest("the row's file left the spool before it was stored", 500) from None
        except OSError as exc:
            raise BadRequest(f"could not store the row: {exc.strerror or exc}", 500) from None
        return manifest["handle"], manifest

    def answer(kind: str, ids: list[int], params: dict) -> dict:
        usage = {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
        return {"object": kind, "created": int(time.time()), "model": requests.name, "usage": usage,
                "kv_transfer_params": params}  # fmt: skip

    @app.get("/v1/models")
    async def models():
        card = {"id": requests.name, "object": "model", "created": 0, "owned_by": "eagle-extract",
                "max_model_len": seq_length}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)
        ids = await asyncio.to_thread(requests.tokens, body, False)
        row, params = await states(ids)
        choice = {"index": 0, "text": "", "finish_reason": "length", "logprobs": None, "prompt_token_ids": ids}
        return {"id": f"cmpl-{row}", **answer("text_completion", ids, params), "choices": [choice]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await body_of(request)
        ids = await asyncio.to_thread(requests.tokens, body, True)
        row, params = await states(ids)
        message = {"role": "assistant", "content": ""}
        choice = {"index": 0, "message": message, "finish_reason": "length", "logprobs": None}
        return {"id": f"chatcmpl-{row}", **answer("chat.completion", ids, params), "choices": [choice],
                "prompt_token_ids": ids}  # fmt: skip

    @app.get("/health")
    async def health():
        if loop.failed:
            return JSONResponse({"status": "failed", "error": loop.failed}, status_code=503)
        stored = {"store_bytes": objects.used()} if objects else {}
        return {"status": "ok", "spool_bytes": spool.used(), "rows": loop.rows, "run_again": loop.redone, **stored}

    return app


def serve(cfg: ExtractConfig, opts: ServeOptions, log=print) -> int:
    """Run the server until SIGTERM or Ctrl-C; returns the exit status.  `cfg` must be resolved()."""
    check_options(cfg)
    check_serve_options(cfg, opts)
    shape, aux_ids = model_layers(cfg)
    check_weights(cfg)
    tokenizer = load_tokenizer(cfg)
    try:
        check_template(tokenizer)
        unparsed = None
    except DataError as exc:  # the trainer's requests carry token ids: the server serves those
        log(f"warning: {exc}; until then chat requests are refused, and prompt token ids are served")
        unparsed = UNPARSED_TEMPLATE
    _port_free(opts.host, opts.port)
    objects = MooncakeObjects(opts.mooncake, opts.spool_ttl) if opts.mooncake else None
    try:
        return _serve(cfg, opts, log, shape, aux_ids, tokenizer, unparsed, objects)
    finally:  # whatever failed (the engine's start too), our segment leaves the store and nothing of ours stays
        if objects:
            objects.close()


def _serve(cfg: ExtractConfig, opts: ServeOptions, log, shape, aux_ids, tokenizer, unparsed, objects) -> int:
    if objects:
        objects.connect()  # before the engine: a master that does not answer is one line, now
    root = opts.spool or Path(tempfile.gettempdir())
    try:
        root.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="eagle-extract-serve.", dir=root)).resolve()
    except OSError as exc:
        raise ExtractError(f"--spool {root}: cannot make a folder there ({exc.strerror}); pass a writable --spool")
    limit = int(opts.spool_bytes or shutil.disk_usage(folder).free * SPOOL_SHARE)
    spool = Spool(folder, limit, opts.spool_ttl)
    dtype = shape.dtype if cfg.dtype == "auto" else cfg.dtype
    width = 1 if cfg.fp8 else (4 if dtype in ("float32", "float") else 2)
    per_token = (len(aux_ids) + 1) * shape.hidden_size * width + 8 + (4 if cfg.fp8 else 0)
    name = opts.served_model_name or cfg.model
    if opts.whole_context and shape.context:  # up to SERVE_LENGTH: a 1M-token context's KV cache may not fit
        cfg = replace(cfg, seq_length=min(shape.context - 1, SERVE_LENGTH))
    max_model_len = min(cfg.seq_length + 1, shape.context or cfg.seq_length + 1)
    requests = Requests(name, tokenizer, max_model_len - 1, per_token, unparsed)  # vLLM refuses a max_model_len prompt
    log_path = folder / "eagle_extract.log"
    watch = EngineWatch(cfg.stall_timeout or None, log_path)
    watch.advice = "the server stopped; its spool's files were removed"
    watch.cleanup = spool.clear
    again = f"fix the cause and start the server again (the run's log: {log_path})"
    with RunLog(log_path, log) as run_log, engine_errors(log_path, again, again):
        watch.note = run_log.note
        run_log.say(
            f"starting the engine: {cfg.model}, slots for layers {aux_ids + [shape.num_layers]}, "
            f"{per_token:,} bytes a token; spool {folder} (up to {limit / 2**30:.1f} GiB)"
            + (f"; Mooncake master {opts.mooncake.master} (objects up to {objects.limit / 2**30:.1f} GiB)" if objects
               else "")
        )  # fmt: skip
        from ..job.engine import start_engine

        watch.expect_engine()
        llm = start_engine(cfg, max_model_len)
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
        )
        installed = llm.collective_rpc("eagle_install", args=(spec.as_rpc(),))
        refuse_unfound_decoder(installed)
        if not any(w["writes"] for w in installed):
            raise ExtractError("no worker installed the capture; report this as a bug with the run's log")
        loop = EngineLoop(llm, spool, cfg.batch_size, watch, run_log.note)
        loop.start()
        http = _Server(make_app(loop, spool, requests, opts.api_key, requests.longest, objects), opts)
        # from here to the end of the cleanup, SIGTERM and Ctrl-C stop the server instead of raising
        saved = {sig: signal.signal(sig, http.stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            status = _serve_http(loop, spool, http, run_log, f"http://{opts.host}:{opts.port}/v1 (model {name})",
                                 objects)  # fmt: skip
        finally:
            loop.stopping.set()
            loop.join(timeout=25)
            spool.clear()
            if objects:
                objects.close()
            watch.stop.set()  # before the engine goes: its processes end now, and that is no failure
            loop.llm = llm = None  # vLLM stops its engine now, into the log, not after our last line
            gc.collect()
            watch.reap()
            for sig, handler in saved.items():
                signal.signal(sig, handler)
        objects_expired = f" and {objects.expired} Mooncake objects" if objects else ""
        run_log.say(
            f"stopped: {loop.summary()}; {spool.expired} files{objects_expired} never collected were removed; the "
            f"spool's files are removed; log: {log_path}"
        )
        if loop.failed and not interrupted():
            raise ExtractError(f"the engine failed: {loop.failed}; the server stopped (the log: {log_path})")
    return 0 if interrupted() else status


class _Server:
    """uvicorn's server with our signal handling: SIGTERM or Ctrl-C stops taking requests and lets those in
    flight finish (a second Ctrl-C: at once), and nothing is raised again afterwards."""

    def __init__(self, app, opts: ServeOptions) -> None:
        import contextlib

        import uvicorn

        config = uvicorn.Config(app, host=opts.host, port=opts.port, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=GRACE_S, access_log=False)  # fmt: skip

        class Quiet(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                yield

        self.server = Quiet(config)
        self.app = app

    def stop(self, signum=None, frame=None) -> None:
        """A terminal's Ctrl-C reaches vLLM's engine processes too, which stop at once: what fails after it
        is the stop asked for (requests still in flight get 503), not an engine failure."""
        note_interrupt()
        if self.server.should_exit and signum == signal.SIGINT:
            self.server.force_exit = True
        self.server.should_exit = True


PROGRESS_S = 30  # seconds between the server's progress lines
GRACE_S = 20  # seconds the requests in flight get at shutdown; then their files get COLLECT_S to be read
COLLECT_S = 5


def _serve_http(
    loop: EngineLoop, spool: Spool, http: _Server, run_log, where: str, objects: MooncakeObjects | None
) -> int:
    server = http.server

    def janitor() -> None:
        said, shown = time.monotonic(), 0
        while not server.should_exit:
            spool.sweep()
            if loop.failed:
                server.should_exit = True
            if time.monotonic() - said > PROGRESS_S and loop.rows != shown:  # progress, while there is any
                said, shown = time.monotonic(), loop.rows
                stored = objects and f"; Mooncake {objects.used() / 2**20:,.0f} MiB of {objects.limit / 2**20:,.0f}"
                run_log.say(f"{loop.summary()}; spool {spool.used() / 2**20:,.0f} MiB of {spool.limit / 2**20:,.0f}"
                            f"{stored or ''}")  # fmt: skip
            time.sleep(0.5)
        http.app.state.give_up.set()  # requests waiting for room go now: they are in flight

    async def main() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            run_log.say(f"serving {where}")
        await task

    threading.Thread(target=janitor, daemon=True, name="eagle-serve-spool").start()
    asyncio.run(main())
    run_log.say("stopping: the requests in flight are answered")
    deadline = time.monotonic() + COLLECT_S
    while (spool.waiting() or objects and objects.waiting()) and time.monotonic() < deadline and not loop.failed:
        time.sleep(0.1)  # the last answers' files or objects, for their readers
    return 1 if loop.failed else 0
