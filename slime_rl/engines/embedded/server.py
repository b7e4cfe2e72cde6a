"""HTTP front of the embedded engine: SGLang's native endpoints, served by an event loop (http.py).

Paths, request fields, response shapes and status codes follow SGLang 0.5.23
(python/sglang/srt/entrypoints/http_server.py): control endpoints answer {"success", "message"}
with 200 or 400; /pause_generation and /continue_generation answer {"message", "status": "ok"};
/abort_request answers an empty 200; /flush_cache answers plain text; errors are
{"error": {"message"}} with 400. With an API key, every path except /health*, /ready*, /metrics*
needs `Authorization: Bearer <key>` and otherwise gets 401 {"error": "Unauthorized"}
(sglang/srt/utils/auth.py, decide_request_auth).

One endpoint of our own (not SGLang's): GET or POST /weights_checksum (key required) answers
{"checksum", "tensors": {hf_name: sha256}, "weight_version"}, sha256 of each parameter's float32
bytes; the fault-tolerance test compares a restarted engine with the others and the trainer by it.
/server_info (and its deprecated name /get_server_info) also carries our "memory_occupation"
(engines/embedded/memory.py: released tags, parameter bytes held, CUDA bytes allocated by this
process), which the colocated tests read. /begin_weight_update and /end_weight_update: session.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import secrets
import threading
from collections.abc import Callable
from typing import Any

import torch

from slime_rl.config.builtin_engine import ServerConfig
from slime_rl.data.images import load_image_processor
from slime_rl.engines.embedded.adapters import EngineAdapters
from slime_rl.engines.embedded.engine import Engine
from slime_rl.engines.embedded.http import HttpLimits, HttpServer, inherited_socket
from slime_rl.engines.embedded.memory import MemoryOccupation
from slime_rl.engines.embedded.precision import apply_deterministic_attention, apply_precision_policy
from slime_rl.engines.embedded.protocol import build_response, parse_generate, seed_generator
from slime_rl.engines.embedded.request import GenRequest
from slime_rl.engines.embedded.routing import RoutingCapture
from slime_rl.engines.embedded.sampling import RequestError
from slime_rl.engines.embedded.session import WeightUpdateSession
from slime_rl.engines.embedded.vision import VisionInputs, is_vision_config
from slime_rl.engines.embedded.weights import WeightSync

logger = logging.getLogger(__name__)
OPEN_PREFIXES = ("/health", "/ready", "/metrics")
DEPRECATED = {"/get_model_info": "/model_info", "/get_server_info": "/server_info"}  # old -> new path
# the calls that change the weights or their group: one at a time (route: session.call_lock)
WEIGHT_UPDATE_CALLS = frozenset({"/init_weights_update_group", "/destroy_weights_update_group",
                                 "/update_weights_from_distributed", "/update_weights_from_tensor",
                                 "/update_weights_from_disk", "/begin_weight_update", "/end_weight_update"})
# SGLang's LoRA endpoints (adapters.py): one at a time with the calls above, outside any session
LORA_CALLS = frozenset({"/load_lora_adapter_from_tensors", "/load_lora_adapter", "/unload_lora_adapter"})


def decodes_on_slots(device: str, disable_cuda_graph: bool, static_kv_cache: bool, deterministic: bool) -> bool:
    """Whether decode steps run on the static slot cache (slots.py, graphs.py) rather than the dynamic
    left-padded one: on CUDA with graphs; with --static-kv-cache anywhere; and on CUDA under
    --enable-deterministic-inference even with --disable-cuda-graph, because its flash decode
    attention (the trainer's kernel, attention.py) runs on the slot cache only. Without that last
    rule, deterministic inference with graphs off decoded on the dynamic path and the loop's bf16
    gap was 2e-2 instead of 3e-5 (SmolLM2 on an H200, BENCHMARKS.md, 2026-12-03)."""
    cuda = torch.device(device).type == "cuda"
    return (cuda and not disable_cuda_graph) or static_kv_cache or (cuda and deterministic)


def _hf_config(model_path: str, auto_config: Any) -> Any:
    """transformers' config of the checkpoint; a family transformers runs under another model_type (Kimi-K2:
    DeepSeek-V3's classes, config/families.py transformers_model_type) is read through that one."""
    import os

    from slime_rl.config.families import FAMILIES, transformers_config

    path = os.path.join(model_path, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            raw = json.load(f)
        family = FAMILIES.get(raw.get("model_type", ""))
        if family is not None and family.transformers_model_type:
            return transformers_config(raw)
    return auto_config.from_pretrained(model_path)


def refuse_unserved_family(model_type: str) -> None:
    """ValueError, one sentence, for a family whose layers the engine's batching cannot run: Qwen3-Next's Gated
    DeltaNet layers keep a convolution and a recurrent state per sequence, which the engine's left-padded
    DynamicCache batches (batch.py: key/value tensors merged, split and trimmed by position) do not hold; GLM-5's
    sparse attention keeps its indexer's keys in a cache of its own beside them."""
    from slime_rl.config.families import FAMILIES

    family = FAMILIES.get(model_type)
    if family is not None and family.dsa:
        raise ValueError(f"model_type {model_type!r}: the built-in engine does not serve its sparse attention, whose "
                         "indexer keeps a key cache beside the key/value cache that its left-padded batches do not "
                         "hold; use --rollout-backend sglang")
    if family is not None and family.gated_delta_net:
        raise ValueError(f"model_type {model_type!r}: the built-in engine does not serve its Gated DeltaNet "
                         "(linear attention) layers, whose recurrent state its left-padded key/value cache batches "
                         "do not hold; use --rollout-backend sglang")


class EmbeddedServer:
    """Loads the model, starts the scheduler and serves HTTP (call `start()` or `serve_forever()`)."""

    def __init__(self, cfg: ServerConfig) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self.cfg = cfg
        dtype = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16, "half": torch.float16}.get(cfg.dtype)
        if dtype is None:
            raise ValueError(f"--dtype {cfg.dtype}: expected float32, bfloat16 or float16")
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        torch.manual_seed(cfg.random_seed)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        self.vision: VisionInputs | None = None
        hf = _hf_config(cfg.model_path, AutoConfig)
        refuse_unserved_family(getattr(hf, "model_type", ""))
        if is_vision_config(hf):  # Qwen2.5-VL: the image-text class holds the vision tower
            from transformers import AutoModelForImageTextToText
            self.model = AutoModelForImageTextToText.from_pretrained(cfg.model_path, dtype=dtype).to(cfg.device).eval()
            self.vision = VisionInputs(hf, load_image_processor(cfg.model_path), self.tokenizer)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(cfg.model_path, config=hf,
                                                              dtype=dtype).to(cfg.device).eval()
        # bf16/fp16: the fp32 islands SGLang and the trainer keep (RMSNorm weight, lm head)
        apply_precision_policy(self.model, fp32_lm_head=cfg.enable_fp32_lm_head)
        if cfg.enable_deterministic_inference and torch.device(cfg.device).type == "cuda":
            # decode attention by the trainer's flash kernel over a time-major slot cache (attention.py)
            n = apply_deterministic_attention(self.model)
            logger.info("embedded engine: deterministic inference: flash decode attention in %d layers", n)
        hf = self.model.config
        eos = set()
        try:
            gen_eos = GenerationConfig.from_pretrained(cfg.model_path).eos_token_id
        except OSError:  # no generation_config.json
            gen_eos = None
        for ids in (gen_eos, getattr(hf.get_text_config(), "eos_token_id", None), self.tokenizer.eos_token_id):
            eos.update([ids] if isinstance(ids, int) else (ids or []))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(eos, default=0)
        self.vocab_size = hf.get_text_config().vocab_size
        self.context_len = getattr(hf.get_text_config(), "max_position_embeddings", 4096)
        cuda_graph = torch.device(cfg.device).type == "cuda" and not cfg.disable_cuda_graph
        static = decodes_on_slots(cfg.device, cfg.disable_cuda_graph, cfg.static_kv_cache,
                                  cfg.enable_deterministic_inference)
        routing = None
        if cfg.enable_return_routed_experts or cfg.routing_select_round:
            routing = RoutingCapture(self.model, cfg.routing_select_round)
            if not cfg.enable_return_routed_experts:
                routing.keep = False
        self.engine = Engine(self.model, self.tokenizer, eos, pad, cfg.max_running_requests, cfg.random_seed,
                             static_cache=static, cuda_graph=cuda_graph,
                             cuda_graph_max_bs=cfg.cuda_graph_max_bs, overlap=not cfg.disable_overlap_schedule,
                             compile_max_bs=cfg.torch_compile_max_bs if cfg.enable_torch_compile else 0,
                             routing=routing)
        self.weights = WeightSync(self.model, self.engine, cfg.weight_version, cfg.colocated_devices,
                                  cfg.weight_group_timeout_s)
        self.memory = self.weights.memory = MemoryOccupation(self.engine, self.weights.params,
                                                             cpu_backup=cfg.enable_weights_cpu_backup)
        self.adapters = self.weights.adapters = EngineAdapters(self.engine, self.weights.params)
        self.session = WeightUpdateSession()
        self._weight_calls: asyncio.Lock | None = None  # made on the server's loop (handle)
        self._rid_counter = itertools.count()
        self._seed_warned = False
        self.http = HttpServer(cfg.host, cfg.port, self, HttpLimits(
            max_request_bytes=cfg.max_request_bytes, read_timeout_s=cfg.read_timeout_s,
            idle_timeout_s=cfg.idle_timeout_s, max_connections=cfg.max_connections, workers=cfg.http_workers),
            sock=inherited_socket())
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.http.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> EmbeddedServer:
        self._thread = threading.Thread(target=self.http.serve_forever, name="embedded-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.http.serve_forever()

    def shutdown(self) -> None:
        # the engine first: it finishes the running requests (abort, "Server shutting down") and the
        # transport gets a moment to send those answers before it drops the connections
        self.engine.shutdown()
        self.http.shutdown()

    def next_rid(self) -> str:
        return f"embedded-{next(self._rid_counter)}-{secrets.token_hex(4)}"

    # ---- endpoint bodies: (status, payload); payload dict/list -> JSON, str -> text, None -> empty ----
    def generate(self, body: Any) -> tuple[int, Any]:
        """/generate from a blocking caller (the pool's threads: /health_generate)."""
        reqs, is_batch = self._prepare_generate(body)
        self.engine.submit(reqs)
        for r in reqs:
            r.done.wait()
        return self._generate_result(reqs, is_batch, body)

    def _prepare_generate(self, body: Any) -> tuple[list[GenRequest], bool]:
        refused = self.adapters.refusal(body)
        if refused is not None:
            raise RequestError(refused)
        reqs, is_batch = parse_generate(body, self.tokenizer, self.vocab_size, self.context_len, self.next_rid,
                                        self.vision)
        for r in reqs:
            if self.cfg.enable_deterministic_inference:
                seed_generator(r, self.engine.device)
            elif r.params.sampling_seed is not None and not self._seed_warned:
                self._seed_warned = True  # SGLang ignores it silently; say it once
                logger.warning("sampling_seed ignored: the engine was started without "
                               "--enable-deterministic-inference (as SGLang 0.5.23 does)")
        return reqs, is_batch

    def _generate_result(self, reqs: list[GenRequest], is_batch: bool, body: dict) -> tuple[int, Any]:
        failed = [r.finish_reason for r in reqs if (r.finish_reason or {}).get("status_code")]
        if failed:
            return failed[0]["status_code"], {"error": {"message": failed[0]["message"]}}
        text_lp = bool(body.get("return_text_in_logprobs"))
        outs = [build_response(r, self.tokenizer, self.weights.weight_version, text_lp) for r in reqs]
        return 200, outs if is_batch else outs[0]

    async def _generate_async(self, raw: bytes) -> tuple[int, Any]:
        """/generate on the event loop: parse and answer on the pool, wait for the scheduler on no thread."""
        status, prep = await self.http.run_blocking(self._guarded, "/generate", self._parse_and_prepare, raw)
        if status:
            return status, prep
        body, (reqs, is_batch) = prep
        loop = asyncio.get_running_loop()
        waits = [loop.create_future() for _ in reqs]
        for r, fut in zip(reqs, waits, strict=True):
            r.on_done = _waker(loop, fut)
        self.engine.submit(reqs)
        await asyncio.gather(*waits)
        return await self.http.run_blocking(self._guarded, "/generate", self._generate_result, reqs, is_batch, body)

    def _parse_and_prepare(self, raw: bytes) -> tuple[int, Any]:
        body = _parse_body(raw)
        return 0, (body, self._prepare_generate(body))

    def health_generate(self) -> tuple[int, Any]:
        if not self.engine.is_alive():
            return 503, None
        if self.engine.paused is not None or self.engine.load()["num_running_reqs"]:
            return 200, None  # SGLang: a busy (or paused) server is not probed with a generation
        active = self.adapters.active
        status, _ = self.generate({"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                                   "lora_path": active.name if active is not None else None})
        return status, None

    def model_info(self) -> dict:
        hf = self.model.config
        return {"model_path": self.cfg.model_path, "served_model_name": self.cfg.model_path,
                "tokenizer_path": self.cfg.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.weights.weight_version,
                "load_format": "auto", "has_image_understanding": self.vision is not None,
                "has_audio_understanding": False,
                "model_type": getattr(hf, "model_type", None), "architectures": getattr(hf, "architectures", None)}

    def server_info(self) -> dict:
        return {"model_path": self.cfg.model_path, "host": self.cfg.host, "port": self.cfg.port,
                "random_seed": self.cfg.random_seed, "dtype": self.cfg.dtype, "device": self.cfg.device,
                "max_running_requests": self.cfg.max_running_requests, "tp_size": 1,
                "colocated_devices": self.cfg.colocated_devices,
                "internal_states": [self.engine.load()], "version": "embedded",
                "memory_occupation": self.memory.info()}

    def weights_checksum(self) -> dict:
        if self.memory.weights_released:
            raise RequestError("the weights are released (/release_memory_occupation): nothing to checksum")
        tensors = {}
        with self.engine.model_lock:
            for name, param in sorted(self.weights.params.items()):
                # a copy: numpy() marks a storage not resizable (colocated release resizes them)
                data = param.detach().to("cpu", torch.float32, copy=True).numpy().tobytes()
                tensors[name] = hashlib.sha256(data).hexdigest()
        total = hashlib.sha256("".join(f"{k}={v};" for k, v in tensors.items()).encode()).hexdigest()
        return {"checksum": total, "tensors": tensors, "weight_version": self.weights.weight_version}

    def route(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        w = self.weights
        if path == "/health":
            return (200 if self.engine.is_alive() else 503), None
        if path == "/health_generate":
            return self.health_generate()
        if path in DEPRECATED:  # SGLang 0.5.23 still answers the old names, with a warning in its log
            logger.warning("Endpoint '%s' is deprecated and will be removed in a future version. Please use "
                           "'%s' instead.", path, DEPRECATED[path])
            path = DEPRECATED[path]
        if path == "/model_info":
            return 200, self.model_info()
        if path == "/server_info":
            return 200, self.server_info()
        if path == "/weights_checksum":
            return 200, self.weights_checksum()
        if method == "GET" and path not in ("/flush_cache", "/get_weights_by_name"):
            return 405, {"detail": "Method Not Allowed"}
        if path == "/generate":
            return self.generate(body)
        if path == "/flush_cache":  # no prefix cache to flush; SGLang answers text
            return 200, "Cache flushed.\n"
        if path == "/abort_request":
            self.engine.abort(rid=_opt(body, "rid", str, ""), abort_all=bool(_opt(body, "abort_all", bool, False)))
            return 200, None
        if path == "/pause_generation":
            mode = _opt(body, "mode", str, "abort")
            if mode not in ("abort", "retract", "in_place"):
                raise RequestError(f"mode: {mode!r} is not one of 'abort', 'retract', 'in_place'")
            self.engine.pause(mode)
            return 200, {"message": "Generation paused successfully.", "status": "ok"}
        if path == "/continue_generation":
            self.engine.resume()
            return 200, {"message": "Generation continued successfully.", "status": "ok"}
        if path == "/release_memory_occupation":  # SGLang answers an empty 200 to both
            self.memory.release(body)
            self.weights.forget_plans()
            return 200, None
        if path == "/resume_memory_occupation":
            self.memory.resume(body)
            return 200, None
        if path == "/get_weights_by_name":
            return 200, w.get_by_name(body)
        if path == "/update_weight_version":
            version = _opt(body, "new_version", str, None)
            if version is None:
                raise RequestError("new_version: required")
            if _opt(body, "abort_all_requests", bool, True):
                self.engine.abort(abort_all=True)
            w.weight_version = version
            return 200, {"success": True, "message": f"Weight version updated to {version}",
                         "new_version": version}
        lora = {"/load_lora_adapter_from_tensors": self.adapters.load_from_tensors,
                "/load_lora_adapter": self.adapters.load_from_path, "/unload_lora_adapter": self.adapters.unload}
        if path in lora:
            ok, message = lora[path](body if isinstance(body, dict) else {})
            return (200 if ok else 400), self.adapters.answer(ok, message)
        # the calls of WEIGHT_UPDATE_CALLS (handle queues them on the loop first)
        ops = {"/init_weights_update_group": w.init_group, "/destroy_weights_update_group": w.destroy_group,
               "/update_weights_from_distributed": w.update_from_distributed,
               "/update_weights_from_tensor": w.update_from_tensor, "/update_weights_from_disk": w.update_from_disk,
               "/begin_weight_update": self.session.begin, "/end_weight_update": self.session.end}
        if path in ops:
            with self.session.call_lock:  # SGLang: one weight-update call at a time, for the whole call
                refused = self.session.refusal(path)
                if refused is not None:  # before the group is touched: this bucket's broadcast is not joined
                    return 400, {"success": False, "message": refused}
                ok, message = ops[path](body)
                self.session.note_result(path, ok)
            if path == "/update_weights_from_disk":  # UpdateWeightFromDiskReqOutput's fields
                return (200 if ok else 400), {"success": ok, "message": message, "num_paused_requests": 0}
            return (200 if ok else 400), {"success": ok, "message": message}
        return 404, {"detail": "Not Found"}

    # ---- the transport's application interface (http.py) ----
    def check_head(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, Any] | None:
        """The key and the size come from the headers: an unauthenticated or oversized body is refused
        without reading it (the transport then closes the connection, so its bytes are never taken)."""
        key = self.cfg.api_key
        if key and not path.startswith(OPEN_PREFIXES):
            scheme, _, token = (headers.get("authorization") or "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), key.encode()):
                return 401, {"error": "Unauthorized"}  # SGLang's body for it
        length = headers.get("content-length") or "0"  # h11 has refused one that is not a byte count
        if int(length) > self.cfg.max_request_bytes:
            return 413, {"error": {"message": f"body of {int(length)} bytes: more than the engine takes "
                                              f"({self.cfg.max_request_bytes}, --max-request-bytes)"}}
        if method not in ("GET", "HEAD", "POST", "PUT"):  # HEAD: GET's answer without its body (Starlette's)
            return 405, {"detail": "Method Not Allowed"}
        return None

    async def handle(self, method: str, path: str, raw: bytes) -> tuple[int, Any]:
        if path == "/health":  # on the loop: a liveness probe needs no thread
            return (200 if self.engine.is_alive() else 503), None
        if path == "/generate" and method in ("POST", "PUT"):
            return await self._generate_async(raw)
        if path in WEIGHT_UPDATE_CALLS or path in LORA_CALLS:
            # one at a time (SGLang's lock): the others wait here, on the loop, not on the pool's threads,
            # which /generate and /health_generate need (a call blocked for minutes, e.g. a group set-up
            # whose peer never comes, with callers queued behind it, used to take every thread)
            if self._weight_calls is None:
                self._weight_calls = asyncio.Lock()
            async with self._weight_calls:
                return await self.http.run_blocking(self._guarded, path, self._route_raw, method, path, raw)
        return await self.http.run_blocking(self._guarded, path, self._route_raw, method, path, raw)

    def _route_raw(self, method: str, path: str, raw: bytes) -> tuple[int, Any]:
        return self.route("GET" if method in ("GET", "HEAD") else "POST", path, _parse_body(raw))

    def _guarded(self, path: str, fn: Callable[..., tuple[int, Any]], *args: Any) -> tuple[int, Any]:
        """fn(*args) with its failures as answers: a bad request 400 naming the field, anything else 500."""
        try:
            return fn(*args)
        except RequestError as e:
            return 400, {"error": {"message": str(e)}}
        except Exception as e:  # a server must answer (and log) whatever broke in a handler
            logger.exception("%s failed", path)
            return 500, {"error": {"message": f"{type(e).__name__}: {e}"}}

def _opt(body: Any, name: str, kind: type, default: Any) -> Any:
    if not isinstance(body, dict):
        raise RequestError("body: expected a JSON object")
    value = body.get(name, default)
    if value is not None and not isinstance(value, kind):
        raise RequestError(f"{name}: expected {kind.__name__}")
    return value


class OversizedInt:
    """A JSON integer of more than MAX_INT_DIGITS digits, kept as its text: no field takes it (not an
    int, not a str), so the field's own check refuses it by name (400), where int() of 4,301+ digits
    would raise (500) and of fewer would cost quadratic time."""

    __slots__ = ("digits",)

    def __init__(self, digits: str) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"<an integer of {len(self.digits.lstrip('-'))} digits>"


# the longest integer a request field can hold: sampling_seed < 2**63 has 19 digits
MAX_INT_DIGITS = 64


def _json_int(text: str) -> int | OversizedInt:
    return OversizedInt(text) if len(text) > MAX_INT_DIGITS + 1 else int(text)


def _parse_body(raw: bytes) -> Any:
    try:
        return json.loads(raw, parse_int=_json_int) if raw.strip() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"body: invalid JSON ({e})") from e
    except RecursionError as e:
        raise RequestError("body: JSON nested too deeply") from e


def _waker(loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> Callable[[], None]:
    """A GenRequest.on_done that resolves `fut` on its loop (called from the scheduler's thread)."""
    def wake() -> None:
        try:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))
        except RuntimeError:  # the loop has ended (shutdown): nobody waits any more
            pass
    return wake
