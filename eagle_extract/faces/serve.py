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
import errno
import gc
import hmac
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..config import ExtractConfig, ServeOptions
from ..data.formats import DataError
from ..data.samples import check_template
from ..errors import ExtractError, RequestError, engine_errors
from ..files.spool import FOLDER_PREFIX, Spool, hold_folder, sweep_dead_servers
from ..interrupts import interrupted, note_interrupt
from ..job.continuous import STOPPING, EngineLoop, capture_engine
from ..job.plan import model_layers
from ..job.preflight import check_options, check_serve_options, check_weights, load_tokenizer
from ..job.watch import EngineWatch
from ..runlog import RunLog
from .mooncake import MooncakeObjects, StoreUnavailable
from .requests import UNPARSED_TEMPLATE, Requests

SPOOL_SHARE = 0.5  # of the spool filesystem's free space, the default --spool-bytes
SERVE_LENGTH = 32767  # the longest prompt served without --seq-length, where the model's context is longer


def _listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the engine's long start so no other program takes the port meanwhile."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        raise ExtractError(f"--host {host}: not an address or a name this machine resolves ({exc}); pass another "
                           "--host (127.0.0.1, or 0.0.0.0 for every address)") from None  # fmt: skip
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ExtractError(f"--host {host} --port {port}: cannot listen there ({exc.strerror}); pass another "
                               "--port, or stop the program listening there") from None  # fmt: skip
        raise ExtractError(f"--host {host} --port {port}: cannot listen there ({exc.strerror}); pass a --host this "
                           "machine has (127.0.0.1, or 0.0.0.0 for every address)") from None  # fmt: skip
    sock.set_inheritable(False)
    return sock


def _error(status: int, message: str, param: str | None = None):
    kinds = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
             413: "RequestTooLargeError", 499: "ClientClosedRequest", 503: "ServiceUnavailableError"}  # fmt: skip
    body = {"message": message, "type": kinds.get(status, "ServerError"), "param": param, "code": status}
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return JSONResponse({"error": body}, status_code=status, headers=headers)


