"""Forward hooks that capture a step's hidden states on the model's device and hand finished requests on.

Slot k of a request holds the residual stream entering decoder layer `aux_ids[k]` (vLLM's EAGLE-3
convention); the last slot holds the last layer's output before the final norm.  Which request a run of
tokens belongs to is decided by `matching.RequestMatcher`.
"""

from __future__ import annotations

import inspect
import queue
import threading
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from ..files.fp8 import to_fp8
from .hostmem import ByteBudget, Held, Rows, pinned_bytes
from .matching import RequestMatcher, segments
from .model_nav import DecoderStack
from .stages import stage_slots


@dataclass
class CaptureStats:
    steps: int = 0
    segments: int = 0
    split_requests: int = 0  # requests whose prompt arrived over more than one step
    merged_runs: int = 0  # runs holding one request's end and another's continuation (RequestMatcher.add)
    ambiguous_runs: int = 0  # runs more than one request could own (RequestMatcher): their rows are redone
    redo_rows: int = 0  # rows handed back to be run again: an ambiguous binding, or no room (below)
    dropped_partials: int = 0  # open prompts whose states did not fit in --host-memory (RequestMatcher)
    unmatched_tokens: int = 0  # padding or foreign tokens that belong to no expected request
    dropped_steps: int = 0  # steps whose token ids or states never arrived (a hook that did not fire)
    dropped_tokens: int = 0
    settled_rows: int = 0  # rows whose every step has been assembled (StepCapture.settle)
    unmatched_rows: int = 0  # of those, rows no captured run matched: they will never be written
    first_unmatched_row: int | None = None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


CALL = ("positions", "hidden_states", "residual")  # vLLM's usual decoder-layer argument order


def call_order(layer: torch.nn.Module) -> tuple[str, ...]:
    """The layer's argument names in call order: most vLLM layers take (positions, hidden_states,
    residual), GPT-OSS's take (hidden_states, positions, residual)."""
    try:
        names = tuple(inspect.signature(layer.forward).parameters)
    except (TypeError, ValueError):
        return CALL
    return names if set(CALL) <= set(names) else CALL


