"""HTTP client for rollout engines speaking SGLang's native API (real SGLang or the embedded engine).
It lives with the engines so that both rollout (generation, abort) and weight_sync (pause, weight
updates, memory release) import it downward.

The JSON bodies are payloads.py's (one function per endpoint, SGLang's own field names; fields left
at None are not sent). `EngineClient` (sync) and `AsyncEngineClient` share those builders and the
endpoint table; they differ only in how a request is sent.

Errors: any status >= 400 raises `EngineError` naming the URL, endpoint, status and the server's
message (SGLang answers {"error": {"message"}}, {"success": false, "message"} or plain text).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import urllib.parse
from collections.abc import Sequence
from typing import Any

import httpx

from slime_rl.engines.payloads import (
    DEFAULT_GROUP,
    abort_request_payload,
    begin_weight_update_payload,
    continue_generation_payload,
    destroy_weights_update_group_payload,
    end_weight_update_payload,
    generate_payload,
    get_weights_by_name_payload,
    init_weights_update_group_payload,
    load_lora_adapter_from_tensors_payload,
    load_lora_adapter_payload,
    memory_occupation_payload,
    pause_generation_payload,
    unload_lora_adapter_payload,
    update_weight_version_payload,
    update_weights_from_disk_payload,
    update_weights_from_distributed_payload,
    update_weights_from_tensor_payload,
)


class EngineError(RuntimeError):
    def __init__(self, url: str, endpoint: str, status: int | None, message: str) -> None:
        self.url, self.endpoint, self.status, self.message = url, endpoint, status, message
        where = f"{url}{endpoint}"
        super().__init__(f"engine {where} answered {status}: {message}" if status is not None
                         else f"engine {where} unreachable: {message}")


class AdapterChoice:
    """The LoRA adapter a rollout's /generate requests name (`lora_path`, --lora-sync adapter): one object
    shared by the rollout's clients, set after each weight sync; `name` None: the base model (no field)."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name


class _Endpoints:
    """Endpoint methods shared by both clients; `_call` sends (sync) or returns a coroutine (async)."""

    # /generate takes SGLang's batch form (lists of input_ids, sampling_params, rid, image_data):
    # GenerateReqInput.normalize_batch_and_arguments, answered as a list in the same order
    batch_generate = True
    # every /generate names this adapter unless its body names one (set by the rollout's owner)
    adapter: AdapterChoice | None = None

    def _call(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        raise NotImplementedError

    def generate(self, input_ids: Any = None, sampling_params: dict[str, Any] | None = None,
                 return_logprob: bool = True, rid: Any = None, image_data: Any = None, **kwargs: Any) -> Any:
        """POST /generate: one response dict, or a list of them for a batch of prompts."""
        return self._call("POST", "/generate", self._with_adapter(generate_payload(
            input_ids, sampling_params or {}, return_logprob, rid, image_data, **kwargs)))

    def generate_body(self, body: dict[str, Any]) -> Any:
        """POST /generate with a body built elsewhere (a user's function, SGLang's field names)."""
        return self._call("POST", "/generate", self._with_adapter(dict(body)))

    def _with_adapter(self, body: dict[str, Any]) -> dict[str, Any]:
        name = self.adapter.name if self.adapter is not None else None
        if name is not None and body.get("lora_path") is None:
            body["lora_path"] = name  # one name for every prompt of a batch body (SGLang repeats it)
        return body

    def get_model_info(self) -> Any:
        """GET /model_info (SGLang 0.5.23 logs /get_model_info as deprecated; both answer the same)."""
        return self._call("GET", "/model_info")

    def get_server_info(self) -> Any:
        """GET /server_info (the non-deprecated name of /get_server_info)."""
        return self._call("GET", "/server_info")

    def flush_cache(self) -> Any:
        return self._call("POST", "/flush_cache")

    def pause_generation(self, mode: str = "abort") -> Any:
        return self._call("POST", "/pause_generation", pause_generation_payload(mode))

    def continue_generation(self) -> Any:
        return self._call("POST", "/continue_generation", continue_generation_payload())

    def abort_request(self, rid: str = "", abort_all: bool = False) -> Any:
        return self._call("POST", "/abort_request", abort_request_payload(rid, abort_all))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = DEFAULT_GROUP, backend: str = "nccl") -> Any:
        return self._call("POST", "/init_weights_update_group", init_weights_update_group_payload(
            master_address, master_port, rank_offset, world_size, group_name, backend))

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[Any],
                                        shapes: Sequence[Sequence[int]], group_name: str = DEFAULT_GROUP,
                                        flush_cache: bool = True, weight_version: str | None = None,
                                        **kwargs: Any) -> Any:
        return self._call("POST", "/update_weights_from_distributed", update_weights_from_distributed_payload(
            names, dtypes, shapes, group_name, flush_cache, weight_version, **kwargs))

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> Any:
        return self._call("POST", "/destroy_weights_update_group", destroy_weights_update_group_payload(group_name))

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        return self._call("POST", "/get_weights_by_name", get_weights_by_name_payload(name, truncate_size))

    def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> Any:
        return self._call("POST", "/update_weight_version",
                          update_weight_version_payload(new_version, abort_all_requests))

    def update_weights_from_tensor(self, serialized_named_tensors: Sequence[str], **kwargs: Any) -> Any:
        return self._call("POST", "/update_weights_from_tensor",
                          update_weights_from_tensor_payload(serialized_named_tensors, **kwargs))

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                 flush_cache: bool = True) -> Any:
        """POST /update_weights_from_disk: load every weight of the HF checkpoint folder `model_path`."""
        return self._call("POST", "/update_weights_from_disk",
                          update_weights_from_disk_payload(model_path, weight_version, flush_cache))

    def begin_weight_update(self, selector: str = "all") -> Any:
        """POST /begin_weight_update: SGLang 0.5.23 refuses weight updates outside this session."""
        return self._call("POST", "/begin_weight_update", begin_weight_update_payload(selector))

    def end_weight_update(self) -> Any:
        return self._call("POST", "/end_weight_update", end_weight_update_payload())

    def load_lora_adapter_from_tensors(self, lora_name: str, config_dict: dict[str, Any],
                                       serialized_named_tensors: Sequence[str], pinned: bool = False) -> Any:
        return self._call("POST", "/load_lora_adapter_from_tensors", load_lora_adapter_from_tensors_payload(
            lora_name, config_dict, serialized_named_tensors, pinned))

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> Any:
        return self._call("POST", "/load_lora_adapter", load_lora_adapter_payload(lora_name, lora_path, pinned))

    def unload_lora_adapter(self, lora_name: str) -> Any:
        return self._call("POST", "/unload_lora_adapter", unload_lora_adapter_payload(lora_name))

    def release_memory_occupation(self, tags: list[str] | None = None) -> Any:
        return self._call("POST", "/release_memory_occupation", memory_occupation_payload(tags))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> Any:
        return self._call("POST", "/resume_memory_occupation", memory_occupation_payload(tags))


