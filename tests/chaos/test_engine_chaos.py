"""Chaos against the built-in engine's HTTP layer (issue #20), bounded loops on 127.0.0.1 and the tiny model:
1,000 malformed requests fuzzed from the schema while good requests run; stalled connections (nothing
sent, half a head, half a body) and big bodies while a good request is served. Each test prints its
figures ([chaos] lines; run with -s to see them)."""

from __future__ import annotations

import contextlib
import os
import random
import selectors
import socket
import threading
import time
from collections import Counter

import httpx
import pytest

from tests.chaos.malformed import draw, good_requests
from tests.engines.engine_testlib import start_server

KEY = "chaos-key"
MAX_BODY = 1 << 20
READ_TIMEOUT = 0.5


@pytest.fixture(scope="module")
def engine(tiny_qwen2):
    s = start_server(tiny_qwen2, api_key=KEY, random_seed=3, max_running_requests=16, max_request_bytes=MAX_BODY,
                     read_timeout_s=READ_TIMEOUT, max_connections=300)
    yield s
    s.shutdown()


def _client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"})


def _answers(url: str, bodies: list[dict]) -> list[tuple[list[int], list[float]]]:
    with _client(url) as c:
        out = []
        for b in bodies:
            r = c.post("/generate", json=b)
            assert r.status_code == 200, r.text
            meta = r.json()["meta_info"]
            out.append((r.json()["output_ids"], [lp for lp, _, _ in meta["output_token_logprobs"]]))
        return out


def _same(got: tuple[list[int], list[float]], ref: tuple[list[int], list[float]]) -> bool:
    return got[0] == ref[0] and all(abs(a - b) < 1e-4 for a, b in zip(got[1], ref[1], strict=True))


def test_1000_malformed_requests_while_good_ones_run(engine):
    goods = good_requests(3)
    reference = _answers(engine.url, goods)  # a quiet run
    stop = threading.Event()
    good_results: list[bool] = []
    good_errors: list[str] = []

    def good_loop(i: int) -> None:
        with _client(engine.url) as c:
            while not stop.is_set():
                r = c.post("/generate", json=goods[i])
                if r.status_code != 200:
                    good_errors.append(f"{r.status_code} {r.text[:200]}")
                    continue
                meta = r.json()["meta_info"]
                got = (r.json()["output_ids"], [lp for lp, _, _ in meta["output_token_logprobs"]])
                good_results.append(_same(got, reference[i]))

    statuses: Counter = Counter()
    wrong: list[str] = []
    lock = threading.Lock()

    def bad_loop(seed: int, n: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=engine.url, timeout=60) as c:
            for _ in range(n):
                bad = draw(rng, KEY, MAX_BODY)
                try:
                    r = c.request(bad.method, bad.path, content=bad.body, headers=bad.headers)
                    status = r.status_code
                except httpx.TransportError as e:  # no answer at all: a failure of the engine
                    status = f"no answer ({type(e).__name__})"
                with lock:
                    statuses[status] += 1
                    if not (isinstance(status, int) and 400 <= status < 500):
                        wrong.append(f"{bad.kind}: {status} {bad.body[:120]!r}")

    goods_threads = [threading.Thread(target=good_loop, args=(i,)) for i in range(len(goods))]
    bad_threads = [threading.Thread(target=bad_loop, args=(seed, 250)) for seed in range(4)]
    t0 = time.perf_counter()
    for t in goods_threads + bad_threads:
        t.start()
    for t in bad_threads:
        t.join()
    stop.set()
    for t in goods_threads:
        t.join()
    took = time.perf_counter() - t0

    assert sum(statuses.values()) == 1000
    assert not wrong, "\n".join(wrong[:20])
    assert not good_errors, good_errors[:5]
    assert good_results and all(good_results), f"{good_results.count(False)} good answers differ from the quiet run"
    # the engine is alive and gives the quiet run's answers after the storm
    assert engine.engine.is_alive()
    assert all(_same(g, r) for g, r in zip(_answers(engine.url, goods), reference, strict=True))
    print(f"\n[chaos] {sum(statuses.values())} malformed requests in {took:.1f} s, all 4xx "
          f"({dict(sorted(statuses.items()))}); {len(good_results)} good requests beside them, every one equal "
          f"to the quiet run; engine alive")


