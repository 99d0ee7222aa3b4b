"""Binding captured runs of tokens to the requests whose states they are: pure bookkeeping, no torch hooks.

vLLM's order of requests in a step is not guaranteed, a prompt may be split over steps, and prompts may
share a prefix, so every contiguous run of positions in a flat batch is matched to a request by its token
ids and positions alone; where those cannot decide whose states a run holds, the rows are run again.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict, deque
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class _Request:
    index: int
    token_ids: tuple[int, ...]
    hash: int  # _hash of token_ids, taken once


@dataclass(eq=False)
class _PartialPrompt:
    """A prompt followed from position 0, possibly over several steps: its tokens so far and their states."""

    tokens: list[int]
    chunks: list | None  # [T_i, K, H] views of step buffers, in order; None once no waiting row can use them
    tainted: bool = False  # an ambiguous run may have been bound to it or not: what it completes is run again
    hashed: tuple[int, int] = (0, 0)  # (tokens hashed so far, their _hash): RequestMatcher._waiting_prefixes


MAX_COPIES = 256  # tainted copies one engine call may keep open (RequestMatcher): past it, the call is distrusted

# Prompts are found by a polynomial hash of their token ids (each + 1, so that a 0 counts) mod 2**64, numpy's uint64
# arithmetic wrapping: a filter only, since every hit is then checked exactly.  The base is odd, so invertible mod
# 2**64, and every prefix's hash then comes out of one cumulative sum.
_BASE = 1_000_003
_tables = [np.ones(1, np.uint64), np.ones(1, np.uint64)]  # _BASE**k and _BASE**-k mod 2**64, k below their length


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """_BASE**k and _BASE**-k mod 2**64 for k up to n, the tables grown as longer prompts come."""
    powers, inverses = _tables
    if len(powers) <= n:
        size = max(n + 1, 2 * len(powers))
        one = np.ones(1, np.uint64)
        powers, inverses = (
            np.concatenate([one, np.cumprod(np.full(size - 1, base, dtype=np.uint64))])
            for base in (_BASE, pow(_BASE, -1, 1 << 64))
        )
        _tables[:] = powers, inverses
    return powers, inverses


def _ids(tokens) -> np.ndarray:
    return np.fromiter(tokens, dtype=np.uint64, count=len(tokens)) + np.uint64(1)


def _hash(tokens) -> int:
    """The hash of a whole prompt."""
    n = len(tokens)
    powers, _ = _powers(n)
    return int((_ids(tokens) * powers[n - 1 :: -1]).sum(dtype=np.uint64)) if n else 0


def _prefix_hashes(value: int, tokens) -> np.ndarray:
    """The hashes of a prompt whose first tokens hash to `value`, extended by each of `tokens` in turn."""
    n = len(tokens)
    powers, inverses = _powers(n)
    sums = np.cumsum(_ids(tokens) * inverses[:n], dtype=np.uint64)  # sum of c_t * _BASE**-t
    return np.uint64(value) * powers[1 : n + 1] + powers[:n] * sums


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


def _extended(keys: list[tuple[int, ...]], tokens: tuple[int, ...], strictly: bool) -> bool:
    """Whether one of the sorted `keys` starts with `tokens` (strictly: and goes on beyond them)."""
    i = bisect.bisect_left(keys, tokens)
    while i < len(keys) and keys[i][: len(tokens)] == tokens:
        if not strictly or len(keys[i]) > len(tokens):
            return True
        i += 1
    return False


def _cut(chunks: list, length: int) -> list:
    """The leading chunks that hold the first `length` states, the last one cut to fit."""
    kept, have = [], 0
    for chunk in chunks:
        if have + len(chunk) >= length:
            return kept + [chunk[: length - have]] if length - have < len(chunk) else kept + [chunk]
        kept.append(chunk)
        have += len(chunk)
    return kept


class RequestMatcher:
    """Binds captured runs of tokens to the expected requests whose states they are, or to none.

    A run at position 0 opens a partial prompt; a run at position p > 0 continues an open partial prompt of
    p tokens.  Attention is causal, so a partial prompt's states are those of any prompt with exactly its
    tokens: it is handed to one waiting row with those tokens, and stays open while a prompt the engine runs
    extends it.

    The matcher never guesses.  Every reading of a run is enumerated: which open partial prompt it continues
    and, since positions cannot separate one request's chunk ending at e from another's continuation
    starting at e, where it may be cut.  Readings that give every position the same tokens before it are
    equivalent (causal attention).  When they are not, every reading is kept: each partial prompt a reading
    continues stays open as it was (another reading leaves it so), each piece of each reading opens or
    extends a copy of its own, tainted, and every row any reading completes goes to `redo`, to be run again
    where nothing can be confused.  What is open is then a superset of what the engine really has open,
    each with its true tokens and states: a later run has its true reading among those enumerated, so one
    that the true state could read otherwise is found ambiguous in turn, and the states of a partial prompt
    bound before stay right.  The rows completed from a tainted copy are run again too.  None is written
    from a guess, and a run that two near-identical prompts make ambiguous costs those rows, not the call's.
    Copies add cuts to every later reading, so an engine call in which more than MAX_COPIES of them stay open
    when made (many near-identical prompts inside a shared prefix) is distrusted instead: every partial prompt is
    dropped and no run is read until `settle`, so every row still waiting is run again.
    """

    def __init__(self) -> None:
        self._whole: dict[tuple[int, ...], deque[_Request]] = defaultdict(deque)  # rows waiting for states
        self._waiting: list[tuple[int, ...]] = []  # their prompts, sorted: those extending T follow T
        self._running: list[tuple[int, ...]] = []  # every prompt announced and not settled, sorted
        self._announced: dict[int, tuple[int, ...]] = {}
        self._lengths: Counter[int] = Counter()  # the waiting rows' prompt lengths
        self._hashes: Counter[int] = Counter()  # and their hashes (_hash)
        self._open: list[_PartialPrompt] = []
        self._untrusted = False  # an ambiguous run since the last settle: the rows left waiting are run again
        self._copies = 0  # tainted copies that stayed open when made (prune may close them later), since settle
        self._distrusted = False  # past MAX_COPIES: nothing is read until the next settle
        self.redo: list[int] = []  # rows an ambiguous run, or a tainted partial prompt, completed: run them again
        self.split_requests = 0
        self.merged_runs = 0  # runs that held the chunk of one request and a continuation of another
        self.ambiguous_runs = 0
        self.dropped_partials = 0  # partial prompts whose states did not fit in host memory
        self.distrusted_calls = 0  # engine calls past MAX_COPIES

    def expect(self, index: int, token_ids: list[int]) -> None:
        key = tuple(token_ids)
        req = _Request(index, key, _hash(key))
        self._whole[key].append(req)
        bisect.insort(self._waiting, key)
        self._lengths[len(key)] += 1
        self._hashes[req.hash] += 1
        bisect.insort(self._running, key)
        self._announced[index] = key

    @property
    def pending(self) -> list[int]:
        return sorted(req.index for waiting in self._whole.values() for req in waiting)

    def settle(self, indices: set[int]) -> tuple[list[int], list[int]]:
        """The engine has run these rows (its call returned, and every step before it was added): stop
        waiting for them.  Returns (rows no run matched, rows to run again: those an ambiguous run may have
        robbed).  No partial prompt can continue after the call that ran it, so all are closed."""
        lost, redo = [], []
        for key, waiting in list(self._whole.items()):
            kept = deque(r for r in waiting if r.index not in indices)
            for r in waiting:
                if r.index in indices:
                    (redo if self._untrusted else lost).append(r.index)
                    self._forget_waiting(r)
            if kept:
                self._whole[key] = kept
            else:
                del self._whole[key]
        for index in indices:
            if (key := self._announced.pop(index, None)) is not None:
                del self._running[bisect.bisect_left(self._running, key)]
        self._open.clear()
        self._untrusted = self._distrusted = False
        self._copies = 0
        return sorted(lost), sorted(redo)

    def retire(self, indices: set[int]) -> None:
        """The engine has run these rows to their end while others still run (a server's continuous
        batching; every step before this was added): none of their tokens will come again, so no reading
        leads towards them, and the partial prompts only they extended close.  Those still waiting stay
        waiting until `settle`, which only then, with the engine idle, can say they were never matched."""
        for index in indices:
            if (key := self._announced.pop(index, None)) is not None:
                del self._running[bisect.bisect_left(self._running, key)]
        self.prune()

    @property
    def untrusted(self) -> bool:
        """An ambiguous run since the last settle: the rows still waiting at the settle are run again, and
        the tainted copies stay open until it, so a server stops taking new rows and lets the engine run empty."""
        return self._untrusted

    def _starts(self, pos: int) -> list[_PartialPrompt | None]:
        """What a piece starting at position `pos` can continue: nothing (a new prompt) at 0, else the open
        partial prompts of `pos` tokens, one of each distinct token list: the one whose states are kept and
        trusted first (one that dropped its states, when no waiting row needed them, may be needed by a row
        announced since)."""
        if pos == 0:
            return [None]
        best: dict[tuple[int, ...], _PartialPrompt] = {}
        for s in self._open:
            if len(s.tokens) == pos:
                key, rank = tuple(s.tokens), (s.chunks is None, s.tainted)
                if key not in best or rank < (best[key].chunks is None, best[key].tainted):
                    best[key] = s
        return list(best.values())

    def _read(self, tokens: list[int], start_pos: int):
        """(one reading of the run, every piece on some reading, whether another reading gives some position
        other tokens before it), or (None, [], False) when none fits.  A reading is a list of pieces (lo, hi,
        partial prompt continued or None), each leading towards a prompt the engine runs, each after the first
        continuing an open partial prompt as long as the positions before it: vLLM lays a step's requests out
        by batch slot, so one request's chunk ending at position e can be followed by another's continuing at
        e.  The readings are not enumerated (prompts that are each other's prefixes make exponentially many):
        the pieces that lie on some reading are found by dynamic programming, and each one not on the first
        reading is compared with it.  `piece_ends` closes
        over nothing of its own, so no cell keeps the partial prompts (and their host memory) alive."""
        n, end = len(tokens), start_pos + len(tokens)
        cuts = sorted({k - start_pos for s in self._open if start_pos < (k := len(s.tokens)) < end})
        starts = {c: self._starts(start_pos + c) for c in [0, *cuts]}
        ends: dict[tuple[int, int], list[int]] = {}  # (offset, id of the partial continued) -> where its piece may end

        def piece_ends(c0: int, start0) -> list[int]:
            """Filled depth first with a stack of its own: nested prompts make hundreds of cuts, past Python's
            recursion limit.  A piece ends at the run's end, or at a cut from which some partial prompt goes on."""
            todo = [(c0, start0)]
            while todo:
                c, start = todo[-1]
                if (c, id(start)) in ends:
                    todo.pop()
                    continue
                base = tuple(start.tokens) if start else ()
                heads = [d for d in cuts if d > c and _extended(self._running, base + tuple(tokens[c:d]), False)]
                later = [(d, nxt) for d in heads for nxt in starts[d] if (d, id(nxt)) not in ends]
                if later:
                    todo += later
                    continue
                whole = [n] if _extended(self._running, base + tuple(tokens[c:]), strictly=False) else []
                ends[(c, id(start))] = whole + [d for d in heads if any(ends[(d, id(nxt))] for nxt in starts[d])]
                todo.pop()
            return ends[(c0, id(start0))]

        first = next((s for s in starts[0] if piece_ends(0, s)), False)
        if first is False:
            return None, [], False
        reading, c, start = [], 0, first
        while True:  # the first reading: the longest piece first, the first partial prompt that goes on
            d = piece_ends(c, start)[0]
            reading.append((c, d, start))
            if d == n:
                break
            c, start = d, next(s for s in starts[d] if piece_ends(d, s))
        pieces, todo = set(), [(0, s) for s in starts[0] if piece_ends(0, s)]
        while todo:  # every piece on some reading
            c, start = todo.pop()
            for d in piece_ends(c, start):
                if (c, d, id(start)) not in pieces:
                    pieces.add((c, d, id(start)))
                    todo += [(d, nxt) for nxt in starts.get(d, ()) if piece_ends(d, nxt)]
        partial = {id(s): s for c in starts for s in starts[c]}
        every = [(c, d, partial[i]) for c, d, i in sorted(pieces)]
        others = [piece for piece in every if piece not in reading]
        ambiguous = any(not self._agrees(reading, tokens, c, d, start) for c, d, start in others)
        return reading, every, ambiguous

    @staticmethod
    def _agrees(reading, tokens: list[int], c: int, d: int, start) -> bool:
        """Whether piece [c, d) continuing `start` gives every position the tokens before it that `reading`
        gives: checked where each of the reading's pieces ends within it, and at its own end (within one
        piece of each, a later position's tokens extend an earlier one's)."""
        base = list(start.tokens) if start else []
        for lo, hi, other in reading:
            j = min(hi, d) - 1
            if hi <= c or lo >= d:
                continue
            theirs = (list(other.tokens) if other else []) + tokens[lo : j + 1]
            if base + tokens[c : j + 1] != theirs:
                return False
        return True

    def add(self, tokens: list[int], start_pos: int, chunk) -> tuple[list[tuple[_Request, list]], bool]:
        """Take one run; returns the rows it completes, each with its chunks, and whether it was used.
        Rows completed from a tainted partial prompt, or by an ambiguous run, go to `redo` instead; in a
        distrusted call none is completed, and all wait for `settle`, which hands them back."""
        if self._distrusted:
            return [], True
        reading, pieces, ambiguous = self._read(tokens, start_pos)
        if reading is None:
            return [], False
        if ambiguous:
            self.ambiguous_runs += 1
            self._untrusted = True
            self._take_every_reading(tokens, pieces)
            if self._copies > MAX_COPIES:
                self._distrusted = True
                self.distrusted_calls += 1
                self._open.clear()
            return [], True
        self.merged_runs += len(reading) > 1
        done = []
        for lo, hi, start in reading:
            done += self._take(tokens[lo:hi], start, chunk[lo:hi] if len(reading) > 1 else chunk)
        return done, True

    def _take_every_reading(self, tokens: list[int], pieces: list) -> None:
        """An ambiguous run: each piece of each reading extends a tainted copy of the partial prompt it
        continues, or opens one, and the rows it completes are run again; the partial prompts continued stay
        open as they were.  The copies keep tokens only: a tainted prompt's states are never read."""
        for lo, hi, start in pieces:
            copy = _PartialPrompt(list(start.tokens) if start else [], None, tainted=True)
            if start is not None:
                copy.hashed = start.hashed
            self._open.append(copy)
            self._take(tokens[lo:hi], copy, None)
            self._copies += copy in self._open  # closed at once when no running prompt extends it

    def _take(self, tokens: list[int], start: _PartialPrompt | None, chunk) -> list:
        """Extend a partial prompt (or open one) by a piece; every waiting row whose prompt it now passes
        through or ends at is served from its states up to there (causal attention: a row admitted after
        another prompt's chunk took it past its length is served by that chunk)."""
        before = 0 if start is None else len(start.tokens)
        if start is None:
            partial = _PartialPrompt(list(tokens), [chunk])
        else:
            partial = start
            partial.tokens += tokens
            if partial.chunks is not None:
                partial.chunks.append(chunk)
        done = []
        for length in self._waiting_prefixes(partial, before):
            key = tuple(partial.tokens[:length])
            waiting = self._whole[key]
            req = waiting.popleft()
            if not waiting:
                del self._whole[key]
            self._forget_waiting(req)
            if partial.tainted or partial.chunks is None:  # states dropped (no room, or before the row came)
                self.redo.append(req.index)
            else:
                chunks = list(partial.chunks) if length == len(partial.tokens) else _cut(partial.chunks, length)
                self.split_requests += len(chunks) > 1
                done.append((req, chunks))
        keep = _extended(self._running, tuple(partial.tokens), strictly=True)
        if keep and start is None:
            self._open.append(partial)
        elif not keep and start is not None:
            self._open.remove(partial)
        return done

    def _waiting_prefixes(self, partial: _PartialPrompt, before: int) -> list[int]:
        """The lengths past `before` at which the partial prompt's tokens are a waiting row's whole prompt.
        With many waiting lengths the hashes of the prefixes, the last kept on the partial prompt, find the
        candidates in one pass instead of one slice per length; each is then checked exactly."""
        n = len(partial.tokens)
        lengths = {length for length in self._lengths if before < length <= n}
        if len(lengths) > 8:
            done, value = partial.hashed  # done <= before: the prefix hashed so far
            hashes = _prefix_hashes(value, partial.tokens[done:n])
            lengths = {length for length in lengths if int(hashes[length - done - 1]) in self._hashes}
            if n > done:
                partial.hashed = (n, int(hashes[-1]))
        return sorted(length for length in lengths if tuple(partial.tokens[:length]) in self._whole)

    def _forget_waiting(self, req: _Request) -> None:
        key = req.token_ids
        del self._waiting[bisect.bisect_left(self._waiting, key)]
        self._lengths[len(key)] -= 1
        if not self._lengths[len(key)]:
            del self._lengths[len(key)]
        self._hashes[req.hash] -= 1
        if not self._hashes[req.hash]:
            del self._hashes[req.hash]

    def take_redo(self) -> list[int]:
        """The rows completed from tainted partial prompts since the last call."""
        redo, self.redo = self.redo, []
        return redo

    def copy_open_chunks(self, copy) -> None:
        """Swap every chunk an open partial prompt holds for `copy(chunk, alone)` (the capture copies them
        out of a step's buffer, so that buffer can go); `alone` says no other partial prompt holds states.
        A partial prompt for which `copy` gives None (no host memory for it) drops its states and is
        tainted: the rows it completes are run again, where fewer prompts are open."""
        for partial in self._open:
            if partial.tainted:  # what it completes is run again: its states are never read
                partial.chunks = None
        holding = [s for s in self._open if s.chunks is not None]
        for partial in holding:
            chunks = [copy(c, len(holding) == 1) for c in partial.chunks]
            if any(c is None for c in chunks):
                partial.chunks, partial.tainted = None, True
                self.dropped_partials += 1
            else:
                partial.chunks = chunks

    def prune(self) -> None:
        """Close the partial prompts no running prompt extends; drop the states of those no waiting row
        extends (the rows they led to were served from other runs): they are followed for their tokens only."""
        self._open = [s for s in self._open if _extended(self._running, tuple(s.tokens), strictly=True)]
        for s in self._open:
            if s.chunks is not None and not _extended(self._waiting, tuple(s.tokens), strictly=True):
                s.chunks = None
