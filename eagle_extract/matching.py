"""Binding captured runs of tokens to the requests whose states they are: pure bookkeeping, no torch hooks.

vLLM's order of requests in a step is not guaranteed, a prompt may be split over steps, and prompts may
share a prefix, so every contiguous run of positions in a flat batch is matched to a request by its token
ids and positions alone.
"""

from __future__ import annotations

import bisect
from collections import defaultdict, deque
from dataclasses import dataclass

import torch


@dataclass
class _Request:
    index: int
    token_ids: tuple[int, ...]


@dataclass(eq=False)
class _PartialPrompt:
    """A prompt followed from position 0, possibly over several steps: its tokens so far and their states."""

    tokens: list[int]
    chunks: list  # [T_i, K, H] views of step buffers, in order


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
    """Binds captured runs of tokens to the expected requests whose states they are.

    A run at position 0 opens a partial prompt; a run at position p > 0 continues an open partial prompt of
    p tokens that it extends into some waiting prompt.  Attention is causal, so a partial prompt's states
    are those of any prompt with exactly its tokens: it is handed to one waiting request
    with those tokens, and stays open while a waiting prompt extends it.  Prompts sharing a
    prefix (one chat template, one regenerated first answer) and split over steps therefore
    never swap states, however vLLM splits them.
    """

    def __init__(self) -> None:
        self._whole: dict[tuple[int, ...], deque[_Request]] = defaultdict(deque)
        self._sorted: list[tuple[int, ...]] = []  # waiting prompts, sorted: those extending T follow T
        self._open: list[_PartialPrompt] = []
        self.split_requests = 0
        self.merged_runs = 0  # runs that held the end of one request and a continuation of another

    def expect(self, index: int, token_ids: list[int]) -> None:
        key = tuple(token_ids)
        self._whole[key].append(_Request(index, key))
        bisect.insort(self._sorted, key)

    @property
    def pending(self) -> list[int]:
        return sorted(req.index for waiting in self._whole.values() for req in waiting)

    def forget(self, indices: set[int]) -> None:
        """Stop waiting for these requests (the engine ran them and no run matched)."""
        if not indices:
            return
        for key, waiting in list(self._whole.items()):
            kept = deque(r for r in waiting if r.index not in indices)
            for _ in range(len(waiting) - len(kept)):
                del self._sorted[bisect.bisect_left(self._sorted, key)]
            if kept:
                self._whole[key] = kept
            else:
                del self._whole[key]

    def _extended(self, tokens: tuple[int, ...], strictly: bool) -> bool:
        """Whether a waiting prompt starts with `tokens` (strictly: and goes on beyond them)."""
        i = bisect.bisect_left(self._sorted, tokens)
        while i < len(self._sorted) and self._sorted[i][: len(tokens)] == tokens:
            if not strictly or len(self._sorted[i]) > len(tokens):
                return True
            i += 1
        return False

    def add(self, tokens: list[int], start_pos: int, chunk) -> tuple[list[tuple[_Request, list]], bool]:
        """Take one run; returns the requests it completes, each with its chunks, and whether it was used.

        Positions cannot separate a request that ends at position e from a continuation starting at e
        right after it in the batch (vLLM orders requests by batch slot, and new ones take freed slots),
        so a run that fits nothing is tried as such a pair, cut where an open partial prompt ends."""
        done, used = self._take(tokens, start_pos, chunk)
        if used:
            return done, True
        for end in sorted({len(s.tokens) for s in self._open if start_pos < len(s.tokens) < start_pos + len(tokens)}):
            cut = end - start_pos
            if self._completes(tokens[:cut], start_pos) and self._continuation(tokens[cut:], end) is not None:
                self.merged_runs += 1
                head, _ = self._take(tokens[:cut], start_pos, chunk[:cut])
                tail, _ = self.add(tokens[cut:], end, chunk[cut:])
                return head + tail, True
        return [], False

    def _continuation(self, tokens: list[int], start_pos: int) -> _PartialPrompt | None:
        """The open partial prompt of `start_pos` tokens that `tokens` extend towards a waiting prompt."""
        for s in self._open:
            if len(s.tokens) == start_pos and self._extended(tuple(s.tokens + tokens), strictly=False):
                return s
        return None

    def _completes(self, tokens: list[int], start_pos: int) -> bool:
        """Whether the run ends a waiting prompt exactly (from position 0, or continuing an open partial prompt)."""
        if start_pos == 0:
            return tuple(tokens) in self._whole
        return any(len(s.tokens) == start_pos and tuple(s.tokens + tokens) in self._whole for s in self._open)

    def _take(self, tokens: list[int], start_pos: int, chunk) -> tuple[list[tuple[_Request, list]], bool]:
        if start_pos == 0:
            partial = _PartialPrompt(list(tokens), [chunk])
        else:
            partial = self._continuation(tokens, start_pos)
            if partial is None:
                return [], False
            partial.tokens += tokens
            partial.chunks.append(chunk)
        key = tuple(partial.tokens)
        done = []
        waiting = self._whole.get(key)
        if waiting:
            req = waiting.popleft()
            if not waiting:
                del self._whole[key]
            del self._sorted[bisect.bisect_left(self._sorted, key)]
            self.split_requests += len(partial.chunks) > 1
            done.append((req, list(partial.chunks)))
        keep = self._extended(key, strictly=True)
        if keep and start_pos == 0:
            self._open.append(partial)
        elif not keep and start_pos > 0:
            self._open.remove(partial)
        return done, bool(done) or keep

    def replace_open_chunks(self, fn) -> None:
        """Swap every chunk an open partial prompt holds for `fn(chunk)` (the capture copies them out of
        a step's buffer, so that buffer can go)."""
        for partial in self._open:
            partial.chunks = [fn(c) for c in partial.chunks]

    def prune(self) -> None:
        """Close the partial prompts no waiting prompt extends any more (their prompts were bound elsewhere)."""
        self._open = [s for s in self._open if self._extended(tuple(s.tokens), strictly=True)]
