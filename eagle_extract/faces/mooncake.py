"""`eagle-extract serve --transfer mooncake`: each row's states reach the trainer as one object in a Mooncake
store (TCP or RDMA), so speculators' trainer on another node reads them with its own `mooncake` backend
(hs-connectors 0.9's `MooncakeTransfer`), unchanged, with no shared folder.

The object holds the row's `hidden_states` [T, K, H] and `token_ids` [T], each at a 64-byte-aligned offset; the
answer's `kv_transfer_params` is the version-1 manifest (handle, shapes, dtypes, offsets) the reader unpacks it
with, and the reader removes the object.  The answer goes out only once the object is in the store, so the reader
never waits for it: a row that cannot be stored is answered 503, and the trainer's client asks again.  An object
removed uncollected after the spool's TTL leaves a `{handle}:error` marker for the TTL again, which hs-connectors'
reader looks for first: a trainer that comes late fails at once and asks again, instead of waiting its 120 s for
an object that is gone.

The row's file in the spool, written by the capture as for the file transfer, is read into a buffer registered
with Mooncake and put from there, then removed.  Our objects are bounded in bytes: a row waits for room while the
trainer catches up, and an object no trainer collected is removed after the spool's TTL and at shutdown.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..config import StoreSettings
from ..errors import ExtractError, RequestError

VERSION = 1  # of hs-connectors' transfer manifest
ALIGN = 64  # each tensor's offset in the object is a multiple of this
SEGMENT_SHARE = 0.8  # of our segment our objects may fill: under the master's eviction mark (0.9 unless set)
GRANULE = 64 << 20  # a staging buffer grows by this much
NO_ROOM = -200  # Mooncake's status when no segment has room for the object
RPC_FAIL = -900  # Mooncake's status when the master does not answer
NOT_FOUND = -704  # Mooncake's status for a key the store does not hold
NO_ROOM_S = 10.0  # a put that finds no room is tried again this long (a restarted master remounts the segments)
SWEEP_S = 0.5  # seconds between looks at which objects the trainer collected
DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "I64": "int64", "I32": "int32"}


class StoreUnavailable(Exception):
    """The store did not take a row: its request is answered 503 and the trainer's client asks again."""