def _watch(socks: list[socket.socket], t0: float, limit_s: float = 10.0) -> list[tuple[float, float, bytes]]:
    """Watch every socket at once: per socket, seconds from t0 to the server's first byte and to its
    close (EOF), and what it sent (inf when it did not happen within limit_s)."""
    sel = selectors.DefaultSelector()
    seen = [[float("inf"), float("inf"), b""] for _ in socks]
    for i, s in enumerate(socks):
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
    open_ = len(socks)
    while open_ and time.perf_counter() - t0 < limit_s:
        for key, _ in sel.select(timeout=0.05):
            i, now = key.data, time.perf_counter() - t0
            try:
                chunk = key.fileobj.recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            except ConnectionResetError:
                chunk = b""
            if chunk:
                seen[i][0] = min(seen[i][0], now)
                seen[i][2] += chunk
            else:
                seen[i][1] = now
                seen[i][0] = min(seen[i][0], now)
                sel.unregister(key.fileobj)
                open_ -= 1
    sel.close()
    return [tuple(x) for x in seen]


def _probe_close(sock: socket.socket, deadline_s: float, t0: float | None = None) -> tuple[float, bytes]:
    first, _, data = _watch([sock], time.perf_counter() if t0 is None else t0, deadline_s)[0]
    return first, data


def _good_while(url: str, ref, body: dict) -> tuple[float, bool]:
    t0 = time.perf_counter()
    with _client(url) as c:
        r = c.post("/generate", json=body)
    meta = r.json()["meta_info"]
    ok = r.status_code == 200 and _same((r.json()["output_ids"], [lp for lp, _, _ in meta["output_token_logprobs"]]),
                                        ref)
    return time.perf_counter() - t0, ok


def test_stalled_connections_are_closed_and_a_good_request_is_served(engine):
    port = int(engine.url.rsplit(":", 1)[1])
    body = good_requests(1)[0]
    ref = _answers(engine.url, [body])[0]
    threads_before = threading.active_count()
    heads = [b"",  # connects and sends nothing
             b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Le",  # half a head
             b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
             + b"\r\nContent-Length: 100\r\n\r\n{\"input_ids\": "]  # the head, then half the body
    socks = []
    t_open = time.perf_counter()
    for i in range(200):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(heads[i % 3])
        socks.append((i % 3, s))
    opened = time.perf_counter() - t_open
    threads_during = threading.active_count()
    good: list = []
    runner = threading.Thread(target=lambda: good.append(_good_while(engine.url, ref, body)))
    runner.start()
    seen = _watch([s for _, s in socks], t_open)
    runner.join()
    good_latency, good_ok = good[0]
    answered = Counter(kind for (kind, _), (_, _, data) in zip(socks, seen, strict=True)
                       if data.startswith(b"HTTP/1.1 408"))
    latest = max(closed for _, closed, _ in seen)
    for _, s in socks:
        s.close()
    assert good_ok, "the good request was not answered correctly during the attack"
    # every stalled connection was answered 408 and closed about READ_TIMEOUT after it opened
    assert answered == {0: 67, 1: 67, 2: 66}, answered
    assert latest < opened + READ_TIMEOUT + 1.0, (latest, opened)  # answered and closed within a second
    assert threads_during - threads_before < 5  # the connections hold no thread (the stdlib server: 200)
    assert engine.engine.is_alive()
    print(f"\n[chaos] 200 stalled connections (nothing / half a head / half a body): all answered 408 and closed "
          f"{latest:.2f} s after the first opened (read timeout {READ_TIMEOUT} s, opening them took {opened:.2f} s); "
          f"threads +{threads_during - threads_before}; a good request beside them took {good_latency:.2f} s, "
          f"answered correctly")


