"""The server's HTTP routes, as speculators' online loader calls them: OpenAI-style `GET /v1/models`,
`POST /v1/completions` and `POST /v1/chat/completions` answered with each row's file (or Mooncake object), and
`GET /health`; OpenAI's error bodies; the API key; the body's bound; a client that goes away."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ..config import ServeOptions
from ..errors import RequestError
from ..files.rowfile import row_file_bytes
from ..files.spool import Spool
from ..job.continuous import STOPPING, EngineLoop
from .mooncake import MooncakeObjects, StoreUnavailable
from .requests import Requests, body_limit, too_large


def _error(status: int, message: str, param: str | None = None):
    kinds = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
             413: "RequestTooLargeError", 499: "ClientClosedRequest", 503: "ServiceUnavailableError"}  # fmt: skip
    body = {"message": message, "type": kinds.get(status, "ServerError"), "param": param, "code": status}
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return JSONResponse({"error": body}, status_code=status, headers=headers)


WRONG_KEY = "missing or wrong API key: send 'Authorization: Bearer <key>'"


def authorized(scope, key: str) -> bool:
    """The request carries `Authorization: Bearer <key>` (the scheme in any case, the key compared in constant
    time): by the routes, and first by `serve --replicas`' front."""
    scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode())


class _Authorized:
    """Every request must carry the API key.  Plain ASGI, not a Starlette middleware: it passes the connection's
    own `receive` on, so a client that goes away is seen by the route."""

    def __init__(self, app, key: str) -> None:
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not authorized(scope, self.key):
            return await _error(401, WRONG_KEY)(scope, receive, send)
        return await self.app(scope, receive, send)


async def read_body(request: Request, longest: int) -> bytes:
    """The body, refused past its bound (what a prompt of `longest` tokens needs) before it is read whole: by the
    routes, and first by `serve --replicas`' front."""
    limit = body_limit(longest)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise RequestError(too_large(int(length), longest), status=413)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestError(too_large(size, longest), status=413)
            chunks.append(chunk)
    except ClientDisconnect:  # gone while it sent its body: nothing to answer
        raise RequestError("the client went away", status=499) from None
    return b"".join(chunks)


async def _client_gone(request: Request) -> None:
    """Returns once the client has closed its connection (the body is read: the next message is the close)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def run_asgi(app, method: str, path: str, query: bytes, headers: list, body: bytes) -> tuple[int, list, bytes]:
    """One request `serve --replicas`' front read, through `app` in this process (a replica's routes): its status,
    headers and body.  After the body the app hears nothing: a client that goes away is this call's cancellation
    (make_app's `cancelled_by_host`)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "", "headers": headers,
             "server": None, "client": None}  # fmt: skip
    unread, start, chunks = [body], {}, []

    async def receive() -> dict:
        if not unread:
            await asyncio.Event().wait()
        return {"type": "http.request", "body": unread.pop(), "more_body": False}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            start.update(message)
        else:
            chunks.append(message.get("body", b""))

    try:
        await app(scope, receive, send)
    except Exception:  # Starlette raises a route's error again after answering 500: the answer stands, logged
        if not start:
            raise
        logging.getLogger(__name__).exception("a request failed (answered 500)")
    return start["status"], start.get("headers", []), b"".join(chunks)


