"""HTTP front of the embedded engine: SGLang's native endpoints on the stdlib ThreadingHTTPServer.

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

import hashlib
import itertools
import json
import logging
import secrets
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from slime_rl.data.images import load_image_processor
from slime_rl.engines.embedded.engine import Engine
from slime_rl.engines.embedded.memory import MemoryOccupation
from slime_rl.engines.embedded.precision import apply_precision_policy
from slime_rl.engines.embedded.protocol import build_response, parse_generate, seed_generator
from slime_rl.engines.embedded.sampling import RequestError
from slime_rl.engines.embedded.session import WeightUpdateSession
from slime_rl.engines.embedded.vision import VisionInputs, is_vision_config
from slime_rl.engines.embedded.weights import WeightSync

logger = logging.getLogger(__name__)
OPEN_PREFIXES = ("/health", "/ready", "/metrics")
DEPRECATED = {"/get_model_info": "/model_info", "/get_server_info": "/server_info"}  # old -> new path


@dataclass
class ServerConfig:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    random_seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    max_running_requests: int = 64
    weight_version: str = "default"
    num_threads: int | None = None  # torch.set_num_threads: process-wide, so left alone unless given
    # decoding (engine.py): on CUDA a static KV cache with CUDA graphs unless disable_cuda_graph;
    # static_kv_cache uses the static cache without graphs elsewhere (CPU) or with them disabled
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None  # larger batches run the static step eagerly
    static_kv_cache: bool = False
    # SGLang 0.5.23 honours a request's sampling_seed only under --enable-deterministic-inference
    # (sampling_batch_info builds the seeds only then); without it the seed is ignored
    enable_deterministic_inference: bool = False
    # SGLang's --enable-weights-cpu-backup: a release of "weights" keeps a host copy that a resume
    # restores; without it the released weights are gone and must be sent again (memory.py)
    enable_weights_cpu_backup: bool = False
    # SGLang's --enable-fp32-lm-head: fp32 logits (precision.py); RMSNorm rounds as SGLang's always
    enable_fp32_lm_head: bool = False
    # a body larger than this is refused (413) before it is read: weight updates travel over NCCL/IPC,
    # so the largest bodies are VL requests with images as data URLs
    max_request_bytes: int = 256 << 20


# a connection that sends nothing for this long is closed (a stalled client holds one thread until
# then); long /generate calls wait on the scheduler, not on the socket, so they are not cut
SOCKET_IDLE_TIMEOUT_S = 300.0


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
        hf = AutoConfig.from_pretrained(cfg.model_path)
        if is_vision_config(hf):  # Qwen2.5-VL: the image-text class holds the vision tower
            from transformers import AutoModelForImageTextToText
            self.model = AutoModelForImageTextToText.from_pretrained(cfg.model_path, dtype=dtype).to(cfg.device).eval()
            self.vision = VisionInputs(hf, load_image_processor(cfg.model_path), self.tokenizer)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=dtype).to(cfg.device).eval()
        # bf16/fp16: the fp32 islands SGLang and the trainer keep (RMSNorm weight, lm head)
        apply_precision_policy(self.model, fp32_lm_head=cfg.enable_fp32_lm_head)
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
        self.engine = Engine(self.model, self.tokenizer, eos, pad, cfg.max_running_requests, cfg.random_seed,
                             static_cache=cuda_graph or cfg.static_kv_cache, cuda_graph=cuda_graph,
                             cuda_graph_max_bs=cfg.cuda_graph_max_bs)
        self.weights = WeightSync(self.model, self.engine, cfg.weight_version)
        self.memory = self.weights.memory = MemoryOccupation(self.engine, self.weights.params,
                                                             cpu_backup=cfg.enable_weights_cpu_backup)
        self.session = WeightUpdateSession()
        self._rid_counter = itertools.count()
        self._seed_warned = False
        self.httpd = _Listener((cfg.host, cfg.port), _make_handler(self))
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> EmbeddedServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="embedded-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.engine.shutdown()

    def next_rid(self) -> str:
        return f"embedded-{next(self._rid_counter)}-{secrets.token_hex(4)}"

    # ---- endpoint bodies: (status, payload); payload dict/list -> JSON, str -> text, None -> empty ----
    def generate(self, body: Any) -> tuple[int, Any]:
        reqs, is_batch = parse_generate(body, self.tokenizer, self.vocab_size, self.context_len, self.next_rid,
                                        self.vision)
        for r in reqs:
            if self.cfg.enable_deterministic_inference:
                seed_generator(r, self.engine.device)
            elif r.params.sampling_seed is not None and not self._seed_warned:
                self._seed_warned = True  # SGLang ignores it silently; say it once
                logger.warning("sampling_seed ignored: the engine was started without "
                               "--enable-deterministic-inference (as SGLang 0.5.23 does)")
        self.engine.submit(reqs)
        for r in reqs:
            r.done.wait()
        failed = [r.finish_reason for r in reqs if (r.finish_reason or {}).get("status_code")]
        if failed:
            return failed[0]["status_code"], {"error": {"message": failed[0]["message"]}}
        text_lp = bool(body.get("return_text_in_logprobs"))
        outs = [build_response(r, self.tokenizer, self.weights.weight_version, text_lp) for r in reqs]
        return 200, outs if is_batch else outs[0]

    def health_generate(self) -> tuple[int, Any]:
        if not self.engine.is_alive():
            return 503, None
        if self.engine.paused is not None or self.engine.load()["num_running_reqs"]:
            return 200, None  # SGLang: a busy (or paused) server is not probed with a generation
        status, _ = self.generate({"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
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
        ops = {"/init_weights_update_group": w.init_group, "/destroy_weights_update_group": w.destroy_group,
               "/update_weights_from_distributed": w.update_from_distributed,
               "/update_weights_from_tensor": w.update_from_tensor,
               "/begin_weight_update": self.session.begin, "/end_weight_update": self.session.end}
        if path in ops:
            with self.session.call_lock:  # SGLang: one weight-update call at a time, for the whole call
                refused = self.session.refusal(path)
                if refused is not None:  # before the group is touched: this bucket's broadcast is not joined
                    return 400, {"success": False, "message": refused}
                ok, message = ops[path](body)
                self.session.note_result(path, ok)
            return (200 if ok else 400), {"success": ok, "message": message}
        return 404, {"detail": "Not Found"}


def _opt(body: Any, name: str, kind: type, default: Any) -> Any:
    if not isinstance(body, dict):
        raise RequestError("body: expected a JSON object")
    value = body.get(name, default)
    if value is not None and not isinstance(value, kind):
        raise RequestError(f"{name}: expected {kind.__name__}")
    return value


class _Listener(ThreadingHTTPServer):
    # the stdlib's accept backlog is 5: a rollout opens hundreds of connections at once, and the
    # ones over the backlog are reset (seen as ReadError in the client at 64 in flight)
    request_queue_size = 4096


def _make_handler(server: EmbeddedServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive for httpx clients
        timeout = SOCKET_IDLE_TIMEOUT_S
        # TCP_NODELAY: headers and body are two writes; with Nagle on, the body waits for the
        # client's delayed ACK (~40 ms on Linux) -- that was 44 ms per request, measured.
        disable_nagle_algorithm = True

        def log_message(self, fmt: str, *args: Any) -> None:
            logger.debug("%s " + fmt, self.address_string(), *args)

        def do_GET(self) -> None:
            self._handle("GET")

        def do_POST(self) -> None:
            self._handle("POST")

        def do_PUT(self) -> None:
            self._handle("POST")

        def _handle(self, method: str) -> None:
            path = self.path.split("?", 1)[0]
            # the key and the size come from the headers: an unauthenticated or oversized body is
            # refused without reading it (the connection is closed, so its bytes are never taken)
            key = server.cfg.api_key
            if key and not path.startswith(OPEN_PREFIXES):
                auth = self.headers.get("Authorization") or ""
                scheme, _, token = auth.partition(" ")
                if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), key.encode()):
                    return self._refuse(401, "Unauthorized")
            length = self.headers.get("Content-Length") or "0"
            if not length.isdigit():
                return self._refuse(400, f"Content-Length: expected a byte count, got {length[:40]!r}")
            if int(length) > server.cfg.max_request_bytes:
                return self._refuse(413, f"body of {int(length)} bytes: more than the engine takes "
                                         f"({server.cfg.max_request_bytes}, --max-request-bytes)")
            raw = self.rfile.read(int(length))
            try:
                body = json.loads(raw) if raw.strip() else {}
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                return self._send(400, {"error": {"message": f"body: invalid JSON ({e})"}})
            except RecursionError:
                return self._send(400, {"error": {"message": "body: JSON nested too deeply"}})
            try:
                status, payload = server.route(method, path, body)
            except RequestError as e:
                status, payload = 400, {"error": {"message": str(e)}}
            except Exception as e:  # a server must answer (and log) whatever broke in a handler
                logger.exception("%s %s failed", method, path)
                status, payload = 500, {"error": {"message": f"{type(e).__name__}: {e}"}}
            self._send(status, payload)

        def _refuse(self, status: int, message: str) -> None:
            # the body is left unread: the connection must end (and the client be told, so that it
            # does not send its next request on it), or the body's bytes would be read as a request
            self._send(status, {"error": {"message": message}} if status != 401 else {"error": message},
                       close=True)

        def _send(self, status: int, payload: Any, close: bool = False) -> None:
            if payload is None:
                data, ctype = b"", "text/plain"
            elif isinstance(payload, str):
                data, ctype = payload.encode(), "text/plain; charset=utf-8"
            else:
                data, ctype = json.dumps(payload).encode(), "application/json"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            if close:
                self.send_header("Connection", "close")  # BaseHTTPRequestHandler then closes after it
            self.end_headers()
            self.wfile.write(data)

    return Handler