def test_big_bodies_are_refused_at_once_and_a_good_request_is_served(engine):
    port = int(engine.url.rsplit(":", 1)[1])
    body = good_requests(2)[1]
    ref = _answers(engine.url, [body])[0]
    attacks = {
        "100 MB announced, no key": b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n",
        "100 MB announced, with the key": b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                                          + KEY.encode() + b"\r\nContent-Length: 100000000\r\n\r\n",
        "chunked past the cap": b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                                + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
                                + (b"%x\r\n" % (64 << 10) + b"a" * (64 << 10) + b"\r\n") * 20,
    }
    expect = {"100 MB announced, no key": b"HTTP/1.1 401", "100 MB announced, with the key": b"HTTP/1.1 413",
              "chunked past the cap": b"HTTP/1.1 413"}
    results: dict[str, float] = {}
    socks = []
    t0 = time.perf_counter()
    for name, raw in attacks.items():
        for _ in range(10):
            s = socket.create_connection(("127.0.0.1", port))
            socks.append((name, s))
            s.sendall(raw)
    good: list = []
    runner = threading.Thread(target=lambda: good.append(_good_while(engine.url, ref, body)))
    runner.start()
    seen = _watch([s for _, s in socks], t0)
    runner.join()
    good_latency, good_ok = good[0]
    for (name, s), (first, _, data) in zip(socks, seen, strict=True):
        assert data.startswith(expect[name]), (name, data[:200])
        results[name] = max(results.get(name, 0.0), first)
        s.close()
    # with httpx, a refused big body is read back as the refusal (the server drains it before closing)
    with httpx.Client(base_url=engine.url, timeout=30, headers={"Authorization": f"Bearer {KEY}"}) as c:
        r = c.post("/generate", content=b"x" * (4 * MAX_BODY))
        assert r.status_code == 413 and "--max-request-bytes" in r.text
    assert good_ok
    assert all(v < 1.0 for v in results.values()), results  # answered within a second
    assert engine.engine.is_alive()
    print("\n[chaos] big bodies, 10 connections each: " + ", ".join(f"{k}: answered within {v:.2f} s"
                                                                    for k, v in results.items())
          + f"; a good request beside them took {good_latency:.2f} s, answered correctly")


def test_connections_over_the_cap_are_answered_503(tiny_qwen2):
    s = start_server(tiny_qwen2, max_connections=20, read_timeout_s=5.0)
    try:
        port = int(s.url.rsplit(":", 1)[1])
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
        time.sleep(0.2)  # the loop has accepted them
        extra = socket.create_connection(("127.0.0.1", port))
        took, data = _probe_close(extra, 5.0)
        assert data.startswith(b"HTTP/1.1 503") and b"--http-max-connections" in data and took < 1.0
        for h in held:
            h.close()
        time.sleep(0.2)
        assert httpx.get(f"{s.url}/health", timeout=10).status_code == 200  # served again once they went
        print(f"\n[chaos] connection 21 of a cap of 20: 503 within {took:.3f} s; served again after")
    finally:
        s.shutdown()


# bodies json.dumps cannot write (4,301+ digit integers) or that Python writes only escaped (a lone
# surrogate): each raw, with the field the answer must name
BIG = "9" * 4301
RAW_BAD = {
    "lone surrogate in text": (r'{"text": "a \ud800 b", "sampling_params": {"max_new_tokens": 2}}', "text"),
    "lone surrogate in a text batch": (r'{"text": ["fine", "x\udfff"]}', "text"),
    "lone surrogate in stop": (r'{"input_ids": [1, 2], "sampling_params": {"stop": ["\udc00"]}}',
                               "sampling_params.stop"),
    "4301-digit input id": (f'{{"input_ids": [1, {BIG}]}}', "input_ids"),
    "70-digit input id": (f'{{"input_ids": [{"7" * 70}]}}', "input_ids"),
    "4301-digit max_new_tokens": (f'{{"input_ids": [1], "sampling_params": {{"max_new_tokens": {BIG}}}}}',
                                  "sampling_params.max_new_tokens"),
    "4301-digit stop token": (f'{{"input_ids": [1], "sampling_params": {{"stop_token_ids": [{BIG}]}}}}',
                              "sampling_params.stop_token_ids"),
    "400-digit temperature": (f'{{"input_ids": [1], "sampling_params": {{"temperature": {"1" * 400}}}}}',
                              "sampling_params.temperature"),
    "400-digit top_p": (f'{{"input_ids": [1], "sampling_params": {{"top_p": {"1" * 400}}}}}', "sampling_params.top_p"),
    "400-digit min_p": (f'{{"input_ids": [1], "sampling_params": {{"min_p": -{"1" * 400}}}}}',
                        "sampling_params.min_p"),
    "5000-digit negative seed": (f'{{"input_ids": [1], "sampling_params": {{"sampling_seed": -{"5" * 5000}}}}}',
                                 "sampling_params.sampling_seed"),
}


