"""Forward hooks that turn vLLM's flat token batches into per-request hidden-state tensors.

Slot k of a request holds the residual stream entering decoder layer `aux_ids[k]`
(vLLM's EAGLE-3 convention); the last slot holds the last layer's output before the
final norm.  The hooks never trust the order of requests in a step: every contiguous run
of positions in the flat batch is matched to a request by its token ids and positions.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from .model_nav import DecoderStack


@dataclass
class _Request:
    index: int
    token_ids: list[int]
    chunks: list[torch.Tensor] = field(default_factory=list)
    filled: int = 0


@dataclass
class CaptureStats:
    steps: int = 0
    segments: int = 0
    split_requests: int = 0  # requests whose prompt arrived over more than one step
    unmatched_tokens: int = 0  # padding or foreign tokens that belong to no expected request

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _residual_stream(hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    return hidden if residual is None else hidden + residual


def _layer_inputs(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(positions, hidden_states, residual) of a vLLM decoder-layer call, however it was passed."""
    names = ("positions", "hidden_states", "residual")
    values = list(args[:3]) + [None] * (3 - min(len(args), 3))
    for i, name in enumerate(names):
        if name in kwargs:
            values[i] = kwargs[name]
    return values[0], values[1], values[2]


def segments(positions: torch.Tensor) -> list[tuple[int, int, int]]:
    """Split a flat batch into contiguous runs: (row offset, length, first position)."""
    pos = positions[0] if positions.dim() == 2 else positions  # M-RoPE: 3 rows, text rows agree
    pos = pos.to("cpu", torch.int64)
    n = pos.numel()
    if n == 0:
        return []
    breaks = (torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1).tolist()
    starts = [0] + breaks
    ends = breaks + [n]
    first = pos[starts].tolist()
    return [(s, e - s, p) for s, e, p in zip(starts, ends, first)]


class RequestMatcher:
    """Assigns each contiguous run of tokens to the expected request it belongs to."""

    def __init__(self) -> None:
        self._whole: dict[tuple[int, ...], deque[_Request]] = defaultdict(deque)
        self._unstarted: dict[int, _Request] = {}
        self._in_flight: dict[int, _Request] = {}
        self.split_requests = 0

    def expect(self, index: int, token_ids: list[int]) -> None:
        req = _Request(index, list(token_ids))
        self._whole[tuple(req.token_ids)].append(req)
        self._unstarted[index] = req

    @property
    def pending(self) -> list[int]:
        return sorted(set(self._unstarted) | set(self._in_flight))

    def _take(self, req: _Request) -> _Request:
        del self._unstarted[req.index]
        queue = self._whole[tuple(req.token_ids)]
        queue.remove(req)
        if not queue:
            del self._whole[tuple(req.token_ids)]
        return req

    def match(self, tokens: list[int], start_pos: int) -> _Request | None:
        n = len(tokens)
        if start_pos == 0:
            queue = self._whole.get(tuple(tokens))
            if queue:
                return self._take(queue[0])
            for req in self._unstarted.values():  # first chunk of a prompt split over steps
                if len(req.token_ids) > n and req.token_ids[:n] == tokens:
                    self.split_requests += 1
                    self._in_flight[req.index] = req
                    return self._take(req)
            return None
        for req in self._in_flight.values():  # a later chunk continues where it stopped
            if req.filled == start_pos and req.token_ids[start_pos : start_pos + n] == tokens:
                return req
        return None

    def finished(self, req: _Request) -> None:
        self._in_flight.pop(req.index, None)


class StepCapture:
    """Hooks on one worker's decoder stack; calls `on_complete(index, hidden[T,K,H], token_ids)`.

    Capture happens only on the stage that owns every requested layer; `aux_ids` are layer
    ids in vLLM's EAGLE-3 convention and the final slot is always appended.
    """

    def __init__(
        self,
        stack: DecoderStack,
        aux_ids: list[int],
        on_complete: Callable[[int, torch.Tensor, list[int]], None],
    ) -> None:
        if stack.embed is None:
            raise RuntimeError("token embedding not on this stage; capture needs the first pipeline stage")
        self.stack = stack
        self.aux_ids = list(aux_ids)
        self.num_slots = len(aux_ids) + 1
        self.on_complete = on_complete
        self.matcher = RequestMatcher()
        self.stats = CaptureStats()
        self._handles: list = []
        self._step_ids: torch.Tensor | None = None
        self._step_buf: torch.Tensor | None = None

    # -- hook plumbing -------------------------------------------------------------
    def install(self) -> None:
        layers = self.stack.layers
        self._handles.append(self.stack.embed.register_forward_pre_hook(self._on_embed))
        for slot, layer_id in enumerate(self.aux_ids):
            hook = self._make_pre_hook(slot)
            self._handles.append(layers[layer_id].register_forward_pre_hook(hook, with_kwargs=True))
        self._handles.append(layers[-1].register_forward_hook(self._on_last_layer, with_kwargs=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _on_embed(self, module, args) -> None:
        self._step_ids = args[0].detach().to("cpu", torch.int64).flatten()

    def _slot_buffer(self, like: torch.Tensor) -> torch.Tensor:
        if self._step_buf is None:
            n, h = like.shape[0], like.shape[-1]
            self._step_buf = torch.empty((n, self.num_slots, h), dtype=like.dtype, device="cpu")
        return self._step_buf

    def _store(self, slot: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        # vLLM's fused add+norm overwrites these tensors in place later: copy now.
        buf = self._slot_buffer(hidden)
        if hidden.device.type == "cpu" and residual is not None:
            torch.add(hidden, residual, out=buf[:, slot])
        else:
            buf[:, slot].copy_(_residual_stream(hidden, residual))

    def _make_pre_hook(self, slot: int):
        def hook(module, args, kwargs):
            _, hidden, residual = _layer_inputs(args, kwargs)
            self._store(slot, hidden, residual)

        return hook

    def _on_last_layer(self, module, args, kwargs, output) -> None:
        positions, _, _ = _layer_inputs(args, kwargs)
        hidden, residual = (output, None) if isinstance(output, torch.Tensor) else (output[0], output[1])
        self._store(self.num_slots - 1, hidden, residual)
        self._finish_step(positions)

    # -- per-step bookkeeping --------------------------------------------------------
    def _finish_step(self, positions: torch.Tensor) -> None:
        buf, ids = self._step_buf, self._step_ids
        self._step_buf = self._step_ids = None
        if buf is None or ids is None:
            return
        self.stats.steps += 1
        id_list = ids.tolist()
        for offset, length, start_pos in segments(positions):
            self.stats.segments += 1
            tokens = id_list[offset : offset + length]
            req = self.matcher.match(tokens, start_pos)
            if req is None:
                self.stats.unmatched_tokens += length
                continue
            req.chunks.append(buf[offset : offset + length])
            req.filled += length
            if req.filled == len(req.token_ids):
                self.matcher.finished(req)
                hidden = req.chunks[0] if len(req.chunks) == 1 else torch.cat(req.chunks)
                self.on_complete(req.index, hidden, req.token_ids)
        self.stats.split_requests = self.matcher.split_requests