class _Authorized:
    """Every request must carry `Authorization: Bearer <key>` (the scheme in any case, the key compared in
    constant time).  Plain ASGI, not a Starlette middleware: it passes the connection's own `receive` on, so a
    client that goes away is seen by the route."""

    def __init__(self, app, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                response = _error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


async def _client_gone(request: Request) -> None:
    """Returns once the client has closed its connection (the body is read: the next message is the close)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def make_app(
    loop: EngineLoop,
    spool: Spool,
    requests: Requests,
    opts: ServeOptions,
    seq_length: int,
    objects: MooncakeObjects | None = None,
):
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    app.state.live = set()  # each request's give-up event: set when its client goes, or when the server stops
    app.state.stopping = False

    @app.exception_handler(RequestError)
    async def _bad(request, exc: RequestError):
        return _error(exc.status, str(exc), exc.param)

    @app.exception_handler(HTTPException)
    async def _http(request, exc: HTTPException):
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return _error(exc.status_code, message.get(exc.status_code, str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):
        return _error(400, "the request body is not a JSON object")

    async def body_of(request: Request) -> dict:
        """The body, refused past its bound before it is read whole, and parsed off the event loop."""
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > requests.body_limit:
            raise RequestError(requests.too_large(int(length)), status=413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > requests.body_limit:
                raise RequestError(requests.too_large(size), status=413)
            chunks.append(chunk)
        return await asyncio.to_thread(requests.parse, b"".join(chunks))

    async def states(ids: list[int], give_up: threading.Event, futures: list) -> tuple[str, dict]:
        """The row's name and the answer's kv_transfer_params: its file's path, or its Mooncake object's manifest
        (put from the writers' own threads: waiting for room there holds no thread a spool reservation needs)."""
        nbytes = len(ids) * requests.bytes_per_token
        spool.refuse_unfitting(nbytes)
        if objects is not None:
            objects.refuse_unfitting(nbytes)
        await asyncio.to_thread(spool.reserve, nbytes, give_up)
        if give_up.is_set():
            spool.release(nbytes)
            raise RequestError(STOPPING, status=503)
        try:
            future = loop.submit(ids, nbytes)
        except BaseException:
            spool.release(nbytes)
            raise
        futures.append(future)
        path = await asyncio.wrap_future(future)
        if objects is None:
            return Path(path).stem, {"hidden_states_path": path}
        spool.hold(Path(path))
        try:
            manifest = await asyncio.get_running_loop().run_in_executor(objects.pool, objects.put, Path(path), give_up)
        except StoreUnavailable as exc:
            raise RequestError(str(exc), status=503) from None
        except FileNotFoundError:  # removed by hand before it was stored: this row fails, not the server
            raise RequestError("the row's file left the spool before it was stored", 500) from None
        except OSError as exc:
            raise RequestError(f"could not store the row: {exc.strerror or exc}", 500) from None
        return manifest["handle"], manifest

    async def served(request: Request, ids: list[int]) -> tuple[str, dict]:
        """`states`, unless the client goes away first: then a request not yet in the engine never runs, and a
        row written for nobody is removed at once (its file, or its object), not after the TTL."""
        if app.state.stopping:
            raise RequestError(STOPPING, status=503)
        if len(app.state.live) >= opts.max_requests:
            raise RequestError(f"the server holds {opts.max_requests} requests already (--max-requests); retry "
                               "shortly", status=503)  # fmt: skip
        give_up, futures = threading.Event(), []
        app.state.live.add(give_up)
        work = asyncio.create_task(states(ids, give_up, futures))
        gone = asyncio.create_task(_client_gone(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            app.state.live.discard(give_up)
        if not gone.done():
            gone.cancel()
            return work.result()
        give_up.set()
        # not yet answered: the engine loop drops it, or removes its file once written, and counts it
        counted = [future.cancel() for future in futures]
        loop.abandoned += not any(counted)
        with contextlib.suppress(BaseException):
            row, params = await work
            if "hidden_states_path" in params:
                spool.remove(Path(params["hidden_states_path"]))
            else:
                objects.remove(row)
        raise RequestError("the client went away", status=499)

    def answer(kind: str, ids: list[int], params: dict) -> dict:
        usage = {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
        return {"object": kind, "created": int(time.time()), "model": requests.name, "usage": usage,
                "kv_transfer_params": params}  # fmt: skip

    @app.get("/v1/models")
    async def models():
        card = {"id": requests.name, "object": "model", "created": 0, "owned_by": "eagle-extract",
                "max_model_len": seq_length}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request)
        ids = await asyncio.to_thread(requests.tokens, body, False)
        row, params = await served(request, ids)
        choice = {"index": 0, "text": "", "finish_reason": "length", "logprobs": None, "prompt_token_ids": ids}
        return JSONResponse({"id": f"cmpl-{row}", **answer("text_completion", ids, params), "choices": [choice]})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await body_of(request)
        ids = await asyncio.to_thread(requests.tokens, body, True)
        row, params = await served(request, ids)
        message = {"role": "assistant", "content": ""}
        choice = {"index": 0, "message": message, "finish_reason": "length", "logprobs": None}
        return JSONResponse({"id": f"chatcmpl-{row}", **answer("chat.completion", ids, params), "choices": [choice],
                             "prompt_token_ids": ids})  # fmt: skip

    @app.get("/health")
    async def health():
        if loop.failed:
            return JSONResponse({"status": "failed", "error": loop.failed}, status_code=503)
        stored = {"store_bytes": objects.used()} if objects else {}
        return JSONResponse({"status": "ok", "spool_bytes": spool.used(), "rows": loop.rows, "run_again": loop.redone,
                             "requests_held": len(app.state.live), "waiting_for_room": spool.waiting_for_room(),
                             "abandoned": loop.abandoned, **stored})  # fmt: skip

    if opts.api_key:
        app.add_middleware(_Authorized, key=opts.api_key)
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
    sock = _listen(opts.host, opts.port)
    objects = MooncakeObjects(opts.mooncake, opts.spool_ttl) if opts.mooncake else None
    try:
        return _serve(cfg, opts, log, shape, aux_ids, tokenizer, unparsed, objects, sock)
    finally:  # whatever failed (the engine's start too), our segment leaves the store and nothing of ours stays
        sock.close()
        if objects:
            objects.close()


def _spool_folder(opts: ServeOptions, log) -> tuple[Path, int]:
    """A fresh folder of ours in the spool, held for the server's life, readable and deletable by the trainer
    as the umask allows (another user's trainer: a group or a umask of 002); dead servers' rows swept first."""
    root = opts.spool or Path(tempfile.gettempdir())
    try:
        root.mkdir(parents=True, exist_ok=True)
        folders, freed = sweep_dead_servers(root)
        if folders:
            log(f"removed {freed / 2**20:,.1f} MiB of rows that {folders} servers which did not stop cleanly left "
                f"in {root}")  # fmt: skip
        folder = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX, dir=root)).resolve()
        umask = os.umask(0o022)
        os.umask(umask)
        folder.chmod(0o777 & ~umask)
        return folder, hold_folder(folder)
    except OSError as exc:
        raise ExtractError(f"--spool {root}: cannot make a folder there ({exc.strerror}); pass a writable --spool")


def _serve(cfg, opts: ServeOptions, log, shape, aux_ids, tokenizer, unparsed, objects, sock) -> int:
    if objects:
        objects.connect()  # before the engine: a master that does not answer is one line, now
    folder, held = _spool_folder(opts, log)
    limit = int(opts.spool_bytes or shutil.disk_usage(folder).free * SPOOL_SHARE)
    spool = Spool(folder, limit, opts.spool_ttl)
    dtype = shape.dtype if cfg.dtype == "auto" else cfg.dtype
    width = 1 if cfg.fp8 else (4 if dtype in ("float32", "float") else 2)
    per_token = (len(aux_ids) + 1) * shape.hidden_size * width + 8 + (4 if cfg.fp8 else 0)
    name = opts.served_model_name or cfg.model
    if opts.whole_context and shape.context:  # up to SERVE_LENGTH: a 1M-token context's KV cache may not fit
        cfg = replace(cfg, seq_length=min(shape.context - 1, SERVE_LENGTH))
    max_model_len = min(cfg.seq_length + 1, shape.context or cfg.seq_length + 1)
    vocab = shape.vocab_size or len(tokenizer)  # the embedding's rows: an id past them is no token of the model's
    # max_model_len - 1: vLLM refuses a prompt of max_model_len tokens
    requests = Requests(name, tokenizer, max_model_len - 1, per_token, vocab, unparsed)
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
        llm = capture_engine(cfg, max_model_len, folder, aux_ids, watch)
        loop = EngineLoop(llm, spool, cfg.batch_size, watch, run_log.note)
        loop.start()
        http = _Server(make_app(loop, spool, requests, opts, requests.longest, objects), opts, loop)
        # from here to the end of the cleanup, SIGTERM and Ctrl-C stop the server instead of raising
        saved = {sig: signal.signal(sig, http.stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            status = _serve_http(loop, spool, http, run_log, f"http://{opts.host}:{opts.port}/v1 (model {name})",
                                 objects, sock)  # fmt: skip
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
        os.close(held)
        if loop.failed and not interrupted():
            raise ExtractError(f"the engine failed: {loop.failed}; the server stopped (the log: {log_path})")
    return 0 if interrupted() else status


class _Server:
    """uvicorn's server with our signal handling: SIGTERM or Ctrl-C stops taking requests and lets those in
    flight finish (a second Ctrl-C: at once), and nothing is raised again afterwards."""

    def __init__(self, app, opts: ServeOptions, loop: EngineLoop) -> None:
        import uvicorn

        config = uvicorn.Config(app, host=opts.host, port=opts.port, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=GRACE_S, access_log=False,
                                limit_concurrency=opts.max_requests + CONNECTIONS_BEYOND)  # fmt: skip

        class Quiet(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                yield

        self.server = Quiet(config)
        self.app, self.loop = app, loop

    def stop(self, signum=None, frame=None) -> None:
        """A terminal's Ctrl-C reaches vLLM's engine processes too, which stop at once: what fails after it
        is the stop asked for (requests still in flight get 503), not an engine failure.  A signal that comes
        after the engine failed is no interrupt: the server is stopping for the failure, and exits 1."""
        if not self.loop.failed:
            note_interrupt()
        if self.server.should_exit and signum == signal.SIGINT:
            self.server.force_exit = True
        self.server.should_exit = True


PROGRESS_S = 30  # seconds between the server's progress lines
CONNECTIONS_BEYOND = 128  # connections beyond --max-requests (idle keep-alive ones, /health): more get 503
GRACE_S = 20  # seconds the requests in flight get at shutdown; then their files get COLLECT_S to be read
COLLECT_S = 5


def _serve_http(
    loop: EngineLoop, spool: Spool, http: _Server, run_log, where: str, objects: MooncakeObjects | None, sock
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
        http.app.state.stopping = True  # requests not yet in the engine get 503 now; those in it are answered
        loop.stopping.set()
        for give_up in list(http.app.state.live):
            give_up.set()

    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
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
