"""Host memory holding captured states until they are written, under one byte budget.

A step's states land in one host buffer (pinned on a GPU) and every finished request is a slice of it
(`Rows`) that goes to the writer as it is, so a buffer lives until its last row is written.  Prompts still
open when their step is assembled are copied out of the buffer (`Rows.join`), so they never keep whole
steps alive, and a request spread over several steps is joined into memory of its own.  Each buffer's
bytes are taken from one `ByteBudget` when it is made and given back when the last `Rows` of it goes.
Only the forward pass waits for room, and only while something that frees room without it is in flight
(rows being written, steps waiting to be assembled); the assembly thread never waits.  Its joins of
finished rows may pass the budget by at most one step's rows; open prompts are copied only while they
fit (one at a time always is), and one that does not drops its states and its rows are run again, so
prompts that are each other's prefixes (the first k turns of a conversation) cannot pile up past the
budget.  A budget smaller than one step slows a run but never deadlocks it.
"""

from __future__ import annotations

import os
import threading
import weakref

import torch


def default_budget() -> int:
    """An eighth of the machine's memory, between 2 and 32 GiB: room for dozens of 8,192-token steps at
    Kimi-K2.5's widths (470 MB each in bf16) beside the engine's own use of host memory."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(32 * 2**30, max(2 * 2**30, total // 8)))


class ByteBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self.waits = 0  # times the forward pass or the assembly waited for room
        self.rows = 0  # rows handed to the writer and not yet dropped
        self.steps = 0  # steps captured and not yet assembled
        self._cond = threading.Condition()

    def take(self, nbytes: int, wait: bool = True) -> None:
        """Count `nbytes` as held; with `wait`, first wait while they do not fit and rows or steps in
        flight will free room without the caller."""

        def blocked() -> bool:
            return wait and self.used + nbytes > self.limit and (self.rows > 0 or self.steps > 0)

        with self._cond:
            if blocked():
                self.waits += 1
                self._cond.wait_for(lambda: not blocked())
            self.used += nbytes
            self.peak = max(self.peak, self.used)

    def try_take(self, nbytes: int) -> bool:
        """Count `nbytes` as held if they fit; never waits."""
        with self._cond:
            if self.used + nbytes > self.limit:
                return False
            self.used += nbytes
            self.peak = max(self.peak, self.used)
            return True

    def give(self, nbytes: int) -> None:
        with self._cond:
            self.used -= nbytes
            self._cond.notify_all()

    def count(self, what: str, delta: int) -> None:
        """`rows` or `steps` in flight went up or down."""
        with self._cond:
            setattr(self, what, getattr(self, what) + delta)
            self._cond.notify_all()

    def stats(self) -> dict:
        return {"host_budget_bytes": self.limit, "host_peak_bytes": self.peak, "host_budget_waits": self.waits}


def pinned_bytes(nbytes: int) -> int:
    """What PyTorch's caching host allocator really takes for a pinned block: the next power of two."""
    return 1 << (max(nbytes, 1) - 1).bit_length()


class Held:
    """States (and FP8 scales) in host memory whose bytes count against `budget` until this object goes."""

    def __init__(self, budget: ByteBudget, nbytes: int, states: torch.Tensor, scales: torch.Tensor | None) -> None:
        self.states, self.scales = states, scales
        weakref.finalize(self, budget.give, nbytes)


class Rows:
    """Rows [start, stop) of a `Held` buffer: a request's states, or a part of them."""

    __slots__ = ("held", "start", "stop", "__weakref__")

    def __init__(self, held: Held, start: int, stop: int) -> None:
        self.held, self.start, self.stop = held, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, part: slice) -> Rows:
        start, stop, _ = part.indices(len(self))
        return Rows(self.held, self.start + start, self.start + stop)

    @property
    def states(self) -> torch.Tensor:
        return self.held.states[self.start : self.stop]

    @property
    def scales(self) -> torch.Tensor | None:
        scales = self.held.scales
        return None if scales is None else scales[self.start : self.stop]

    @property
    def nbytes(self) -> int:
        scales = self.scales
        return self.states.nbytes + (0 if scales is None else scales.nbytes)

    @staticmethod
    def join(parts: list[Rows], budget: ByteBudget, if_room: bool = False) -> Rows | None:
        """The parts one after another in memory of their own (also a copy of a single part); with
        `if_room`, None when they do not fit in the budget."""
        nbytes = sum(p.nbytes for p in parts)
        if if_room:
            if not budget.try_take(nbytes):
                return None
        else:
            budget.take(nbytes, wait=False)  # the assembly thread: waiting here could wait on its own rows
        try:
            states = torch.cat([p.states for p in parts])
            scales = None if parts[0].scales is None else torch.cat([p.scales for p in parts])
        except BaseException:
            budget.give(nbytes)
            raise
        return Rows(Held(budget, nbytes, states, scales), 0, len(states))
