"""`serve --replicas`' routing, without an engine: Ray Serve with the real front, router and prompt keys before two
stub replicas that take 0.3 s a row and answer their rank.  A prompt's copies in flight reach one replica (where
an engine runs them once); other requests are spread by rows outstanding; the front refuses a body past its bound
as the routes do, cancels the replica's call when its client goes, and answers 503 for a replica that died."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")  # eagle-extract[replicas]; a GPU machine's locked set has no Ray Serve yet

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.requests import Request

from eagle_extract.faces.routing import prompt_key

LONGEST = 100  # the front's body bound: what a prompt of 100 tokens needs
KEY = "the-key"


def test_a_prompts_key_is_what_makes_its_ids():
    rows, chat = "/v1/completions", "/v1/chat/completions"

    def key(path: str, body) -> str:
        return prompt_key(path, body if isinstance(body, bytes) else json.dumps(body).encode())

    ids = key(rows, {"prompt": [1, 2, 3]})
    assert ids and key(rows, {"prompt": [[1, 2, 3]], "model": "m", "max_tokens": 1}) == ids  # a batch of one
    assert key(rows, {"prompt": [1, 2, 3], "add_special_tokens": False}) == ids  # ids are ids
    others = [key(rows, {"prompt": [1, 2]}), key(rows, {"prompt": "1 2 3"}), key(chat, {"prompt": [1, 2, 3]})]
    assert len({ids, *others}) == 4
    text = key(rows, {"prompt": "hello"})
    assert key(rows, {"prompt": ["hello"]}) == key(rows, {"prompt": "hello", "add_special_tokens": True}) == text
    assert key(rows, {"prompt": "hello", "add_special_tokens": False}) != text  # the tokenizer reads it
    messages = [{"role": "user", "content": "hi"}]
    said = key(chat, {"messages": messages})
    assert key(chat, {"messages": messages, "add_generation_prompt": False, "temperature": 0}) == said
    assert said not in {key(chat, {"messages": messages, "add_generation_prompt": True}),
                        key(chat, {"messages": messages, "continue_final_message": True}),
                        key(chat, {"messages": [{"role": "user", "content": "hi!"}]})}  # fmt: skip
    for path, body in [("/health", b""), ("/v1/models", b""), (rows, b"{"), (rows, b"[1, 2]"), (chat, b"\xff")]:
        assert prompt_key(path, body) == "", (path, body)  # no row, or one its replica refuses: any replica


def test_the_ledger_counts_each_request_until_the_front_ends_it():
    """The router's bookkeeping without Ray: a prompt's copies follow the replica running it while it has room,
    other requests go to the replica with fewer rows; a request asked for again moves, and one the front ended
    before it was routed is never counted (Ray Serve's own callbacks come late or never for those)."""
    from types import SimpleNamespace

    from eagle_extract.faces.routing import Ledger

    a, b = (SimpleNamespace(replica_id=name, max_ongoing_requests=2) for name in "ab")
    ledger = Ledger()
    first = ledger.choose("t1", "p", [a, b])
    other = b if first is a else a
    assert ledger.choose("t2", "p", [a, b]) is first  # the copy follows its prompt
    assert ledger.choose("t3", "q", [a, b]) is other  # fewer rows there
    assert ledger.choose("t4", "p", [a, b]) is other  # the owner is full: the copy runs elsewhere, not waits
    assert ledger.choose("t5", "", [a, b]) is None  # every replica full
    ledger.end("t2")
    assert ledger.choose("t5", "", [a, b]) is first
    assert ledger.choose("t5", "", [a, b]) is first  # asked again: its first choice no longer counts
    for token in ("t1", "t3", "t4", "t5"):
        ledger.end(token)
    assert not (ledger.sent or ledger.rows or ledger.owners or ledger.ended)
    ledger.end("t6")  # its client went before the router chose: the choice, when it comes, is not counted
    ledger.choose("t6", "p", [a, b])
    assert not (ledger.sent or ledger.rows or ledger.owners or ledger.ended)


class Stub:
    """A replica with no engine: its own small app through routes.run_asgi, as a capture replica runs its routes."""

    def __init__(self, marks: str) -> None:
        from ray import serve

        rank = serve.get_replica_context().rank.rank
        self.app = FastAPI()

        @self.app.post("/v1/completions")
        async def row(request: Request):
            body = await request.json()
            if "mark" in body:
                Path(marks, f"arrived-{body['mark']}").touch()
            try:
                await asyncio.sleep(body.get("sleep", 0.3))
            except asyncio.CancelledError:
                Path(marks, f"cancelled-{rank}").touch()
                raise
            return JSONResponse({"rank": rank}, headers={"x-rank": str(rank)})

        @self.app.post("/die")
        async def die():
            os._exit(1)

    async def http(self, method: str, path: str, query: bytes, headers: list, body: bytes):
        from eagle_extract.faces.routes import run_asgi

        return await run_asgi(self.app, method, path, query, headers, body)


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    """The endpoint's URL and the stubs' folder of marks: one Ray and one Serve application for the module."""
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from eagle_extract.faces.fleet import Front, SamePromptFewestRows

    marks = tmp_path_factory.mktemp("marks")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"log_level": "ERROR"})
        router = RequestRouterConfig(request_router_class=SamePromptFewestRows)
        stubs = serve.deployment(Stub, name="capture", num_replicas=2, ray_actor_options={"num_cpus": 0},
                                 max_ongoing_requests=64, request_router_config=router)  # fmt: skip
        ahead = serve.deployment(Front, name="front", num_replicas=1, ray_actor_options={"num_cpus": 0},
                                 max_ongoing_requests=256)  # fmt: skip
        serve.run(ahead.bind(stubs.bind(str(marks)), LONGEST, KEY), name="routing", route_prefix="/")
        yield f"http://127.0.0.1:{port}", marks
    finally:
        ray.shutdown()  # a Ray of the test's own: Serve goes with it