def _layer_inputs(
    args: tuple, kwargs: dict, order: tuple[str, ...] = CALL
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(positions, hidden_states, residual) of a vLLM decoder-layer call, however it was passed."""
    found = dict(zip(order, args))
    found.update((k, v) for k, v in kwargs.items() if k in CALL)
    return found.get("positions"), found.get("hidden_states"), found.get("residual")


@dataclass
class _Step:
    """One engine step's captures, possibly still being copied off the GPU."""

    held: Held  # states [N, K, H] (and FP8 scales [N, 1, 1]) in host memory, pinned on a GPU
    token_ids: torch.Tensor  # [N] int64, host
    positions: torch.Tensor  # [N] or [3, N] int64, host
    ready: object | None  # a CUDA event the copies finish at, None on the CPU


@dataclass
class _Expect:
    """Rows announced (row index, prompt token ids), queued ahead of the steps that run them: the assembler
    registers them in order, and the RPC that announced them never waits for a step's matching."""

    rows: list[tuple[int, list[int]]]


@dataclass
class _Settle:
    """Queued behind every step of the rows announced before it: when the assembler reaches it, those
    rows have had all their tokens, so any still waiting will never be matched."""

    rows: list[int]


@dataclass
class _Retire:
    """Queued behind every step of these rows, which the engine has finished while others still run: the
    matcher stops reading runs towards them (RequestMatcher.retire)."""

    rows: list[int]


class StepCapture:
    """Hooks on one worker's decoder stack; calls `on_complete(index, rows, token_ids)` with a request's
    `hostmem.Rows` ([T, K, H] states, K being the slots this pipeline stage holds, and with `fp8` their
    per-token scales), which hold their host memory until dropped.

    The hooks launch work and wait for nothing but host memory: each adds `hidden + residual` into its
    slot of a token-major [N, K, H] step buffer on the model's device; with `fp8` the stage's last hook
    quantises it there (one scale per token), and on a GPU copies it to pinned host memory on a side
    stream, so the forward pass never waits for the copy. Token-major means every request is a
    contiguous slice: nothing is re-laid out on the host. A background thread waits for each step's
    copy, splits the step into requests and hands finished requests on. Host memory is taken from
    `budget` for every step; when it is spent the forward pass waits (back-pressure) until written rows
    give theirs back.
    """

    def __init__(
        self,
        stack: DecoderStack,
        aux_ids: list[int],
        on_complete: Callable[[int, Rows, list[int]], None],
        budget: ByteBudget,
        fp8: bool = False,
        ids_from: torch.nn.Module | None = None,
    ) -> None:
        if stack.is_first_stage and stack.embed is None:
            raise RuntimeError("no token embedding on the first pipeline stage; name the decoder with --decoder-path")
        if not stack.is_first_stage and ids_from is None:
            raise RuntimeError("a later pipeline stage reads token ids from the model's forward: pass ids_from")
        self.stack = stack
        self.aux_ids = list(aux_ids)
        self.slots = stage_slots(self.aux_ids, stack.num_layers, stack.start, stack.end)  # held here, in order
        if not self.slots:
            raise RuntimeError(f"layers {stack.start}-{stack.end} hold no slot; install no capture on this stage")
        self.ids_from = ids_from
        self.on_complete = on_complete
        self.budget = budget
        self.fp8 = fp8
        self.matcher = RequestMatcher()
        self.stats = CaptureStats()
        self.errors: list[str] = []
        self.lock = threading.Lock()  # guards matcher and stats (hook thread, assembler, wait=True drain)
        self._announcing = threading.Lock()  # _unsettled and the queue's order of announcements and settles
        self._handing = threading.Lock()  # _redo and _lost: an RPC takes them without waiting for the matcher
        self._handles: list = []
        self._order = CALL
        self._ids: torch.Tensor | None = None
        self._staging: torch.Tensor | None = None  # [N, K, H] on the model's device
        self._copy_stream = None
        self._pinned_rows = 0  # pinned step buffers are made this many rows long: one size for the allocator
        self._steps: queue.Queue = queue.Queue()
        self._unsettled: list[int] = []  # rows announced since the last settle()
        self._redo: list[int] = []  # rows to run again (RequestMatcher never guesses), until drained
        self._lost: list[int] = []  # rows the engine ran that no run matched, until drained
        self._thread = threading.Thread(target=self._assemble_loop, daemon=True)
        self._thread.start()

    # -- hook plumbing (runs inside the forward pass: launch work; wait only for host memory) --
    def install(self) -> None:
        """Token ids from the embedding on the first stage, from the model's `input_ids` argument on
        later ones (their embedding is a placeholder); slot pre-hooks on this stage's layers; the
        step ends at this stage's last layer."""
        layers = self.stack.layers
        self._order = call_order(layers[self.stack.start])
        if self.stack.is_first_stage:
            self._handles.append(self.stack.embed.register_forward_pre_hook(self._on_embed))
        else:
            self._handles.append(self.ids_from.register_forward_pre_hook(self._on_model_call, with_kwargs=True))
        for column, slot in enumerate(self.slots):
            if slot < len(self.aux_ids):
                hook = self._make_pre_hook(column)
                self._handles.append(layers[self.aux_ids[slot]].register_forward_pre_hook(hook, with_kwargs=True))
        last = layers[self.stack.end - 1]
        self._handles.append(last.register_forward_hook(self._on_stage_end, with_kwargs=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._steps.put(None)
        self._thread.join()

    def _to_host(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy to host memory (into `out` if given); on a GPU asynchronously, on the side stream, into
        pinned memory."""
        if t.device.type != "cuda":  # the callers' tensors are private copies already
            return t
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=t.device)
        if out is None:
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self._copy_stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self._copy_stream):
            out.copy_(t, non_blocking=True)
        t.record_stream(self._copy_stream)  # keep t's memory until the side stream has read it
        return out

    def _block_bytes(self, t: torch.Tensor) -> int:
        return pinned_bytes(self._pinned_rows * (t.nbytes // t.shape[0]))

    def _pinned_copy(self, t: torch.Tensor) -> torch.Tensor:
        """`t` copied into pinned memory cut from a block of `_pinned_rows` rows: one block size step after
        step, which PyTorch's caching host allocator (power-of-two blocks, never merged) then reuses."""
        whole = torch.empty((self._pinned_rows, *t.shape[1:]), dtype=t.dtype, pin_memory=True)
        return self._to_host(t, whole[: t.shape[0]])

    def _to_held(self, staging: torch.Tensor) -> Held:
        """The step's states (quantised here with `fp8`) in host memory, their bytes taken from the budget
        first: this is where the forward pass waits when the writer falls behind."""
        states, scales = to_fp8(staging) if self.fp8 else (staging, None)
        if staging.device.type != "cuda":  # the step buffer is host memory already, taken in _store
            return Held(self.budget, staging.nbytes, states, scales)
        parts = [states] if scales is None else [states, scales]
        self._pinned_rows = max(self._pinned_rows, staging.shape[0])
        nbytes = sum(self._block_bytes(t) for t in parts)
        self.budget.take(nbytes)
        try:
            host = [self._pinned_copy(t) for t in parts]
        except BaseException:
            self.budget.give(nbytes)
            raise
        return Held(self.budget, nbytes, host[0], host[1] if scales is not None else None)

    def _on_embed(self, module, args) -> None:
        self._ids = self._to_host(args[0].detach().flatten().to(torch.int64, copy=True))  # a buffer vLLM reuses

    def _on_model_call(self, module, args, kwargs) -> None:
        ids = kwargs["input_ids"] if "input_ids" in kwargs else (args[0] if args else None)
        if ids is None:
            self.errors.append("capture: a later pipeline stage's model call carried no input_ids")
            return
        self._on_embed(module, (ids,))

    def _store(self, column: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        # vLLM's fused add+norm overwrites these tensors in place later: copy now, on the model's
        # device, into the token-major [N, K, H] step buffer, so each request is one contiguous slice.
        if self._staging is None:
            shape = (hidden.shape[0], len(self.slots), hidden.shape[-1])
            self._staging = torch.empty(shape, dtype=hidden.dtype, device=hidden.device)
            if hidden.device.type != "cuda":  # the step buffer is the host memory the rows will hold
                self.budget.take(self._staging.nbytes)
        out = self._staging[:, column]
        if residual is None:
            out.copy_(hidden)
        else:
            torch.add(hidden, residual, out=out)

    def _make_pre_hook(self, column: int):
        def hook(module, args, kwargs):
            _, hidden, residual = _layer_inputs(args, kwargs, self._order)
            self._store(column, hidden, residual)

        return hook

    def _on_stage_end(self, module, args, kwargs, output) -> None:
        positions, _, _ = _layer_inputs(args, kwargs, self._order)
        if self.slots[-1] == len(self.aux_ids):  # the final slot: the last layer's output, before the norm
            hidden, residual = (output, None) if isinstance(output, torch.Tensor) else (output[0], output[1])
            self._store(len(self.slots) - 1, hidden, residual)
        staging, ids = self._staging, self._ids
        self._staging = self._ids = None
        if staging is None or ids is None or staging.shape[0] == 0:
            if staging is not None and staging.device.type != "cuda":
                self.budget.give(staging.nbytes)  # taken in _store, never held by a step
            tokens = positions.shape[-1] if positions is not None else 0
            if tokens and (staging is None or ids is None):  # its tokens' rows can never complete
                with self.lock:
                    self.stats.dropped_steps += 1
                    self.stats.dropped_tokens += tokens
            return
        # vLLM's positions buffer is persistent and already int64: snapshot it on the compute stream, or the
        # next step's upload could overwrite it before the side stream has copied it
        positions = self._to_host(positions.detach().to(torch.int64, copy=True))
        held = self._to_held(staging)
        ready = self._copy_stream.record_event() if staging.device.type == "cuda" else None
        self.budget.count("steps", 1)
        self._steps.put(_Step(held, ids, positions, ready))

    # -- per-step bookkeeping (background thread) --------------------------------------
    def _assemble_loop(self) -> None:
        while True:
            step = self._steps.get()
            if step is None:
                self._steps.task_done()
                return
            captured = isinstance(step, _Step)
            try:
                if isinstance(step, _Expect):
                    self._register(step.rows)
                elif isinstance(step, _Settle):
                    self._settle(step.rows)
                elif isinstance(step, _Retire):
                    with self.lock:
                        self.matcher.retire(set(step.rows))
                else:
                    if step.ready is not None:
                        step.ready.synchronize()
                    self._assemble(step)
            except Exception as exc:  # reported to the driver by eagle_drain; the thread goes on, so no drain hangs
                self.errors.append(f"capture: {type(exc).__name__}: {exc}")
            del step  # its buffer goes back to the budget once its rows are written, not at the next step
            if captured:
                self.budget.count("steps", -1)
            self._steps.task_done()

    def _register(self, rows: list[tuple[int, list[int]]]) -> None:
        """Announced rows into the matcher, each on its own: one it refuses is reported, the others still match."""
        with self.lock:
            for index, token_ids in rows:
                try:
                    self.matcher.expect(index, token_ids)
                except Exception as exc:  # reported to the driver by eagle_drain
                    self.errors.append(f"capture: row {index}: {type(exc).__name__}: {exc}")

    def _assemble(self, step: _Step) -> None:
        id_list = step.token_ids.tolist()
        finished = []
        with self.lock:
            self.stats.steps += 1
            for offset, length, start_pos in segments(step.positions):
                self.stats.segments += 1
                # a contiguous [T, K, H] slice: the step buffer lives until the request's file is written
                rows = Rows(step.held, offset, offset + length)
                done, used = self.matcher.add(id_list[offset : offset + length], start_pos, rows)
                if not used:
                    self.stats.unmatched_tokens += length
                finished += done
            self.matcher.prune()
            # prompts still open keep a copy of their part, never this whole step buffer
            self.matcher.copy_open_chunks(
                lambda c, alone: Rows.join([c], self.budget, if_room=not alone) if c.held is step.held else c
            )
            self.stats.split_requests = self.matcher.split_requests
            self.stats.merged_runs = self.matcher.merged_runs
            self.stats.ambiguous_runs = self.matcher.ambiguous_runs
            self.stats.dropped_partials = self.matcher.dropped_partials
            self._add_redo(self.matcher.take_redo())
        for req, chunks in finished:
            row = chunks[0][:] if len(chunks) == 1 else Rows.join(chunks, self.budget)
            self.budget.count("rows", 1)
            weakref.finalize(row, self.budget.count, "rows", -1)  # when the writer has dropped it
            self.on_complete(req.index, row, list(req.token_ids))

    def _settle(self, rows: list[int]) -> None:
        """Count the rows still waiting among `rows` as unmatched, and stop waiting for them."""
        with self.lock:
            lost, redo = self.matcher.settle(set(rows))
            self._add_redo(redo)
            with self._handing:
                self._lost += lost
            self.stats.settled_rows += len(rows)
            self.stats.unmatched_rows += len(lost)
            if lost and self.stats.first_unmatched_row is None:
                self.stats.first_unmatched_row = lost[0]

    def _add_redo(self, rows: list[int]) -> None:
        with self._handing:
            self._redo += rows
        self.stats.redo_rows += len(rows)

    def take_unwritten(self) -> tuple[list[int], list[int]]:
        """(The rows to run again since the last call: an ambiguous run may have given them another
        row's states, so none of theirs was written; the rows settled unmatched since then.)"""
        with self._handing:
            redo, self._redo = self._redo, []
            lost, self._lost = self._lost, []
            return redo, lost

    def expect(self, rows: list[tuple[int, list[int]]]) -> None:
        """Announce rows before the engine runs them: queued ahead of their steps, so the server's look between
        two steps does not wait while the assembler matches the step before."""
        with self._announcing:
            self._unsettled += [index for index, _ in rows]
            self._steps.put(_Expect(list(rows)))

    def settle(self) -> None:
        """Mark that the engine has run every row announced so far (its generate call returned): the
        assembler settles them once it has taken every step queued before this call."""
        with self._announcing:
            rows, self._unsettled = self._unsettled, []
            if rows:
                self._steps.put(_Settle(rows))

    def retire(self, rows: list[int]) -> None:
        """Mark that the engine has finished these rows while others may still run (the server's continuous
        batching); they are settled, like every row announced, at the next `settle`."""
        if rows:
            self._steps.put(_Retire(list(rows)))

    @property
    def untrusted(self) -> bool:
        """As the assembler last left it (one flag: read without waiting for the step it is matching)."""
        return self.matcher.untrusted

    def counts(self) -> dict:
        """The stats as they stand, without waiting for the step the assembler is matching (one copy under the
        GIL; of the counters it is updating, some may already count that step): a look between two steps."""
        return {**self.stats.as_dict(), **self.budget.stats()}

    def drain(self) -> dict:
        """Wait until every captured step is assembled; report stats, pending rows and errors."""
        self._steps.join()
        with self.lock:
            stats = {**self.stats.as_dict(), **self.budget.stats()}
            return {"stats": stats, "pending": self.matcher.pending, "errors": list(self.errors)}
