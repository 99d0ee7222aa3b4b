"""`eagle-extract serve`: speculators' online trainer asks for each row's states over HTTP.

This module starts and stops the server: its checks, the port (held from before the engine's start), its folder
in the spool (dead servers' rows swept first), the engine with the capture installed, the engine loop
(job/continuous.py), uvicorn with the routes (routes.py), progress lines, and SIGTERM or Ctrl-C, after which
the requests in the engine are answered and every file of ours is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ..config import ExtractConfig, ServeOptions
from ..data.formats import DataError
from ..data.samples import check_template
from ..errors import ExtractError, engine_errors
from ..files.rowfile import row_file_bytes
from ..files.spool import Spool, folder_prefix, hold_folder, sweep_dead_servers
from ..interrupts import interrupted, note_interrupt
from ..job.continuous import EngineLoop, capture_engine
from ..job.engine import prefill_note
from ..job.plan import model_layers
from ..job.preflight import check_options, check_serve_options, check_weights, load_tokenizer
from ..job.watch import EngineWatch
from ..runlog import RunLog
from . import routes
from .mooncake import MooncakeObjects
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


def token_bytes(cfg: ExtractConfig, shape, aux_ids: list[int]) -> int:
    """A row file's bytes per token: every slot's states and the token's id (and FP8's scales)."""
    dtype = shape.dtype if cfg.dtype == "auto" else cfg.dtype
    width = 1 if cfg.fp8 else (4 if dtype in ("float32", "float") else 2)
    return (len(aux_ids) + 1) * shape.hidden_size * width + 8 + (4 if cfg.fp8 else 0)


def prepare(cfg: ExtractConfig, opts: ServeOptions, log=print):
    """The checks made before any engine starts, and what every engine of the server needs from them."""
    check_options(cfg)
    check_serve_options(cfg, opts)
    shape, aux_ids = model_layers(cfg)
    per_token = token_bytes(cfg, shape, aux_ids)
    if opts.spool_bytes and opts.spool_bytes / opts.replicas < row_file_bytes(1, per_token):  # every request: 413
        split = f" split among {opts.replicas} replicas" if opts.replicas > 1 else ""
        raise ExtractError(
            f"--spool-bytes {opts.spool_bytes:,.0f}{split} holds no row: a one-token row file takes "
            f"{row_file_bytes(1, per_token):,} bytes here, a 1,024-token one {row_file_bytes(1024, per_token):,}; "
            "pass a larger --spool-bytes"
        )
    check_weights(cfg)
    tokenizer = load_tokenizer(cfg)
    try:
        check_template(tokenizer)
        unparsed = None
    except DataError as exc:  # the trainer's requests carry token ids: the server serves those
        log(f"warning: {exc}; until then chat requests are refused, and prompt token ids are served")
        unparsed = UNPARSED_TEMPLATE
    return shape, aux_ids, tokenizer, unparsed


def serve(cfg: ExtractConfig, opts: ServeOptions, log=print) -> int:
    """Run the one-engine server until SIGTERM or Ctrl-C; returns the exit status.  `cfg` must be resolved()."""
    shape, aux_ids, tokenizer, unparsed = prepare(cfg, opts, log)
    sock = _listen(opts.host, opts.port)
    saved: dict = {}
    try:
        with engine_server(cfg, opts, log, (shape, aux_ids, tokenizer, unparsed)) as core:
            http = _Server(core.app, opts, core.loop)
            # from here to the end of the cleanup, SIGTERM and Ctrl-C stop the server instead of raising
            saved = {sig: signal.signal(sig, http.stop) for sig in (signal.SIGINT, signal.SIGTERM)}
            status = _serve_http(core, http, f"http://{opts.host}:{opts.port}/v1 (model {core.name})", sock)
    finally:
        sock.close()
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    return 0 if interrupted() else status


def _spool_folder(opts: ServeOptions, log) -> tuple[Path, int | None]:
    """A fresh folder of ours in the spool, held for the server's life, readable and deletable by the trainer
    as the umask allows (another user's trainer: a group or a umask of 002); dead servers' rows swept first."""
    root = opts.spool or Path(tempfile.gettempdir())
    try:
        root.mkdir(parents=True, exist_ok=True)
        folders, freed = sweep_dead_servers(root)
        if folders:
            log(f"removed {freed / 2**20:,.1f} MiB of rows that {folders} server{'s' * (folders > 1)} which did not "
                f"stop cleanly left in {root}")  # fmt: skip
        folder = Path(tempfile.mkdtemp(prefix=folder_prefix(), dir=root)).resolve()
        umask = os.umask(0o022)
        os.umask(umask)
        folder.chmod(0o777 & ~umask)
        held = hold_folder(folder)
        if held is None:
            log(f"warning: --spool {root} takes no file locks, so the rows of a server that dies without cleaning "
                "up are not swept by the next one; remove its folder's hidden_states/ by hand")  # fmt: skip
        return folder, held
    except OSError as exc:
        raise ExtractError(f"--spool {root}: cannot make a folder there ({exc.strerror}); pass a writable --spool")


@dataclass
class Core:
    """One engine's server: what `serve` runs once and `serve --replicas` once in each replica."""

    loop: EngineLoop
    spool: Spool
    app: object
    run_log: RunLog
    objects: MooncakeObjects | None
    name: str
    watch: EngineWatch

    def failed(self) -> str | None:
        return self.loop.failed or self.watch.failed

    def sweep(self) -> None:
        try:
            self.spool.sweep()
        except OSError as exc:  # a filesystem that fails one look (ESTALE, EIO) is looked at again
            self.run_log.note(f"the spool's sweep failed once: {exc}")

    def progress(self) -> str:
        objects = self.objects
        stored = objects and f"; Mooncake {objects.used() / 2**20:,.0f} MiB of {objects.limit / 2**20:,.0f}"
        return (f"{self.loop.summary()}; spool {self.spool.used() / 2**20:,.0f} MiB of "
                f"{self.spool.limit / 2**20:,.0f}{stored or ''}")  # fmt: skip

    def stop_taking(self) -> None:
        """Requests not yet in the engine get 503 now; those in it are answered."""
        self.app.state.stopping = True
        self.loop.stopping.set()
        self.spool.close()
        for give_up in list(self.app.state.live):
            give_up.set()

    def collected(self, within: float) -> None:
        """Wait up to `within` seconds for the last answers' files or objects to be read."""
        deadline = time.monotonic() + within
        while (self.spool.waiting() or self.objects and self.objects.waiting()) and time.monotonic() < deadline:
            if self.loop.failed:
                return
            time.sleep(0.1)


def engine_length(cfg: ExtractConfig, opts: ServeOptions, shape) -> tuple[ExtractConfig, int]:
    """The config the engine runs and its max_model_len (the longest prompt it takes is one less)."""
    if opts.whole_context and shape.context:  # up to SERVE_LENGTH: a 1M-token context's KV cache may not fit
        cfg = replace(cfg, seq_length=min(shape.context - 1, SERVE_LENGTH))
    return cfg, min(cfg.seq_length + 1, shape.context or cfg.seq_length + 1)


@contextlib.contextmanager
def engine_server(cfg: ExtractConfig, opts: ServeOptions, log, prepared, spool_share: float = 1.0,
                  in_replica: bool = False):  # fmt: skip
    """One engine with the capture installed, its spool folder, engine loop and routes; on leaving, the requests
    in the engine are answered, the engine stops and every file (and object) of ours is removed.
    `spool_share`: this engine's part of --spool-bytes.  `in_replica` (a Ray Serve replica): the front cancels a
    request whose client went away (the route does not watch for it), and a dead engine leaves the process
    running, its requests answered 503, until Ray Serve replaces it."""
    shape, aux_ids, tokenizer, unparsed = prepared
    objects = MooncakeObjects(opts.mooncake, opts.spool_ttl) if opts.mooncake else None
    try:
        if objects:
            objects.connect()  # before the engine: a master that does not answer is one line, now
        per_token = token_bytes(cfg, shape, aux_ids)
        folder, held = _spool_folder(opts, log)
        limit = int((opts.spool_bytes or shutil.disk_usage(folder).free * SPOOL_SHARE) * spool_share)
        spool = Spool(folder, limit, opts.spool_ttl, spool_share)  # replicas share one spool's filesystem
        name = opts.served_model_name or cfg.model
        cfg, max_model_len = engine_length(cfg, opts, shape)
        vocab = shape.vocab_size or len(tokenizer)  # the embedding's rows: an id past them is no token of the model's
        # max_model_len - 1: vLLM refuses a prompt of max_model_len tokens
        requests = Requests(name, tokenizer, max_model_len - 1, per_token, vocab, unparsed)
        log_path = folder / "eagle_extract.log"
        watch = EngineWatch(cfg.stall_timeout or None, log_path)
        watch.advice = "the server stopped; its spool's files were removed"
        watch.cleanup = spool.clear
        watch.exits = not in_replica
        again = f"fix the cause and start the server again (the run's log: {log_path})"
        with RunLog(log_path, log) as run_log, engine_errors(log_path, again, again):
            watch.note = run_log.note
            run_log.say(
                f"starting the engine: {cfg.model}, slots for layers {aux_ids + [shape.num_layers]}, "
                f"{per_token:,} bytes a token; spool {folder} (up to {_size(limit)}); "
                f"{prefill_note(cfg.engine_kwargs(), max_model_len, cfg.tp * cfg.pp)}"
                + (f"; Mooncake master {opts.mooncake.master} (objects up to {_size(objects.limit)})"
                   if objects else "")
            )  # fmt: skip
            try:
                llm = capture_engine(cfg, max_model_len, folder, aux_ids, watch)
            except BaseException:  # the engine started but its capture did not: it goes now, with the guard
                watch.stop.set()
                watch.reap()
                raise
            loop = EngineLoop(llm, spool, cfg.batch_size, watch, run_log.note)
            if in_replica:  # the process outlives a dead engine: its requests are answered at once
                watch.cleanup = lambda: (loop.engine_died(watch.failed), spool.clear())
            loop.start()
            app = routes.make_app(loop, spool, requests, opts, requests.longest, objects, in_replica)
            try:
                yield Core(loop, spool, app, run_log, objects, name, watch)
            finally:
                loop.stopping.set()
                loop.join(timeout=25)
                spool.clear()
                if objects:
                    objects.close()
                watch.stop.set()  # before the engine goes: its processes end now, and that is no failure
                if not (loop.is_alive() or loop.failed):  # every request answered: nothing of the engine's is owed
                    watch.end_engine(cfg.engine_args.get("distributed_executor_backend"))
                loop.llm = llm = None  # vLLM stops its engine now, into the log, not after our last line
                gc.collect()
                watch.reap()
            objects_expired = f" and {objects.expired} Mooncake objects" if objects else ""
            run_log.say(
                f"stopped: {loop.summary()}; {spool.expired} files{objects_expired} never collected were removed; "
                f"the spool's files are removed; log: {log_path}"
            )
            if held is not None:
                os.close(held)
            if loop.failed and not interrupted():
                raise ExtractError(f"the engine failed: {loop.failed}; the server stopped (the log: {log_path})")
    finally:  # whatever failed (the engine's start too), our segment leaves the store
        if objects:
            objects.close()


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


def _serve_http(core: Core, http: _Server, where: str, sock) -> int:
    server, loop = http.server, core.loop

    def janitor() -> None:
        said, shown = time.monotonic(), 0
        while not server.should_exit:
            core.sweep()
            if loop.failed:
                server.should_exit = True
            if time.monotonic() - said > PROGRESS_S and loop.rows != shown:  # progress, while there is any
                said, shown = time.monotonic(), loop.rows
                core.run_log.say(core.progress())
            time.sleep(0.5)
        core.stop_taking()

    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            core.run_log.say(f"serving {where}")
        await task

    threading.Thread(target=janitor, daemon=True, name="eagle-serve-spool").start()
    asyncio.run(main())
    core.run_log.say("stopping: the requests in flight are answered")
    core.collected(COLLECT_S)
    return 1 if loop.failed else 0


def _size(nbytes: int) -> str:
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:,.1f} GiB"
    return f"{nbytes / 2**20:,.1f} MiB" if nbytes >= 2**20 else f"{nbytes:,} bytes"