def _post(url: str, body: bytes, timeout: float = 30, key: str = KEY) -> tuple[int, dict, dict]:
    headers = {"content-type": "application/json", "authorization": f"Bearer {key}"}
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def _together(url: str, bodies: list[bytes]) -> list[tuple[int, dict, dict]]:
    barrier = threading.Barrier(len(bodies))

    def send(body: bytes):
        barrier.wait()
        return _post(url + "/v1/completions", body)

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(send, bodies))


def test_a_prompts_copies_in_flight_reach_one_replica_and_other_requests_the_one_with_fewer(front):
    url, _ = front
    prompts = [[100 + p] * (p + 1) for p in range(8)]
    # 2 s a row (not in the key): every copy reaches the front while its prompt is in flight, on a loaded machine too
    bodies = [json.dumps({"prompt": prompts[i % 8] if i % 2 else [prompts[i % 8]], "sleep": 2}).encode()
              for i in range(32)]  # fmt: skip
    where = defaultdict(set)
    for i, (status, headers, answer) in enumerate(_together(url, bodies)):
        assert status == 200 and headers["x-rank"] == str(answer["rank"]), (status, headers, answer)
        where[i % 8].add(answer["rank"])
    assert len(where) == 8 and all(len(ranks) == 1 for ranks in where.values()), where  # each prompt: one replica
    assert set().union(*where.values()) == {0, 1}, where
    distinct = [json.dumps({"prompt": [200 + p], "sleep": 2}).encode() for p in range(16)]
    served = Counter(answer["rank"] for _, _, answer in _together(url, distinct))
    assert abs(served[0] - served[1]) <= 2, served  # each to the replica with fewer rows outstanding
    for p in range(2 * 64 + 8):  # one after another, more than both replicas hold at once: each one's count ends
        status, _, _ = _post(url + "/v1/completions", json.dumps({"prompt": [300 + p % 3], "sleep": 0}).encode())
        assert status == 200


def test_the_front_refuses_a_wrong_key_then_a_body_past_the_bound_as_the_routes_do(front):
    from eagle_extract.faces.requests import body_limit, too_large
    from eagle_extract.faces.routes import WRONG_KEY

    url, _ = front
    size = body_limit(LONGEST) + 1
    status, headers, answer = _post(url + "/v1/completions", b" " * size)
    assert status == 413 and answer["error"] == {"message": too_large(size, LONGEST), "type": "RequestTooLargeError",
                                                 "param": None, "code": 413}  # fmt: skip
    for body in (b" " * size, json.dumps({"prompt": [1]}).encode()):  # the key first: its body is never read
        status, headers, answer = _post(url + "/v1/completions", body, key="wrong")
        assert status == 401 and answer["error"]["message"] == WRONG_KEY, (status, answer)


def test_a_client_that_goes_away_cancels_the_replicas_call(front):
    url, marks = front
    body = json.dumps({"prompt": [7], "sleep": 30, "mark": "gone"}).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 30
        while not (marks / "arrived-gone").exists():  # in the replica's hands ...
            assert time.monotonic() < deadline, "the request never reached a replica"
            time.sleep(0.05)
    # ... when its client goes
    deadline = time.monotonic() + 10
    while not list(marks.glob("cancelled-*")):
        assert time.monotonic() < deadline, "the replica's call ran on after its client went away"
        time.sleep(0.1)


def test_a_replica_that_dies_with_a_request_is_answered_503(front):
    url, _ = front
    status, headers, answer = _post(url + "/die", b"{}")
    assert status == 503 and headers["retry-after"] == "1", (status, headers, answer)
    assert answer["error"]["type"] == "ServiceUnavailableError" and "ask again" in answer["error"]["message"]