def check_success(response: Any, url: str, endpoint: str) -> None:
    """A 200 answer of {"success": false, "message"} (some SGLang builds) as an EngineError too."""
    if isinstance(response, dict) and response.get("success") is False:
        raise EngineError(url, endpoint, 200, str(response.get("message")))


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _timeout(timeout: float | None) -> httpx.Timeout:
    # Generation can legitimately take minutes; `timeout` bounds every phase, connect is always bounded.
    return httpx.Timeout(timeout, connect=30.0 if timeout is None else min(timeout, 30.0))


def _decode(base_url: str, path: str, r: httpx.Response) -> Any:
    if r.status_code >= 400:
        raise EngineError(base_url, path, r.status_code, _message(r))
    if not r.content:
        return None
    if r.headers.get("content-type", "").startswith("application/json"):
        return r.json()
    return r.text


def _message(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text.strip() or r.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if err is not None:
            return str(err)
        for key in ("message", "detail"):
            if key in body:
                return str(body[key])
    return str(body)


class EngineClient(_Endpoints):
    """Blocking client of one engine (`base_url` like http://127.0.0.1:30000)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, headers=_headers(api_key), timeout=_timeout(timeout))
        self._has_sessions: bool | None = None  # /begin_weight_update exists there (None: not asked yet)

    def _call(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        try:
            r = self._http.request(method, path, json=payload)
        except httpx.HTTPError as e:
            raise EngineError(self.base_url, path, None, f"{type(e).__name__}: {e}") from e
        return _decode(self.base_url, path, r)

    def open_weight_update_session(self) -> bool:
        """/begin_weight_update; False (and no call next time) on a server without sessions: SGLang
        before 0.5.23 has no such route and answers 404, and accepts updates without a session. The
        answer decides, not a version string (builds of one version differ)."""
        if self._has_sessions is False:
            return False
        try:
            check_success(self.begin_weight_update(), self.base_url, "/begin_weight_update")
        except EngineError as e:
            if e.status != 404:
                raise
            self._has_sessions = False
            return False
        self._has_sessions = True
        return True

    def close_weight_update_session(self) -> None:
        """/end_weight_update, on a server where `open_weight_update_session` opened one."""
        if self._has_sessions:
            check_success(self.end_weight_update(), self.base_url, "/end_weight_update")

    def health(self) -> bool:
        """True when GET /health answers 200; False when it answers otherwise or not at all."""
        try:
            return self._http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KeepAliveEngineClient(EngineClient):
    """EngineClient whose endpoint calls go over the stdlib's http.client, one kept-alive connection
    per calling thread: ~0.3 ms a call against the embedded engine where httpx takes ~0.9-1.3 ms
    (measured on CPU), which weight sync pays 2 + buckets times per sync (pause, one per bucket,
    continue). Same payloads, answers and EngineErrors; `health` stays on httpx."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float | None = None) -> None:
        super().__init__(base_url, api_key, timeout)
        url = urllib.parse.urlsplit(self.base_url)
        self._conn_class = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        self._netloc, self._prefix, self._timeout = url.netloc, url.path, timeout
        self._send_headers = {"Content-Type": "application/json", **_headers(api_key)}
        self._local = threading.local()
        self._conns: list[http.client.HTTPConnection] = []
        self._conns_lock = threading.Lock()

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn, True
        conn = self._local.conn = self._conn_class(self._netloc, timeout=self._timeout)
        with self._conns_lock:
            self._conns.append(conn)
        return conn, False

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        conn.close()
        self._local.conn = None
        with self._conns_lock:
            if conn in self._conns:
                self._conns.remove(conn)

    def _call(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        body = None if payload is None else json.dumps(payload, separators=(",", ":")).encode()
        while True:
            conn, reused = self._connection()
            try:
                conn.request(method, self._prefix + path, body=body, headers=self._send_headers)
                r = conn.getresponse()
                content = r.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as e:
                self._drop(conn)  # a kept-alive connection the server closed while idle: once more, fresh
                if not reused:
                    raise EngineError(self.base_url, path, None, f"{type(e).__name__}: {e}") from e
            except (OSError, http.client.HTTPException) as e:
                self._drop(conn)
                raise EngineError(self.base_url, path, None, f"{type(e).__name__}: {e}") from e
        if r.will_close:
            self._drop(conn)
        return _decode(self.base_url, path, httpx.Response(r.status, headers=r.getheaders(), content=content))

    def close(self) -> None:
        with self._conns_lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()
        super().close()


class AsyncEngineClient(_Endpoints):
    """asyncio client of one engine; every endpoint method returns an awaitable."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=_headers(api_key),
                                       timeout=_timeout(timeout))

    async def _call(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        try:
            r = await self._http.request(method, path, json=payload)
        except httpx.HTTPError as e:
            raise EngineError(self.base_url, path, None, f"{type(e).__name__}: {e}") from e
        return _decode(self.base_url, path, r)

    async def health(self) -> bool:
        try:
            return (await self._http.get("/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncEngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncRouterClient(AsyncEngineClient):
    """asyncio client of an sglang-router in front of `engine_urls`, usable wherever one engine's client
    is: /generate (and the info GETs) go through the router, which picks the engine and forwards our
    Authorization header; every other endpoint (abort, pause, continue, weight updates) goes to each
    engine directly and answers a list, one entry per engine: sglang-router 0.3.2 has no route for
    /abort_request, /pause_generation or /continue_generation (it answers 404), and an abort by rid
    must reach whichever engine the router chose (the others drop a rid they do not hold).
    `num_engines` lets the load balancer allow `per_engine` requests in flight per engine behind the
    router."""

    # sglang-router parses /generate into its own GenerateRequest, whose sampling_params is one
    # object (and rid one string): a list of per-sample sampling_params does not pass it
    batch_generate = False
    ROUTED = frozenset({"/generate", "/model_info", "/server_info", "/get_model_info", "/get_server_info"})

    def __init__(self, router_url: str, engine_urls: Sequence[str], api_key: str | None = None,
                 timeout: float | None = None) -> None:
        if not engine_urls:
            raise ValueError("AsyncRouterClient: no engine URLs behind the router")
        super().__init__(router_url, api_key=api_key, timeout=timeout)
        self.engines = [AsyncEngineClient(u, api_key=api_key, timeout=timeout) for u in engine_urls]
        self.num_engines = len(self.engines)

    async def _call(self, method: str, path: str, payload: dict[str, Any] | None = None) -> Any:
        if path in self.ROUTED:
            return await super()._call(method, path, payload)
        return list(await asyncio.gather(*(e._call(method, path, payload) for e in self.engines)))

    async def aclose(self) -> None:
        await asyncio.gather(super().aclose(), *(e.aclose() for e in self.engines))
