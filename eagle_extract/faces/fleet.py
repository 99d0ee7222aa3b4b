"""`serve --replicas N`: N engines behind one endpoint, as Ray Serve replicas of the one-engine server
(serve.engine_server: the same loop, matcher, writer and routes), on this machine or on a Ray cluster.

Ray Serve's proxy takes the requests on --host/--port (on every node of a cluster) and gives each to the front,
one replica that reads its body (the proxy routes before it is read) and hands it on: a prompt in flight draws its
copies to the replica running it (an engine runs identical prompts in flight once), any other request goes to the
replica with the fewest rows outstanding; the replica that runs a row answers it.  A replica whose engine fails is
restarted (its requests get 503, which speculators' client retries, and the others serve meanwhile; the new one
sweeps the dead one's rows).  SIGTERM or Ctrl-C stops every replica, each removing its files, then the Ray of
our own.  The replicas' lines and counts reach this process through a small actor, the tally.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import ray
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.request_router import RequestRouter
from starlette.requests import Request
from starlette.responses import Response

from ..config import ExtractConfig, ServeOptions
from ..errors import ExtractError, RequestError
from ..interrupts import note_interrupt, stop_on_signals
from ..job.engine import cpu_thread_binding, on_gpu
from . import routing
from .routes import WRONG_KEY, _error, authorized, read_body, run_asgi
from .serve import COLLECT_S, GRACE_S, PROGRESS_S, _listen, engine_length, engine_server, prepare

APP = "eagle-extract"  # the Ray Serve application: one server per Ray cluster (its HTTP port is the cluster's)
NAMESPACE = "eagle-extract"
TALLY = "eagle-extract-tally"
GONE_S = 10.0  # a replica whose counts have not come for this long has gone
HEALTH_PERIOD_S = 2.0  # how often Ray Serve asks each replica whether its engine still runs
STOP_S = 120.0  # a replica's own stop at the end (requests answered, files read, engine stopped) may take this
ENV_PREFIXES = ("VLLM_", "HF_", "TRANSFORMERS_", "EAGLE_EXTRACT_", "MOONCAKE_")  # the replicas see ours ...
PER_NODE = ("MOONCAKE_LOCAL_HOSTNAME", "VLLM_HOST_IP", "VLLM_PORT")  # ... but a node's own address: its own
FRONT_SPARE = 64  # the front's requests beyond every replica's --max-requests (/health, /metrics)


class SamePromptFewestRows(RequestRouter):
    """The router of the front's handle to the replicas (the only way requests reach them): the choice is the
    ledger's; the front sends each request's prompt key and its own token as the session id."""

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if pending_request is None or not candidate_replicas:
            return [candidate_replicas]
        key, _, token = (pending_request.metadata.session_id or "").partition(" ")
        pending_request.routing_context.should_backoff = True  # every replica full: wait a little, ask again
        chosen = routing.LEDGER.choose(token, key, candidate_replicas)
        return [[chosen]] if chosen is not None else []


class Front:
    """The endpoint's one replica before the engines: Ray Serve's proxy routes a request before its body is read,
    so the front reads it (refusing a wrong API key, then a body past the bound, as the routes do), keys its
    prompt for the router, and answers what the replica that ran it answered, byte for byte."""

    def __init__(self, capture, longest: int, api_key: str | None) -> None:
        self.capture, self.longest, self.api_key = capture, longest, api_key

    async def __call__(self, request: Request) -> Response:
        if self.api_key and not authorized(request.scope, self.api_key):
            return _error(401, WRONG_KEY)
        try:
            body = await read_body(request, self.longest)
        except RequestError as exc:
            return _error(exc.status, str(exc), exc.param)
        path, token = request.scope["path"], uuid.uuid4().hex
        session = f"{routing.prompt_key(path, body)} {token}"  # what the router reads
        response = self.capture.options(method_name="http", session_id=session).remote(
            request.method, path, request.scope["query_string"], request.headers.raw, body
        )
        try:
            status, headers, content = await response
        except asyncio.CancelledError:  # its client went away: the replica's call is not cancelled with this one
            response.cancel()
            raise
        except (RayActorError, DeploymentUnavailableError) as exc:
            return _error(503, f"the replica that held this request stopped ({type(exc).__name__}); ask again")
        finally:
            routing.LEDGER.end(token)
        answer = Response(content, status)
        answer.raw_headers = headers
        return answer


class Tally:
    """The replicas' counts and lines, for this process's progress lines and every replica's /health."""

    def __init__(self) -> None:
        self.counts: dict[str, tuple[float, dict]] = {}  # by replica id: Ray Serve gives a successor the same rank
        self.lines: list[tuple[int, str]] = []
        self.failures: list[tuple[int, str]] = []
        self.stopping = False

    def put(self, replica: str, counts: dict) -> bool:
        """Returns whether the server is stopping."""
        self.counts[replica] = (time.time(), counts)
        return self.stopping

    def stop(self) -> None:
        self.stopping = True

    def say(self, rank: int, line: str) -> None:
        self.lines.append((rank, line))

    def failed(self, rank: int, message: str) -> None:
        self.failures.append((rank, message))

    def read(self) -> dict:
        """The replicas alive: seen in the last GONE_S (a replica Ray Serve replaced goes, its rows stay counted)."""
        now = time.time()
        return {replica: {**c, "seconds_since_seen": round(now - at, 1)} for replica, (at, c) in self.counts.items()
                if now - at < GONE_S}  # fmt: skip

    def rows(self) -> tuple[int, int]:
        """Rows served by every replica there was, and how many replicas that was."""
        return sum(c["rows"] for _, c in self.counts.values()), len(self.counts)

    def take(self) -> tuple[list, list]:
        lines, failures, self.lines, self.failures = self.lines, self.failures, [], []
        return lines, failures