@pytest.mark.parametrize("name", list(RAW_BAD))
def test_bad_text_and_huge_numbers_are_400_naming_the_field(engine, name):
    """What answered 500 with a logged traceback before: a 400 whose message starts with the field."""
    raw, field = RAW_BAD[name]
    with _client(engine.url) as c:
        r = c.post("/generate", content=raw.encode(), headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (name, r.status_code, r.text[:300])
        assert r.json()["error"]["message"].startswith(f"{field}: "), r.text[:300]
        good = c.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
        assert good.status_code == 200


def _init_group(url: str, port: int, group: str, timeout: float = 120) -> tuple[int, str, float]:
    """POST /init_weights_update_group for rank 1 of 2 whose rank 0 (the store's host) listens nowhere."""
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": group, "backend": "gloo"}
    start = time.monotonic()
    with _client(url) as c:
        r = c.post("/init_weights_update_group", json=body, timeout=timeout)
    return r.status_code, r.text, time.monotonic() - start


def test_a_weight_group_whose_peer_never_comes_times_out_and_frees_the_lock(tiny_qwen2):
    """--weight-group-timeout: a set-up waiting for a rank that never comes answers 400 once the timeout
    has passed, and frees the weight-update lock for the next call (it held it for torch's 30 minutes).
    Callers queued behind it wait without holding the pool's threads: /generate and /health_generate
    answer meanwhile (with 2 threads and 3 such calls, they hung)."""
    from tests.conftest import free_port

    s = start_server(tiny_qwen2, api_key=KEY, http_workers=2, weight_group_timeout_s=1.5)
    try:
        results: list[tuple[int, str, float]] = []
        callers = [threading.Thread(target=lambda g=g: results.append(_init_group(s.url, free_port(), g)))
                   for g in ("a", "b", "c")]
        for t in callers:
            t.start()
        time.sleep(0.5)  # the first waits for its peer, two wait for the lock
        with _client(s.url) as c:
            start = time.monotonic()
            r = c.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 200, r.text
            assert c.get("/health_generate").status_code == 200
            assert time.monotonic() - start < 2.5  # answered while the first set-up still waits
        for t in callers:
            t.join(timeout=60)
        assert len(results) == 3
        for status, text, _ in results:
            assert status == 400 and "Failed to initialize custom process group" in text, text
        # one at a time, each for at least its whole timeout: the last answered after three of them
        assert max(took for _, _, took in results) >= 3 * 1.5
    finally:
        s.shutdown()


def test_sigterm_ends_the_engine_while_a_group_set_up_waits(tiny_qwen2, tmp_path):
    """The engine process exits on SIGTERM even while a pool thread waits for a weight group's peer
    (the interpreter's exit joins the pool's threads: a waiting one must not hold the process)."""
    import signal
    import subprocess

    from slime_rl.config.builtin_engine import ServerConfig
    from slime_rl.engines.launch import embedded_command
    from tests.conftest import free_port

    port = free_port()
    log = (tmp_path / "engine.log").open("w")
    proc = subprocess.Popen(embedded_command(ServerConfig(str(tiny_qwen2), "127.0.0.1", port,
                                                          weight_group_timeout_s=600)),
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "SLIME_RL_ENGINE_API_KEY": KEY})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "engine.log").read_text()[-2000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        def stuck() -> None:
            with contextlib.suppress(httpx.HTTPError):  # the engine goes away under it
                _init_group(url, free_port(), "stuck", timeout=30)

        threading.Thread(target=stuck, daemon=True).start()
        time.sleep(1.0)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, (tmp_path / "engine.log").read_text()[-2000:]
        assert time.monotonic() - start < 20
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
