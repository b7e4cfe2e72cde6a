"""remote_rm against a tiny loopback HTTP server: the request body, retries with backoff, and the
errors after the last try. Only 127.0.0.1 is contacted; every wait is bounded."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from slime_rl.data import Sample
from slime_rl.rewards import RemoteRewardError, RemoteRewardModel, call_reward_full, make_reward_fn, score_samples
from tests.conftest import free_port


class ScriptedServer:
    """Answers POSTs from a script of (status, body, delay_s); the last entry repeats."""

    def __init__(self, script: list[tuple[int, object, float]]) -> None:
        self.script = script
        self.requests: list[dict] = []
        self.times: list[float] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                outer.times.append(time.monotonic())
                status, answer, delay = outer.script[min(len(outer.requests), len(outer.script)) - 1]
                time.sleep(delay)
                data = (answer if isinstance(answer, str) else json.dumps(answer)).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                    pass

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/reward"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def hits(self) -> int:
        return len(self.requests)


@pytest.fixture()
def serve() -> Iterator:
    servers: list[ScriptedServer] = []

    def start(script: list[tuple[int, object, float]]) -> ScriptedServer:
        server = ScriptedServer(script)
        server.thread.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.httpd.shutdown()
        server.httpd.server_close()
        server.thread.join(timeout=5)


def sample(response: str = "r", **metadata) -> Sample:
    return Sample(index=3, group_index=1, prompt="What is 2+2?", prompt_ids=[1], label="4", response=response,
                  metadata=metadata)


def score(rm, s: Sample, key: str = "score") -> tuple[float, dict[str, float]]:
    return asyncio.run(call_reward_full(rm, s, key))


def test_fails_twice_then_answers(serve):
    server = serve([(500, "boom", 0), (503, "busy", 0), (200, {"score": 0.75, "helpful": 1, "tag": "x"}, 0)])
    rm = RemoteRewardModel(server.url, timeout_s=5, max_retries=3, backoff_s=0.05)
    assert score(rm, sample("four", source="gsm")) == (0.75, {"helpful": 1.0})
    assert server.hits == 3
    assert server.requests[0] == {"prompt": "What is 2+2?", "response": "four", "label": "4",
                                  "metadata": {"source": "gsm"}}
    gaps = [b - a for a, b in zip(server.times, server.times[1:], strict=False)]
    assert gaps[0] >= 0.05 and gaps[1] >= 0.1  # exponential backoff: 0.05 s, then 0.1 s


def test_always_failing_gives_a_clear_error_after_n_tries(serve):
    server = serve([(503, "overloaded", 0)])
    rm = RemoteRewardModel(server.url, timeout_s=5, max_retries=2, backoff_s=0.01)
    with pytest.raises(RemoteRewardError) as err:
        score(rm, sample())
    assert server.hits == 3
    msg = str(err.value)
    assert server.url in msg and "no answer after 3 tries" in msg and "HTTP 503: overloaded" in msg


def test_timeouts_are_retried_then_reported(serve):
    server = serve([(200, 1.0, 2.0)])  # answers, but after the client gave up
    rm = RemoteRewardModel(server.url, timeout_s=0.3, max_retries=1, backoff_s=0.01)
    start = time.monotonic()
    with pytest.raises(RemoteRewardError, match=r"after 2 tries \(timeout 0.3s each\); last error: .*Timeout"):
        score(rm, sample())
    assert time.monotonic() - start < 1.9  # gave up on both tries before the server's first answer
    deadline = time.monotonic() + 3  # the server may log the second request after the client left
    while server.hits < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.hits == 2


def test_refused_connection_is_retried_then_reported():
    url = f"http://127.0.0.1:{free_port()}/reward"  # nothing listens there
    rm = RemoteRewardModel(url, timeout_s=1, max_retries=1, backoff_s=0.01)
    with pytest.raises(RemoteRewardError, match=rf"{re.escape(url)}: no answer after 2 tries .*ConnectError"):
        score(rm, sample())


def test_client_errors_and_bad_bodies_fail_at_once(serve):
    server = serve([(400, "bad request", 0)])
    rm = RemoteRewardModel(server.url, timeout_s=5, max_retries=3, backoff_s=0.01)
    with pytest.raises(RemoteRewardError, match=r"HTTP 400 \(not retried\): bad request"):
        score(rm, sample())
    assert server.hits == 1
    server = serve([(200, "not json", 0)])
    with pytest.raises(RemoteRewardError, match="answer is not JSON"):
        score(RemoteRewardModel(server.url, max_retries=0), sample())
    server = serve([(200, ["a", "list"], 0)])
    with pytest.raises(RemoteRewardError, match="expected a number or an object with a score"):
        score(RemoteRewardModel(server.url, max_retries=0), sample())


def test_remote_rm_through_make_reward_fn_plain_float_and_reward_key(serve):
    server = serve([(200, 0.5, 0)])
    fn = make_reward_fn("remote_rm", None, rm_url=server.url)
    samples = [sample("a"), sample("b"), sample("\\boxed{4}", rm_type="math")]  # the last one is scored locally
    assert asyncio.run(score_samples(fn, samples)) == [0.5, 0.5, 1.0]
    assert server.hits == 2
    server = serve([(200, {"overall": 0.3, "format": 1.0}, 0)])
    fn = make_reward_fn("remote_rm", None, rm_url=server.url, reward_key="overall")
    assert score(fn, sample()) == (0.3, {"format": 1.0})


def test_bad_url_is_rejected_up_front():
    with pytest.raises(ValueError, match="--rm-url 'localhost:8000': expected an http"):
        RemoteRewardModel("localhost:8000")