def _row_layout(path: Path) -> tuple[dict, int, list[tuple[int, int, int]]]:
    """Where the row file's tensors go in the object: the manifest's tensor specs, the object's size, and the
    copies (file offset, object offset, bytes).  The file is safetensors: a u64 header length, a JSON header,
    then the data."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    specs, copies, offset = {}, [], 0
    for name in ("hidden_states", "token_ids"):
        begin, end = header[name]["data_offsets"]
        dtype = DTYPES[header[name]["dtype"]]
        specs[name] = {"shape": header[name]["shape"], "dtype": f"torch.{dtype}", "nbytes": end - begin,
                       "offset": offset}  # fmt: skip
        copies.append((8 + length + begin, offset, end - begin))
        offset = -(-(offset + end - begin) // ALIGN) * ALIGN
    return specs, offset, copies


class MooncakeObjects:
    """Our rows in the Mooncake store, as objects named `eagle-<run>-<n>`.  `put` waits, in the order the rows
    came, while the objects not yet collected and the rows being put would pass `limit` bytes (a share of our
    segment, so the master never evicts one); a thread sees which the trainer removed, and removes those older
    than `ttl`."""

    def __init__(self, settings: StoreSettings, ttl: float) -> None:
        self.settings, self.ttl = settings, ttl
        self.limit = int(settings.segment_bytes * SEGMENT_SHARE)
        self.prefix = f"eagle-{secrets.token_hex(4)}-"
        self.pool = ThreadPoolExecutor(settings.put_threads, thread_name_prefix="eagle-mooncake")
        self.expired = 0
        self._numbers = itertools.count()
        self._objects: dict[str, tuple[int, float]] = {}  # put, not yet seen gone: bytes, time put
        self._markers: dict[str, float] = {}  # `{handle}:error` of the objects removed uncollected: time put
        self._bytes = 0  # of those objects and of the rows being put
        self._waiting: list[object] = []
        self._cond = threading.Condition()
        self._buffers: list = []  # free staging buffers, registered with the store
        self._store = None
        self._stop = threading.Event()

    def connect(self) -> None:
        """Reach the master and mount our segment, before the engine starts (Mooncake itself retries a master
        that does not answer for 90 s)."""
        s = self.settings
        host, _, port = s.master.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError as exc:
            raise ExtractError(
                f"--mooncake-master {s.master}: no Mooncake master answers there ({exc.strerror or exc}); start "
                "mooncake_master (it listens on 50051 unless its --rpc_port says otherwise) or pass its address"
            ) from None
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's own log: errors only, unless asked
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ExtractError(
                f"--transfer mooncake needs Mooncake's transfer engine ({exc}): pip install mooncake-transfer-engine "
                "(mooncake-transfer-engine-non-cuda without CUDA); it links libibverbs1 (Debian's) even for TCP"
            ) from None
        hostname = os.environ.get("MOONCAKE_LOCAL_HOSTNAME") or socket.gethostbyname(socket.gethostname())
        store = MooncakeDistributedStore()
        status = store.setup(hostname, s.metadata_server, s.segment_bytes, round(s.local_buffer_gib * 2**30),
                             s.protocol, s.device, s.master)  # fmt: skip
        if status != 0:
            raise ExtractError(
                f"the Mooncake store did not start (status {status}): master {s.master}, metadata server "
                f"{s.metadata_server}, protocol {s.protocol}, this node as {hostname} (MOONCAKE_LOCAL_HOSTNAME "
                "sets it); check those, and that the node has the memory of --mooncake-global-segment-gib"
            )
        self._store = store
        self._sweeping = threading.Thread(target=self._sweeper, daemon=True, name="eagle-mooncake-sweep")
        self._sweeping.start()

    def put(self, path: Path, give_up: threading.Event) -> dict:
        """Put the row file's states into the store as one object, remove the file, and return the manifest
        the reader unpacks the object with."""
        try:
            specs, total, copies = _row_layout(path)
            self._reserve(total, give_up)
            handle = f"{self.prefix}{next(self._numbers)}"
            try:
                self._put(handle, path, copies, total, give_up)
            except BaseException:
                self._release(total)
                raise
        finally:
            path.unlink(missing_ok=True)
        with self._cond:
            self._objects[handle] = (total, time.monotonic())
        metadata = {"num_tokens": specs["token_ids"]["shape"][0], "total_aligned_bytes": total,
                    "extract_mode": "prompt_only"}  # fmt: skip
        return {"handle": handle, "version": VERSION, "tensors": specs, "metadata": metadata}

    def _put(self, handle: str, path: Path, copies: list, total: int, give_up: threading.Event) -> None:
        with self._cond:
            buffer = self._buffers.pop() if self._buffers else None
        buffer = self._staging(buffer, total)  # on failure no buffer goes back: none is registered
        try:
            with open(path, "rb") as f:
                view = memoryview(buffer)
                for at, offset, nbytes in copies:
                    f.seek(at)
                    if f.readinto(view[offset : offset + nbytes]) != nbytes:
                        raise StoreUnavailable(f"the row's file {path} is shorter than its header says")
            deadline = time.monotonic() + NO_ROOM_S
            while (status := self._store.put_from(handle, buffer.ctypes.data, total)) == NO_ROOM:
                if time.monotonic() > deadline or give_up.is_set() or self._stop.is_set():
                    break
                time.sleep(0.2)
        finally:
            with self._cond:
                self._buffers.append(buffer)
        if status != 0:
            why = {NO_ROOM: "no segment has room", RPC_FAIL: "the master does not answer"}.get(status, "see Mooncake")
            raise StoreUnavailable(
                f"the Mooncake store did not take the row (status {status}: {why}; master {self.settings.master})"
            )

    def _staging(self, buffer, nbytes: int):
        """`buffer`, or a larger one in its place, registered with the store."""
        import numpy as np

        if buffer is not None and buffer.size >= nbytes:
            return buffer
        if buffer is not None:
            self._store.unregister_buffer(buffer.ctypes.data)
        buffer = np.empty(-(-max(nbytes, 1) // GRANULE) * GRANULE, dtype=np.uint8)
        if (status := self._store.register_buffer(buffer.ctypes.data, buffer.size)) != 0:
            raise StoreUnavailable(f"Mooncake did not register a {buffer.size:,}-byte buffer (status {status})")
        return buffer

    def _reserve(self, nbytes: int, give_up: threading.Event) -> None:
        """Wait for room, first come first; a row larger than the limit goes when no object of ours is left."""
        ticket = object()
        with self._cond:
            self._waiting.append(ticket)
            try:
                while self._waiting[0] is not ticket or self._bytes and self._bytes + nbytes > self.limit:
                    if give_up.is_set() or self._stop.is_set():
                        raise StoreUnavailable("the server is stopping")
                    self._cond.wait(SWEEP_S)
            finally:
                self._waiting.remove(ticket)
                self._cond.notify_all()
            self._bytes += nbytes

    def _release(self, nbytes: int) -> None:
        with self._cond:
            self._bytes -= nbytes
            self._cond.notify_all()

    def _sweeper(self) -> None:
        while not self._stop.wait(SWEEP_S):
            try:
                self.sweep()
            except Exception:  # a master that fails one look is asked again: a dead sweeper frees no room
                continue

    def sweep(self) -> None:
        """Forget the objects the trainer removed (or a restarted master lost); remove those older than `ttl`,
        each leaving an error marker for a trainer that comes late, and the markers older than `ttl`."""
        now = time.monotonic()
        for marker, at in list(self._markers.items()):  # or the late trainer removed it, with its object's name
            if now - at > self.ttl and self._store.remove(marker, force=True) in (0, NOT_FOUND):
                del self._markers[marker]
        with self._cond:
            objects = list(self._objects.items())
        if not objects:
            return
        there = self._store.batch_is_exist([key for key, _ in objects])
        gone = []
        for (key, (_, at)), found in zip(objects, there):
            if found == 1 and now - at > self.ttl and self._store.remove(key, force=True) == 0:  # (the look leases it)
                self.expired += 1
                gone.append(key)
                why = (f"eagle-extract removed this row uncollected {self.ttl:g} s after it was answered "
                       "(--spool-ttl); ask for it again")  # fmt: skip
                marker = f"{key}:error"
                if self._store.put(marker, json.dumps({"error": why}).encode()) == 0:
                    self._markers[marker] = now
            elif found == 0:
                gone.append(key)
        with self._cond:
            for key in gone:
                self._bytes -= self._objects.pop(key)[0]
            self._cond.notify_all()

    def refuse_unfitting(self, nbytes: int) -> None:
        """A row larger than the store's room for rows would wait, be refused, and be run again on each retry."""
        if nbytes > self.limit:
            raise RequestError(
                f"the prompt's row takes {nbytes:,} bytes, more than the Mooncake store's room for rows of "
                f"{self.limit:,} ({SEGMENT_SHARE:.0%} of --mooncake-global-segment-gib); send a shorter prompt, or "
                "start the server with a larger --mooncake-global-segment-gib",
                status=413,
                param="prompt",
            )

    def remove(self, handle: str) -> None:
        """Remove an object nobody will collect (its client went away); its bytes are free at once."""
        if self._store is not None and self._store.remove(handle, force=True) == 0:
            with self._cond:
                if handle in self._objects:
                    self._bytes -= self._objects.pop(handle)[0]
                self._cond.notify_all()

    def used(self) -> int:
        return self._bytes

    def waiting(self) -> int:
        """Objects put and not yet collected."""
        return len(self._objects)

    def close(self) -> None:
        """Remove every object of ours and unmount our segment (after the puts in flight)."""
        self._stop.set()
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self._store is None:
            return
        self._sweeping.join()
        self._store.remove_by_regex(f"^{re.escape(self.prefix)}", force=True)
        with self._cond:
            self._objects.clear()
            for buffer in self._buffers:
                self._store.unregister_buffer(buffer.ctypes.data)
            self._buffers.clear()
        self._store.close()
        self._store = None