def make_app(
    loop: EngineLoop,
    spool: Spool,
    requests: Requests,
    opts: ServeOptions,
    seq_length: int,
    objects: MooncakeObjects | None = None,
    cancelled_by_host: bool = False,
):
    """The routes of one engine.  `cancelled_by_host`: the host cancels a request whose client went away (`serve
    --replicas`' front does), so the route does not watch the connection itself (uvicorn's case)."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    app.state.live = set()  # each request's give-up event: set when its client goes, or when the server stops
    app.state.cleanups = set()  # abandoned requests' cleanups, held until done
    app.state.fleet = None  # serve --replicas: the counts of every replica, for /health
    app.state.stopping = False
    metrics = Metrics(loop, spool, app.state.live, objects)
    waiting_for_room = ThreadPoolExecutor(opts.max_requests, thread_name_prefix="eagle-spool-room")

    @app.exception_handler(RequestError)
    async def _bad(request, exc: RequestError):
        return _error(exc.status, str(exc), exc.param)

    @app.exception_handler(HTTPException)
    async def _http(request, exc: HTTPException):
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return _error(exc.status_code, message.get(exc.status_code, str(exc.detail)))

    async def body_of(request: Request) -> dict:
        """The body, parsed off the event loop."""
        return await asyncio.to_thread(requests.parse, await read_body(request, requests.longest))

    async def states(ids: list[int], give_up: threading.Event, futures: list) -> tuple[str, dict]:
        """The row's name and the answer's kv_transfer_params: its file's path, or its Mooncake object's manifest.
        Waiting for spool room takes a thread of its own pool (no other request's parsing or tokenizing waits
        behind it), putting into the store one of the store's pool."""
        if objects is not None:
            objects.refuse_unfitting(len(ids) * requests.bytes_per_token)  # an object holds no header
        nbytes = row_file_bytes(len(ids), requests.bytes_per_token)  # the file's header too: the bound holds
        await asyncio.get_running_loop().run_in_executor(waiting_for_room, spool.admit, nbytes, give_up)
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
        give_up, futures, t0 = threading.Event(), [], time.perf_counter()
        app.state.live.add(give_up)
        if app.state.stopping:  # the stop began while this request came in: it gives up with the others
            give_up.set()
        work = asyncio.create_task(states(ids, give_up, futures))
        gone = None if cancelled_by_host else asyncio.create_task(_client_gone(request))
        try:
            await asyncio.wait({work, gone} - {None}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the host (serve --replicas' front) cancels a request whose client went away
            cleanup = asyncio.get_running_loop().create_task(abandon(work, give_up, futures))
            app.state.cleanups.add(cleanup)
            cleanup.add_done_callback(app.state.cleanups.discard)
            raise
        finally:
            app.state.live.discard(give_up)
        if gone is None or not gone.done():
            if gone is not None:
                gone.cancel()
            answered = work.result()
            metrics.row_seconds.observe(time.perf_counter() - t0)
            return answered
        await abandon(work, give_up, futures)
        raise RequestError("the client went away", status=499)

    async def abandon(work: asyncio.Task, give_up: threading.Event, futures: list) -> None:
        give_up.set()
        if futures and futures[0].cancel():  # not yet answered: the engine loop drops it, or removes its file
            return  # once written, and counts it
        with contextlib.suppress(BaseException):
            row, params = await work
            if "hidden_states_path" in params:
                spool.remove(Path(params["hidden_states_path"]))
            else:
                await asyncio.get_running_loop().run_in_executor(objects.pool, objects.remove, row)
            loop.count_abandoned()  # answered, to nobody: its row is removed
        if not futures:  # it never reached the engine
            loop.count_abandoned()

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
        fleet = app.state.fleet() if app.state.fleet else {}  # serve --replicas: which replica answers, and all
        return JSONResponse({"status": "ok", "spool_bytes": spool.used(), "rows": loop.rows, "run_again": loop.redone,
                             "requests_held": len(app.state.live), "waiting_for_room": spool.waiting_for_room(),
                             "abandoned": loop.abandoned, **stored, **fleet})  # fmt: skip

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if opts.api_key:
        app.add_middleware(_Authorized, key=opts.api_key)
    return app


class Metrics:
    """`GET /metrics` in Prometheus' text format, read from the server's own counters at each scrape (a registry
    of its own: vLLM's metrics are not ours).  A trainer starved for data shows as requests waiting and rising
    row seconds; a server starved for requests as the engine's seconds waiting for one."""

    def __init__(self, loop: EngineLoop, spool: Spool, live: set, objects: MooncakeObjects | None) -> None:
        from prometheus_client import CollectorRegistry, Histogram

        self.loop, self.spool, self.live, self.objects = loop, spool, live, objects
        self.registry = CollectorRegistry(auto_describe=True)
        self.row_seconds = Histogram(
            "eagle_extract_row_seconds", "Seconds from a request's arrival to its answer (rows answered 200).",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=self.registry,
        )  # fmt: skip
        self.registry.register(self)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        loop, counters = self.loop, {
            "rows": ("Rows served.", self.loop.rows),
            "tokens": ("Prompt tokens served.", self.loop.tokens),
            "rows_run_again": ("Rows run again because the matcher could not bind them for sure.", self.loop.redone),
            "requests_abandoned": ("Requests whose client went away before their answer.", self.loop.abandoned),
            "engine_steps": ("Engine steps.", self.loop.steps),
            "engine_step_seconds": ("Seconds in engine steps (the engine busy).", self.loop.step_s),
            "engine_wait_seconds": ("Seconds waiting for the capture's workers between steps.", self.loop.drain_s),
            "engine_wait_worker_seconds": ("Of engine_wait_seconds: the workers' own seconds answering.",
                                           self.loop.worker_s),
            "engine_starved_seconds": ("Seconds with nothing in flight, waiting for a request.", self.loop.starved_s),
        }  # fmt: skip
        for name, (what, value) in counters.items():
            yield CounterMetricFamily(f"eagle_extract_{name}", what, value=value)
        gauges = {
            "requests_held": ("Requests held: waiting for spool room, for the engine, or in it.", len(self.live)),
            "requests_waiting_for_room": ("Requests waiting for room in the spool.", self.spool.waiting_for_room()),
            "requests_waiting_for_engine": ("Requests taken, not yet in the engine.", loop.waiting()),
            "spool_bytes": ("Bytes of the spool's files and rows in flight.", self.spool.used()),
            "spool_limit_bytes": ("The spool's bound (--spool-bytes).", self.spool.limit),
            "engine_failed": ("1 once the engine has failed.", int(bool(loop.failed))),
        }  # fmt: skip
        if self.objects is not None:
            gauges["store_bytes"] = ("Bytes of the Mooncake objects not yet collected.", self.objects.used())
        for name, (what, value) in gauges.items():
            yield GaugeMetricFamily(f"eagle_extract_{name}", what, value=value)
