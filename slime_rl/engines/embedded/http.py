"""The built-in engine's HTTP/1.1 transport: one asyncio event loop for every connection, h11 (httpx's
own HTTP/1.1 parser) for the protocol, and a bounded thread pool for the endpoint bodies.

Why not the stdlib's ThreadingHTTPServer: it holds one thread per connection for as long as the
connection lives, with no cap and no read deadline, so 200 clients that connect and send nothing hold
200 threads. Here an idle or stalled connection costs a socket and a coroutine; the work that blocks
(parsing bodies, weight updates, pause) runs on at most `workers` threads, and a /generate waiting for
the scheduler holds no thread at all (the engine wakes the loop when the request finishes).

Limits (`HttpLimits`):
- a request's head and body must arrive within `read_timeout_s` of its first byte (of the opening of
  the connection, for its first request); otherwise it is answered 408 and the connection closed;
- a kept-alive connection with no request for `idle_timeout_s` is closed;
- the application sees the head first (`Application.check_head`: the key, the announced size) and may
  refuse it before a byte of the body is read; the answer then carries `Connection: close` and the
  connection ends, so the unread body is never taken as a request. A body that grows past
  `max_request_bytes` while read (chunked) is refused likewise (413);
- at most `max_connections` open connections; one more is answered 503 and closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import h11

from slime_rl.config.builtin_engine import LISTEN_FD_ENV

logger = logging.getLogger(__name__)
_MAX_HEAD_BYTES = 64 << 10  # request line + headers (h11's default is 16 KiB)
_READ_CHUNK = 256 << 10
LISTEN_BACKLOG = 4096  # connections the kernel queues before accept (capped by net.core.somaxconn)
_SHUTDOWN_GRACE_S = 2.0
_LINGER_S = 1.0


@dataclass
class HttpLimits:
    max_request_bytes: int = 256 << 20
    read_timeout_s: float = 30.0
    idle_timeout_s: float = 300.0
    max_connections: int = 4096
    workers: int = 16


class Application(Protocol):
    def check_head(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, Any] | None:
        """Called on the event loop once the head is in: a refusal (status, payload) or None."""

    def handle(self, method: str, path: str, body: bytes) -> Awaitable[tuple[int, Any]]:
        """The answer: (status, payload); payload dict/list -> JSON, str -> text, None -> empty."""


class _Timeout(Exception):
    pass


def encode_payload(payload: Any) -> tuple[bytes, str]:
    if payload is None:
        return b"", "text/plain"
    if isinstance(payload, str):
        return payload.encode(), "text/plain; charset=utf-8"
    return json.dumps(payload).encode(), "application/json"


def _raw_answer(status: int, reason: str, message: str) -> bytes:
    """An answer written without h11, for a request whose head never came whole (h11 cannot answer it)."""
    body = json.dumps({"error": {"message": message}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode() + body


def inherited_socket() -> socket.socket | None:
    """The listening socket the launcher handed over (LISTEN_FD_ENV: its fd number, inherited), or None
    (the engine binds --host:--port itself). Taken out of the environment: the engine's own children
    do not inherit the fd."""
    fd = os.environ.pop(LISTEN_FD_ENV, None)
    if not fd:
        return None
    try:
        return socket.socket(fileno=int(fd))
    except (ValueError, OSError) as e:
        raise ValueError(f"${LISTEN_FD_ENV}={fd}: not the fd of a socket this process inherited ({e})") from e


class HttpServer:
    """Binds at construction (so the port is known at once); `serve_forever()` runs the loop in the calling
    thread until `shutdown()` (from another thread)."""

    def __init__(self, host: str, port: int, app: Application, limits: HttpLimits,
                 sock: socket.socket | None = None) -> None:
        """`sock`: a socket already bound to (host, port) (handed over by the launcher): listened on
        instead of binding the port here."""
        self.app, self.limits = app, limits
        # a rollout opens hundreds of connections at once: a long accept backlog
        if sock is None:
            self.sock = socket.create_server((host, port), backlog=LISTEN_BACKLOG)
        else:
            bound = sock.getsockname()[:2]
            if bound[1] != port or (host not in ("", "0.0.0.0") and bound[0] != host):
                raise ValueError(f"the socket handed over is bound to {bound[0]}:{bound[1]}, not {host}:{port}")
            sock.listen(LISTEN_BACKLOG)
            self.sock = sock
        self.server_address = self.sock.getsockname()
        self.pool = ThreadPoolExecutor(max_workers=limits.workers, thread_name_prefix="embedded-http")
        self.connections = 0
        self._busy = 0  # requests between their head and the end of their answer
        self._writers: set[asyncio.StreamWriter] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stop_requested = threading.Event()
        self._stopped = threading.Event()

    # ---- lifecycle ----
    def serve_forever(self) -> None:
        try:
            asyncio.run(self._main())
        finally:
            self._stopped.set()

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            # start_server listens again on the socket, with its own backlog (100) unless told
            server = await asyncio.start_server(self._connection, sock=self.sock, limit=_READ_CHUNK,
                                                backlog=LISTEN_BACKLOG)
        except OSError:
            # `shutdown` came before this loop existed and closed the socket: nothing to serve
            if self._stop_requested.is_set():
                return
            raise
        if self._stop_requested.is_set():
            self._stop.set()
        await self._stop.wait()
        # not `async with server`: since Python 3.12 its exit waits for every connection to close.
        # Requests being answered get a moment to finish (the engine, shut down first, has finished
        # them with an abort), then every connection is dropped.
        server.close()
        deadline = self.loop.time() + _SHUTDOWN_GRACE_S
        while self._busy and self.loop.time() < deadline:
            await asyncio.sleep(0.01)
        for writer in list(self._writers):
            writer.transport.abort()
        await asyncio.sleep(0)
        self.pool.shutdown(wait=False, cancel_futures=True)

    def shutdown(self) -> None:
        self._stop_requested.set()
        loop, stop = self.loop, self._stop
        if loop is not None and stop is not None:
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop has already ended
                pass
            self._stopped.wait(timeout=30)
        self.sock.close()

    def run_blocking(self, fn, *args) -> Awaitable:
        """Run fn(*args) on the bounded pool; await the result on the loop."""
        return asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # ---- one connection ----
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:  # headers and body are one write, but the client's next request should not wait
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.connections >= self.limits.max_connections:
            writer.write(_raw_answer(503, "Service Unavailable", f"more than {self.limits.max_connections} open "
                                     "connections (--http-max-connections)"))
            await _close(writer)
            return
        self.connections += 1
        self._writers.add(writer)
        linger = False
        try:
            linger = await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away
        except asyncio.CancelledError:
            pass  # shutdown: the loop ends
        except Exception:  # a server must outlive whatever one connection does
            logger.exception("embedded engine: connection failed")
        finally:
            self.connections -= 1
            self._writers.discard(writer)
            await _close(writer, reader if linger else None)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serve requests until the connection ends; True when it ends on a refusal whose body is unread."""
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD_BYTES)
        loop = asyncio.get_running_loop()
        lim = self.limits
        first = True
        while True:
            # wait for the head: a fresh connection has read_timeout_s to send it, a kept-alive one may
            # idle for idle_timeout_s before it starts, then has read_timeout_s for the rest
            started = bool(conn.trailing_data[0]) or first
            deadline = loop.time() + (lim.read_timeout_s if started else lim.idle_timeout_s)
            try:
                while True:
                    try:
                        event = conn.next_event()
                    except h11.RemoteProtocolError as e:
                        status = e.error_status_hint
                        writer.write(_raw_answer(status, "Bad Request" if status == 400 else "Error",
                                                 f"malformed HTTP request: {e}"))
                        return True
                    if event is not h11.NEED_DATA:
                        break
                    data = await _read(reader, deadline - loop.time())
                    if data and not started:
                        started, deadline = True, loop.time() + lim.read_timeout_s
                    conn.receive_data(data)
            except _Timeout:
                if started:  # half a head: say why before closing; an idle kept-alive connection just ends
                    writer.write(_raw_answer(408, "Request Timeout", f"the request head did not arrive within "
                                             f"{lim.read_timeout_s:g} s (--http-read-timeout)"))
                return False
            if isinstance(event, h11.ConnectionClosed):
                return False
            assert isinstance(event, h11.Request), event
            first = False
            self._busy += 1
            try:
                end = await self._exchange(conn, reader, writer, event, deadline)
                if end is not None:
                    return end
            finally:
                self._busy -= 1
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                return False
            conn.start_next_cycle()

    async def _exchange(self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        event: h11.Request, deadline: float) -> bool | None:
        """Read the body of `event` and answer it. None: the connection goes on; otherwise it ends, True when
        the client may still be sending a body we refused (then it is drained before closing)."""
        method, path = event.method.decode("latin-1"), event.target.decode("latin-1").split("?", 1)[0]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers}
        refusal = self.app.check_head(method, path, headers)
        if refusal is not None:
            await self._respond(conn, writer, *refusal, close=True, head_only=method == "HEAD")
            return True
        if conn.client_is_waiting_for_100_continue:
            writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
        body, refusal = await self._read_body(conn, reader, deadline)
        if refusal is not None:
            await self._respond(conn, writer, *refusal, close=True)
            return refusal[0] != 408  # a timed-out client sends nothing more: no drain
        status, payload = await self.app.handle(method, path, body)
        await self._respond(conn, writer, status, payload, head_only=method == "HEAD")
        return None

    async def _read_body(self, conn: h11.Connection, reader: asyncio.StreamReader,
                         deadline: float) -> tuple[bytes, tuple[int, Any] | None]:
        loop = asyncio.get_running_loop()
        parts, size = [], 0
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as e:
                return b"", (400, {"error": {"message": f"malformed HTTP body: {e}"}})
            if event is h11.NEED_DATA:
                try:
                    conn.receive_data(await _read(reader, deadline - loop.time()))
                except _Timeout:
                    return b"", (408, {"error": {"message": f"the request body did not arrive within "
                                                            f"{self.limits.read_timeout_s:g} s (--http-read-timeout)"}})
                continue
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > self.limits.max_request_bytes:
                    return b"", (413, {"error": {"message": f"body of more than {self.limits.max_request_bytes} "
                                                            "bytes: more than the engine takes (--max-request-bytes)"}})
                parts.append(event.data)
                continue
            if isinstance(event, h11.EndOfMessage):
                return b"".join(parts), None
            if isinstance(event, h11.ConnectionClosed):
                raise ConnectionResetError("the client closed the connection in the middle of its body")

    async def _respond(self, conn: h11.Connection, writer: asyncio.StreamWriter, status: int, payload: Any,
                       close: bool = False, head_only: bool = False) -> None:
        data, ctype = encode_payload(payload)
        headers = [("Content-Type", ctype), ("Content-Length", str(len(data)))]
        if close:
            headers.append(("Connection", "close"))
        head = conn.send(h11.Response(status_code=status, headers=headers))
        body = conn.send(h11.Data(data=data)) if data and not head_only else b""  # HEAD: the headers alone
        writer.write(head + body + conn.send(h11.EndOfMessage()))
        try:  # a client that does not read its answer is dropped, not waited for forever
            await asyncio.wait_for(writer.drain(), self.limits.idle_timeout_s)
        except TimeoutError as e:
            raise ConnectionResetError("the client did not read its answer") from e


async def _read(reader: asyncio.StreamReader, timeout: float) -> bytes:
    if timeout <= 0:
        raise _Timeout
    try:
        return await asyncio.wait_for(reader.read(_READ_CHUNK), timeout)
    except TimeoutError as e:
        raise _Timeout from e


async def _close(writer: asyncio.StreamWriter, reader: asyncio.StreamReader | None = None) -> None:
    """End the connection. With `reader`: our side is shut first and what the client still sends (the
    body of a refused request) is read and dropped for up to _LINGER_S, so that closing with unread
    bytes does not reset the connection before the client has read our answer (a lingering close)."""
    try:
        if writer.can_write_eof():
            writer.write_eof()
        if reader is not None and not writer.transport.is_closing():
            deadline = asyncio.get_running_loop().time() + _LINGER_S
            while await _read(reader, deadline - asyncio.get_running_loop().time()):
                pass
    except (OSError, _Timeout):
        pass
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), 1.0)
    except (OSError, TimeoutError):
        pass
