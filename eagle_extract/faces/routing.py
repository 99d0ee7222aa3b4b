"""`serve --replicas`' routing, Ray aside: the key that marks copies of a prompt, and the front's ledger of
the requests in flight, which chooses each one's replica.  A module of its own because Ray Serve ships the router
class's module by value to the front's process: the ledger, here, stays the one object the front and its router
share there."""

from __future__ import annotations

import collections
import hashlib
import json
import random
import threading
import time

ROWS = ("/v1/completions", "/v1/chat/completions")
ENDED_S = 60.0  # a request that ended before it was routed is remembered this long, for its routing


def prompt_key(path: str, raw: bytes) -> str:
    """Equal for requests whose prompt ids are surely equal (what an engine runs once), from what makes the ids:
    the prompt as sent (a batch of one unwrapped) and the flags the tokenizer or chat template reads; "" (any
    replica) for a request that is no row or no JSON object (its replica refuses it)."""
    if path not in ROWS:
        return ""
    try:
        body = json.loads(raw)
        if not isinstance(body, dict):
            return ""
        if path == "/v1/chat/completions":
            made = ["chat", body.get("messages"), bool(body.get("add_generation_prompt", False)),
                    bool(body.get("continue_final_message", False))]  # fmt: skip
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
                prompt = prompt[0]  # a batch of one, as requests.py reads it
            made = [prompt, body.get("add_special_tokens", True) is not False] if isinstance(prompt, str) else [prompt]
        canonical = json.dumps(made, sort_keys=True, separators=(",", ":"))
    except (ValueError, RecursionError):
        return ""
    return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()


class Ledger:
    """The front's requests in flight, by the token the front gives each: the replica each was sent to, and the
    replica running each prompt key.  The front ends a token when its request ends, however it ends (an answer,
    an error, its client gone), so no count outlives its request: Ray Serve's own callbacks come late after a
    replica refused a request, and never for one cancelled while it was being routed."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # the router's event loop and the front's each have a thread
        self.sent: dict[str, tuple[str, str]] = {}  # token -> (replica id, prompt key)
        self.rows: collections.Counter = collections.Counter()  # replica id -> tokens sent there
        self.owners: dict[str, tuple[str, int]] = {}  # prompt key -> (replica running it, its tokens there)
        self.ended: dict[str, float] = {}  # tokens that ended before they were routed -> when

    def choose(self, token: str, key: str, candidates: list):
        """The replica for this request: the one running its prompt, if that one has room; else the one with
        the fewest rows sent and not yet answered, at random among equals.  None: every replica is full."""
        with self.lock:
            self._forget(token)  # asked again (its replica was full or refused it): that choice is void
            alive = {r.replica_id: r for r in candidates}
            owner = alive.get(self.owners[key][0]) if key in self.owners else None
            if owner is not None and self.rows[owner.replica_id] < owner.max_ongoing_requests:
                chosen = owner
            else:  # a full owner: its prompt runs once more elsewhere rather than hold the others up
                room = [r for r in candidates if self.rows[r.replica_id] < r.max_ongoing_requests]
                if not room:
                    return None
                fewest = min(self.rows[r.replica_id] for r in room)
                chosen = random.choice([r for r in room if self.rows[r.replica_id] == fewest])
            if self.ended.pop(token, None) is not None:  # its request is over: nothing to count
                return chosen
            self.sent[token] = (chosen.replica_id, key)
            self.rows[chosen.replica_id] += 1
            if key and (key not in self.owners or self.owners[key][0] == chosen.replica_id):
                self.owners[key] = (chosen.replica_id, self.owners.get(key, (None, 0))[1] + 1)
            return chosen

    def end(self, token: str) -> None:
        with self.lock:
            if self._forget(token):
                return
            now = time.monotonic()
            self.ended[token] = now  # the router may yet be asked for it
            for old, at in list(self.ended.items()):  # oldest first: those the router never asked for
                if now - at < ENDED_S:
                    break
                del self.ended[old]

    def _forget(self, token: str) -> bool:
        if token not in self.sent:
            return False
        replica, key = self.sent.pop(token)
        self.rows[replica] -= 1
        if not self.rows[replica]:
            del self.rows[replica]
        if key in self.owners and self.owners[key][0] == replica:
            left = self.owners[key][1] - 1
            self.owners[key] = (replica, left)
            if not left:
                del self.owners[key]
        return True


LEDGER = Ledger()  # in the front's process, where Ray Serve runs the router of the front's handle