class CaptureReplica:
    """One replica: the one-engine server, its routes given the requests the front read."""

    def __init__(self, cfg: ExtractConfig, opts: ServeOptions, seen_mark: str | None) -> None:
        context = serve.get_replica_context()
        self.rank, self.replica_id = context.rank.rank, context.replica_id.unique_id
        self.tally = ray.get_actor(TALLY, namespace=NAMESPACE)
        self.stack, self.closing, self.fleet = contextlib.ExitStack(), threading.Event(), {}
        try:
            if seen_mark and not Path(seen_mark).exists():
                where = f"--spool {opts.spool}" if opts.spool else "the default spool (each node's temporary folder)"
                raise ExtractError(
                    f"{where}: node {socket.gethostname()} does not see the folder the server's own node sees "
                    "there; pass a --spool every node and the trainer see (NFS, Lustre), or --transfer mooncake"
                )
            if not on_gpu():  # a CPU: this replica's share of this machine's cores
                local = context.rank.local_rank
                cores = sorted(os.sched_getaffinity(0))
                per = max(cfg.tp, len(cores) // opts.replicas)
                share = cores[local * per : (local + 1) * per] or cores[-per:]
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(cfg.tp, share)
            prepared = prepare(cfg, opts, self.say)
            self.core = self.stack.enter_context(
                engine_server(cfg, opts, self.say, prepared, 1 / opts.replicas, in_replica=True)
            )
        except BaseException as exc:
            self.tally.failed.remote(self.rank, str(exc) if isinstance(exc, ExtractError) else repr(exc))
            raise
        self.core.app.state.fleet = self.read_fleet
        threading.Thread(target=self._janitor, daemon=True, name="eagle-replica-spool").start()

    async def http(self, method: str, path: str, query: bytes, headers: list, body: bytes) -> tuple[int, list, bytes]:
        return await run_asgi(self.core.app, method, path, query, headers, body)

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.tally.say.remote(self.rank, line)

    def read_fleet(self) -> dict:
        return {"replica": self.rank, "replicas": self.fleet}

    def counts(self) -> dict:
        loop, spool = self.core.loop, self.core.spool
        return {"rank": self.rank, "node": socket.gethostname(), "pid": os.getpid(), "rows": loop.rows,
                "tokens": loop.tokens,
                "run_again": loop.redone, "abandoned": loop.abandoned, "spool_bytes": spool.used(),
                "requests_held": len(self.core.app.state.live), "failed": self.core.failed()}  # fmt: skip

    def _janitor(self) -> None:
        told = False
        while not self.closing.wait(0.5):
            self.core.sweep()
            if self.core.failed() and not told:
                told = True
                self.say(f"the engine failed: {self.core.failed()}; Ray Serve starts this replica again")
            with contextlib.suppress(Exception):  # the tally is gone: the server is stopping
                if ray.get(self.tally.put.remote(self.replica_id, self.counts()), timeout=5):
                    self.core.stop_taking()  # the server stops: requests not yet in the engine get 503 now
                self.fleet = ray.get(self.tally.read.remote(), timeout=5)

    def check_health(self) -> None:
        """Ray Serve restarts a replica whose engine failed."""
        if self.core.failed():
            raise RuntimeError(f"replica {self.rank}: the engine failed: {self.core.failed()}")

    def __del__(self) -> None:
        """Ray Serve's stop: the requests in it were answered; their files get COLLECT_S to be read."""
        if not hasattr(self, "core"):
            return
        self.closing.set()
        self.core.stop_taking()
        self.core.collected(COLLECT_S)
        try:
            self.stack.close()
        except ExtractError as exc:
            self.say(str(exc))


def serve_replicas(cfg: ExtractConfig, opts: ServeOptions, log=print) -> int:
    """`opts.replicas` engines behind one endpoint until SIGTERM or Ctrl-C; returns the exit status."""
    shape = prepare(cfg, opts, log)[0]  # every check before any engine: once, here
    longest = engine_length(cfg, opts, shape)[1] - 1  # the longest prompt a replica takes: the front's body bound
    if opts.spool:  # the replicas' working folder is Ray's: local paths as absolute ones
        opts = replace(opts, spool=opts.spool.resolve())
    if Path(cfg.model).exists():
        cfg = replace(cfg, model=str(Path(cfg.model).resolve()))
    _listen(opts.host, opts.port).close()  # the port is free: Ray Serve's proxy takes it next
    logging.getLogger("ray").setLevel(logging.ERROR)
    logging.getLogger("ray.serve").setLevel(logging.ERROR)
    own_ray = opts.ray_address is None
    if not own_ray:
        _refuse_unreachable(opts.ray_address)
    elif not on_gpu() and opts.replicas * cfg.tp > len(os.sched_getaffinity(0)):
        raise ExtractError(f"--replicas {opts.replicas} --tp {cfg.tp} needs {opts.replicas * cfg.tp} CPU cores, "
                           f"{len(os.sched_getaffinity(0))} available; lower --replicas")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES) and k not in PER_NODE}
    try:
        ray.init(address="local" if own_ray else opts.ray_address, namespace=NAMESPACE, include_dashboard=False,
                 log_to_driver=False, logging_level=logging.ERROR, runtime_env={"env_vars": env})  # fmt: skip
    except Exception as exc:  # Ray raises ConnectionError, RuntimeError or ValueError here
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if own_ray:
            raise ExtractError(f"--replicas {opts.replicas}: Ray did not start on this machine ({first})") from None
        raise ExtractError(f"--ray-address {opts.ray_address}: Ray could not join the cluster there ({first}); "
                           "check that it runs the same Ray and Python releases as this machine") from None  # fmt: skip
    stop_on_signals()  # ray.init made SIGTERM exit at once: until the server serves, it interrupts the start
    mark = None
    try:
        _refuse_unfitting(cfg, opts)
        if opts.transfer == "file":
            mark = _mark_spool(opts)
        return _run(cfg, opts, log, mark, longest)
    finally:
        if mark:
            with contextlib.suppress(OSError):
                mark.unlink()
        ray.shutdown()  # our own Ray stops with it; a cluster's stays


