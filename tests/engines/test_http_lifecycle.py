"""The built-in engine's HTTP transport shut down before its loop started: `shutdown` closes the
socket at once (no loop to stop yet), and a `serve_forever` that starts afterwards must return
quietly instead of dying in its thread on the closed socket (EBADF, seen as a stray thread
exception in the test suite when a server was stopped right after it was made)."""

from __future__ import annotations

import threading

from slime_rl.engines.embedded.http import HttpLimits, HttpServer


class _NoApp:
    def check_head(self, method, path, headers):
        return None

    async def handle(self, method, path, body):
        return 200, {}


def test_shutdown_before_the_loop_started_ends_serve_forever_quietly():
    server = HttpServer("127.0.0.1", 0, _NoApp(), HttpLimits())
    server.shutdown()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            server.serve_forever()
        except BaseException as e:  # noqa: BLE001 - recorded for the assertion
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive() and errors == []


def test_the_listening_socket_keeps_its_long_accept_backlog_once_serving():
    """asyncio's start_server listens again on the given socket with backlog 100 unless told: the kernel's
    accept queue (`ss -ltn`'s Send-Q of the listening socket) must stay at min(4096, somaxconn)."""
    import subprocess
    import time
    from pathlib import Path

    server = HttpServer("127.0.0.1", 0, _NoApp(), HttpLimits())
    port = server.server_address[1]
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 10
        while server.loop is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # start_server has listened again by now
        lines = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True,
                               check=True).stdout.split()
        somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
        assert int(lines[2]) == min(4096, somaxconn), lines
    finally:
        server.shutdown()
        t.join(timeout=30)