def _refuse_unreachable(address: str) -> None:
    """Ray itself retries an unreachable head for minutes, printing as it goes: one look first, one line."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ExtractError(f"--ray-address {address}: give the Ray head's HOST:PORT (e.g. 10.0.0.1:6379)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
    except OSError as exc:
        raise ExtractError(f"--ray-address {address}: no Ray cluster answers there ({exc.strerror or exc}); start "
                           "one (`ray start --head` on its first node) or pass its HOST:PORT") from None  # fmt: skip


def _refuse_unfitting(cfg: ExtractConfig, opts: ServeOptions) -> None:
    """--replicas × --tp against the cluster's GPUs, each replica's on one node (a CPU's cores: before Ray)."""
    running = False
    with contextlib.suppress(Exception):  # no Serve on the cluster yet
        running = APP in serve.status().applications
    if running:
        raise ExtractError(f"the Ray cluster at {opts.ray_address} already runs an eagle-extract server; stop it, "
                           "or pass another --ray-address")  # fmt: skip
    gpus = ray.cluster_resources().get("GPU", 0)
    if gpus:
        nodes = [n["Resources"].get("GPU", 0) for n in ray.nodes() if n["Alive"]]
        if sum(int(n // cfg.tp) for n in nodes) < opts.replicas:  # each replica's GPUs on one node
            raise ExtractError(
                f"--replicas {opts.replicas} --tp {cfg.tp} needs {opts.replicas * cfg.tp} GPUs, {cfg.tp} on each "
                f"replica's node; the Ray cluster has {gpus:g} (nodes of {', '.join(f'{n:g}' for n in nodes)}); lower "
                "--replicas or --tp, or add nodes (`ray start --address`)"
            )


def _mark_spool(opts: ServeOptions) -> Path:
    """A file of ours in the spool's folder, which every replica must see there (a node that does not cannot
    give its trainer its files)."""
    root = opts.spool or Path(tempfile.gettempdir())
    try:
        root.mkdir(parents=True, exist_ok=True)
        mark = root / f".eagle-extract-seen-{uuid.uuid4().hex}"
        mark.touch()
    except OSError as exc:
        raise ExtractError(f"--spool {root}: cannot write there ({exc.strerror}); pass a writable --spool") from None
    return mark


def _run(cfg: ExtractConfig, opts: ServeOptions, log, mark: Path | None, longest: int) -> int:
    tally = ray.remote(num_cpus=0)(Tally).options(name=TALLY, namespace=NAMESPACE).remote()
    gpus = ray.cluster_resources().get("GPU", 0)
    resources = {"num_cpus": 0, "num_gpus": cfg.tp} if gpus else {"num_cpus": 0}  # a CPU: cores bound by the replica
    serve.start(http_options={"host": opts.host, "port": opts.port},
                logging_config={"log_level": "ERROR", "enable_access_log": False})  # fmt: skip
    quiet = {"log_level": "WARNING", "enable_access_log": False}  # not a line a request in the logs
    capture = serve.deployment(
        CaptureReplica,
        name="capture",
        num_replicas=opts.replicas,
        ray_actor_options=resources,
        max_ongoing_requests=opts.max_requests,
        health_check_period_s=HEALTH_PERIOD_S,
        health_check_timeout_s=60,
        graceful_shutdown_wait_loop_s=1,
        graceful_shutdown_timeout_s=GRACE_S + STOP_S,
        max_constructor_retry_count=opts.replicas,
        request_router_config=RequestRouterConfig(request_router_class=SamePromptFewestRows),
        logging_config=quiet,
    )
    front = serve.deployment(
        Front,
        name="front",
        num_replicas=1,  # one router, so it sees every request in flight
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=opts.replicas * opts.max_requests + FRONT_SPARE,
        graceful_shutdown_wait_loop_s=1,
        graceful_shutdown_timeout_s=GRACE_S + STOP_S,  # the replicas' answers at the stop still go out through it
        logging_config=quiet,
    )
    started: dict = {}

    def start() -> None:
        try:
            replicas = capture.bind(cfg, opts, str(mark) if mark else None)
            serve.run(front.bind(replicas, longest, opts.api_key), name=APP, route_prefix="/")
            started["ok"] = True
        except Exception as exc:  # noqa: BLE001 - the replicas' own failure, from the tally, is the line shown
            started["error"] = exc

    def relay() -> list[tuple[int, str]]:
        lines, failures = ray.get(tally.take.remote())
        for rank, line in lines:
            log(f"replica {rank}: {line}")
        return failures

    threading.Thread(target=start, daemon=True, name="eagle-serve-start").start()
    stop, saved, ended = threading.Event(), {}, False
    try:
        while not started:
            failures = relay()
            if failures:  # the first replica that failed names the cause (the same for every one, mostly)
                rank, message = failures[0]
                raise ExtractError(f"replica {rank} did not start: {message}")
            time.sleep(0.5)
        failures = relay()
        if "error" in started:
            why = failures[0][1] if failures else str(started["error"]).strip().splitlines()[-1]
            raise ExtractError(f"the replicas did not start: {why}")

        def on_signal(signum, frame) -> None:
            note_interrupt()
            stop.set()

        # from here to the end of the stop, SIGTERM and Ctrl-C stop the server instead of raising
        saved = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        log(f"serving http://{opts.host}:{opts.port}/v1 (model {opts.served_model_name or cfg.model}, "
            f"{opts.replicas} replicas)")  # fmt: skip
        said, shown, failing = time.monotonic(), 0, []
        while not stop.wait(0.5):
            restarts = relay()
            if restarts or failing:
                counts = ray.get(tally.read.remote())
                serving = any(not c["failed"] for c in counts.values())
                for rank, message in restarts:
                    others = "the other replicas serve on" if serving else "no replica serves; Ray Serve tries again"
                    log(f"replica {rank} did not start again: {message}; {others}")
                failing = _still_failing(failing + restarts, counts, opts.replicas)
            if time.monotonic() - said > PROGRESS_S:
                said, counts = time.monotonic(), ray.get(tally.read.remote())
                if sum(c["rows"] for c in counts.values()) != shown:  # progress, while there is any
                    shown = sum(c["rows"] for c in counts.values())
                    log(_progress(counts))
        log("stopping: the requests in flight are answered")
        ended = True
    finally:
        try:
            status = _stop(log, tally, relay, ended)
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)
    return status


def _still_failing(failing: list[tuple[int, str]], counts: dict, replicas: int) -> list[tuple[int, str]]:
    """The restarts that failed since a replica last served: none while one serves (asked every turn while any
    failed, so replicas that came back start the count again).  Once every replica's restart has failed twice
    with none serving, raises: Ray Serve would try again for ever, and the trainers wait on 503s.  (A replica
    still loading its model has not failed: the server waits for it.)"""
    if any(not c["failed"] for c in counts.values()):
        return []
    tries = collections.Counter(rank for rank, _ in failing)  # a replica's successor has its rank
    if len(tries) >= replicas and min(tries.values()) >= 2:
        rank, message = failing[-1]
        raise ExtractError(f"no replica could start again ({len(failing)} tries; the last, replica {rank}: {message}); "
                           "the server stops: fix that and start it again")  # fmt: skip
    return failing


def _stop(log, tally, relay, ended: bool) -> int:
    """Every replica's own stop (its requests answered, its engine stopped, its files removed), then Serve's;
    the closing line when the server had been serving.  Returns the exit status."""
    status = 0
    with contextlib.suppress(Exception):
        ray.get(tally.stop.remote())  # requests not yet in an engine get 503 now
        time.sleep(1)
    try:
        serve.delete(APP)
        if not serve.status().applications:  # Serve's proxies and controller, on a cluster too
            serve.shutdown()
    except Exception as exc:  # noqa: BLE001 - said in one line; the exit status says it too
        log(f"warning: Ray Serve did not stop the replicas ({type(exc).__name__}: {exc}); check the cluster "
            "with `serve status` for engines left running")  # fmt: skip
        status = 1
    with contextlib.suppress(Exception):
        relay()
    if ended:
        rows, replicas = ray.get(tally.rows.remote())
        removed = "their spools' files are removed" if status == 0 else "their spools' files may remain"
        log(f"stopped: {rows} rows served by {replicas} replicas; {removed}")
    return status


def _progress(counts: dict) -> str:
    rows = sum(c["rows"] for c in counts.values())
    each = ", ".join(f"replica {c['rank']}: {c['rows']} rows, {c['requests_held']} held"
                     + (" (its engine failed)" if c["failed"] else "")
                     for c in sorted(counts.values(), key=lambda c: c["rank"]))  # fmt: skip
    return f"{rows} rows served; {each}"
