"""The built-in engine's settings: one `ServerConfig` field per setting, and everything derived from it.

A field carries its command-line names (SGLang's ServerArgs names where SGLang has the option,
sglang/srt/arg_groups/fields/*.py in SGLang 0.5.23), its help, and, when the run may set it with
`--sglang-<name>` under `--rollout-backend embedded`, that SGLang name. From these fields come:
  - `server_parser` / `parse_server_args`: the engine's one command line
    (`python -m slime_rl.engines.embedded`), flags or `--config-json` (what the driver passes);
  - `to_argv`: the driver's launch arguments, the whole config as JSON (no key: see API_KEY_ENV);
  - `SGLANG_ARGS` and `from_sglang_args`: which --sglang-* flags the built-in engine takes, read
    and checked once (the flag table's --rollout-backend check and the driver both use them).
A new engine setting is a field here and the engine code that reads it.

This module imports neither torch nor the engine: the driver builds the command without either.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any

# The built-in engine's key may come from the environment instead of --api-key: a process's argv is
# readable by every user of the node (ps, /proc/<pid>/cmdline), its environment only by its owner.
API_KEY_ENV = "SLIME_RL_ENGINE_API_KEY"
# default of its --debug-routing-select-round (tests and measurements only); the driver passes it on
ROUTING_SELECT_ROUND_ENV = "SLIME_RL_DEBUG_ROUTING_SELECT_ROUND"
# a socket the engine's launcher bound to --host:--port and handed over (the number of the inherited fd):
# the engine listens on it instead of binding the port itself, so that nothing else on the node can take
# the port between the launcher's pick and the engine's listen (its model loads in between)
LISTEN_FD_ENV = "SLIME_RL_ENGINE_LISTEN_FD"
# how a switch may be written as a value (YAML, --sglang-x VALUE); engines/cli_args.py reads the same
TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")


def switch_value(value: Any) -> bool | None:
    """A switch's value as given on a command line or in YAML: a bool, or one of TRUE_WORDS / FALSE_WORDS
    (any case); None for anything else (the caller names its flag in the error)."""
    if isinstance(value, bool):
        return value
    word = str(value).lower()
    return True if word in TRUE_WORDS else False if word in FALSE_WORDS else None


DTYPES = ("float32", "float", "bfloat16", "float16", "half")
ROUNDINGS = ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2")


def _opt(*flags: str, help: str = "", sglang: str | None = None, choices: tuple[str, ...] | None = None,
         minimum: float | None = None, positive: bool = False) -> dict[str, Any]:
    """A field's metadata: its flags (the first is its name in messages), help, the SGLang ServerArgs
    name the run's --sglang-<name> sets it by (None: the run cannot), allowed values, bounds."""
    return {"flags": flags, "help": help, "sglang": sglang, "choices": choices, "minimum": minimum,
            "positive": positive}


@dataclass(frozen=True)
class ServerConfig:
    model_path: str = field(metadata=_opt("--model-path", "--model", help="HF checkpoint folder"))
    host: str = field(default="127.0.0.1", metadata=_opt("--host"))
    port: int = field(default=30000, metadata=_opt("--port"))
    api_key: str | None = field(default=None, metadata=_opt(
        "--api-key", help=f"require `Authorization: Bearer KEY` (not on /health*); default: ${API_KEY_ENV}"))
    random_seed: int = field(default=0, metadata=_opt("--random-seed", help="seed of requests without sampling_seed"))
    dtype: str = field(default="float32", metadata=_opt("--dtype", choices=DTYPES))
    device: str = field(default="cpu", metadata=_opt("--device", help="cpu, cuda or cuda:N"))
    weight_version: str = field(default="default", metadata=_opt("--weight-version"))
    tp_size: int = field(default=1, metadata=_opt("--tp-size", "--tensor-parallel-size",
                                                  help="only 1 (the embedded engine is one process)"))
    # --colocate with --rollout-num-gpus-per-engine N: the engine spans N trainer devices and its
    # /update_weights_from_tensor carries one serialized_named_tensors entry per device (SGLang's form
    # for --tp-size N); it computes on the first and reads entry 0 (weights.py)
    colocated_devices: int = field(default=1, metadata=_opt(
        "--colocated-devices", minimum=1,
        help="devices a colocated engine spans (the run's --rollout-num-gpus-per-engine): "
             "/update_weights_from_tensor takes that many serialized_named_tensors entries, one per device, and "
             "reads the first (the engine computes on its first device; no tensor parallel)"))
    # torch.set_num_threads: process-wide, so left alone unless given
    num_threads: int | None = field(default=None, metadata=_opt(
        "--num-threads", help="torch intra-op threads (CPU)", minimum=1))
    # decoding (engine.py): on CUDA a static KV cache with CUDA graphs unless disable_cuda_graph;
    # static_kv_cache uses the static cache without graphs elsewhere (CPU) or with them disabled, as
    # enable_deterministic_inference does on CUDA (server.decodes_on_slots)
    disable_cuda_graph: bool = field(default=False, metadata=_opt(
        "--disable-cuda-graph", sglang="disable_cuda_graph",
        help="on CUDA, decode eagerly with the dynamic KV cache instead of replaying CUDA graphs of the decode "
             "step on a static KV cache"))
    # larger batches run the static step eagerly
    cuda_graph_max_bs: int | None = field(default=None, metadata=_opt(
        "--cuda-graph-max-bs-decode", "--cuda-graph-max-bs", sglang="cuda_graph_max_bs_decode", minimum=1,
        help="largest padded batch with a CUDA graph; larger ones run the static step eagerly (default: "
             "--max-running-requests)"))
    # SGLang's --enable-fp32-lm-head: fp32 logits (precision.py); RMSNorm rounds as SGLang's always
    enable_fp32_lm_head: bool = field(default=False, metadata=_opt(
        "--enable-fp32-lm-head", sglang="enable_fp32_lm_head",
        help="logits in fp32 from the bf16 hidden state and weight (SGLang's flag); the trainer computes them "
             "so too when the run passes --sglang-enable-fp32-lm-head"))
    max_running_requests: int = field(default=64, metadata=_opt(
        "--max-running-requests", sglang="max_running_requests", minimum=1, help="rows in the running batch"))
    # SGLang's --disable-overlap-schedule: read each step's tokens before launching the next (engine.py)
    disable_overlap_schedule: bool = field(default=False, metadata=_opt(
        "--disable-overlap-schedule", sglang="disable_overlap_schedule",
        help="read each decode step's tokens before launching the next (SGLang's flag); by default step n+1 is "
             "launched first and the host's work for step n overlaps it"))
    # SGLang's --enable-torch-compile / --torch-compile-max-bs: the static decode step of padded
    # batches up to the bound runs with its RMSNorms, MLPs and RoPE compiled (compiled.py)
    enable_torch_compile: bool = field(default=False, metadata=_opt(
        "--enable-torch-compile", sglang="enable_torch_compile",
        help="run the static decode step with its RMSNorms, MLPs and RoPE compiled by torch.compile (SGLang's "
             "flag): inductor fuses their small elementwise kernels; compiles on the first step"))
    torch_compile_max_bs: int = field(default=32, metadata=_opt(
        "--torch-compile-max-bs", sglang="torch_compile_max_bs", minimum=1,
        help="largest padded batch whose decode step is compiled (SGLang's flag and default)"))
    # SGLang 0.5.23 honours a request's sampling_seed only under --enable-deterministic-inference
    # (sampling_batch_info builds the seeds only then); without it the seed is ignored
    enable_deterministic_inference: bool = field(default=False, metadata=_opt(
        "--enable-deterministic-inference", sglang="enable_deterministic_inference",
        help="honour each request's sampling_seed (SGLang 0.5.23 ignores it without this switch); on CUDA also "
             "batch-invariant decode attention, as SGLang's switch: the static path's decode steps run the "
             "trainer's flash kernel over the slot cache"))
    static_kv_cache: bool = field(default=False, metadata=_opt(
        "--static-kv-cache",
        help="use the static KV cache even without CUDA graphs (CPU, or with --disable-cuda-graph)"))
    # SGLang's --enable-weights-cpu-backup: a release of "weights" keeps a host copy that a resume
    # restores; without it the released weights are gone and must be sent again (memory.py)
    enable_weights_cpu_backup: bool = field(default=False, metadata=_opt(
        "--enable-weights-cpu-backup",
        help="keep a host copy of released weights and restore it on resume (SGLang's flag); without it a "
             "release drops the weights and they must all be sent again"))
    # SGLang's --enable-return-routed-experts: a request's return_routed_experts answers each MoE
    # layer's top-k expert ids (routing.py); routing_select_round: test/measurement only (routing.py)
    enable_return_routed_experts: bool = field(default=False, metadata=_opt(
        "--enable-return-routed-experts",
        help="answer a request's return_routed_experts with each MoE layer's top-k expert ids (SGLang's flag; "
             "meta_info['routed_experts'], base64 int32 [tokens, layers, top_k])"))
    routing_select_round: str | None = field(default=None, metadata=_opt(
        "--debug-routing-select-round", choices=ROUNDINGS,
        help=f"test/measurement only: choose experts from router logits rounded to this dtype (a bf16 engine's "
             f"routing flips), the weights from the fp32 probabilities; default: ${ROUTING_SELECT_ROUND_ENV}"))
    # a body larger than this is refused (413) before it is read: weight updates travel over NCCL/IPC,
    # so the largest bodies are VL requests with images as data URLs
    max_request_bytes: int = field(default=256 << 20, metadata=_opt(
        "--max-request-bytes", positive=True, help="a request body larger than this is refused with 413 before "
                                                   "it is read"))
    # a request's head and body must arrive within read_timeout_s (else 408 and the connection
    # closes); a kept-alive connection idle for idle_timeout_s closes. Long /generate calls wait on
    # the scheduler, not on the socket, so they are not cut. Open connections above max_connections
    # are answered 503; blocking endpoint bodies run on at most http_workers threads (http.py).
    read_timeout_s: float = field(default=30.0, metadata=_opt(
        "--http-read-timeout", positive=True,
        help="seconds a request's head and body may take to arrive (else 408, connection closed)"))
    idle_timeout_s: float = field(default=300.0, metadata=_opt(
        "--http-idle-timeout", positive=True,
        help="seconds a kept-alive connection may wait for its next request before it is closed"))
    weight_group_timeout_s: float = field(default=1800.0, metadata=_opt(
        "--weight-group-timeout", positive=True,
        help="seconds /init_weights_update_group waits for every rank of the group to join, then answers 400 "
             "and frees the weight-update lock (torch's default_pg_timeout, which SGLang uses)"))
    max_connections: int = field(default=4096, metadata=_opt(
        "--http-max-connections", positive=True,
        help="open connections served at once; one more is answered 503 and closed"))
    http_workers: int = field(default=16, metadata=_opt(
        "--http-workers", minimum=1, help="threads that run blocking endpoint bodies"))
    log_level: str = field(default="info", metadata=_opt("--log-level"))

    def __post_init__(self) -> None:
        check_values(dataclasses.asdict(self))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))


FIELDS = {f.name: f for f in dataclasses.fields(ServerConfig)}
_TYPES = typing.get_type_hints(ServerConfig)


def _flag(name: str) -> str:
    return FIELDS[name].metadata["flags"][0]


def _base_type(name: str) -> type:
    """int, float, str or bool: a field's type without `| None`."""
    hint = _TYPES[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def check_values(values: dict[str, Any], flag_of: typing.Callable[[str], str] = _flag) -> None:
    """ValueError naming the flag (`flag_of(field)`) of the first value out of its range."""
    if values.get("tp_size", 1) != 1:
        raise ValueError(f"{flag_of('tp_size')} {values['tp_size']}: the embedded engine supports only 1")
    for name, value in values.items():
        meta, kind = FIELDS[name].metadata, _base_type(name)
        if value is None:
            continue
        if kind is bool:
            ok = isinstance(value, bool)
        elif kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind is float:
            ok = isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)
        else:
            ok = isinstance(value, str)
        if not ok:
            raise ValueError(f"{flag_of(name)} {value!r}: expected {kind.__name__}")
        if meta["choices"] and value not in meta["choices"]:
            raise ValueError(f"{flag_of(name)} {value}: expected one of {', '.join(meta['choices'])}")
        if meta["minimum"] is not None and value < meta["minimum"]:
            raise ValueError(f"{flag_of(name)} {value}: must be >= {meta['minimum']}")
        if meta["positive"] and not value > 0:
            raise ValueError(f"{flag_of(name)} {value}: must be > 0")


# the SGLang ServerArgs names the built-in engine takes (--sglang-<name> with --rollout-backend embedded)
SGLANG_ARGS: tuple[str, ...] = tuple(f.metadata["sglang"] for f in FIELDS.values() if f.metadata["sglang"])
_BY_SGLANG = {f.metadata["sglang"]: f.name for f in FIELDS.values() if f.metadata["sglang"]}


def not_taken(sglang_args: dict[str, Any]) -> list[str]:
    """The --sglang-<name> flags (sorted, as the user wrote them) among `sglang_args` (SGLang's names,
    router flags already apart) that the built-in engine does not take."""
    return sorted("--sglang-" + k.replace("_", "-") for k in sglang_args if k not in SGLANG_ARGS)


def from_sglang_args(sglang_args: dict[str, Any]) -> dict[str, Any]:
    """{field: value} of the --sglang-<name> flags the built-in engine takes, converted to the field's
    type (a switch: true/false; a number from its text); ValueError naming the --sglang flag for a
    value that does not convert or is out of range. Other names are ignored (the flag table refuses
    them under --rollout-backend embedded)."""
    out = {}
    for sglang_name, name in _BY_SGLANG.items():
        if sglang_name not in sglang_args:
            continue
        value, kind, flag = sglang_args[sglang_name], _base_type(name), "--sglang-" + sglang_name.replace("_", "-")
        if kind is bool and isinstance(value, str) and value.lower() in TRUE_WORDS + FALSE_WORDS:
            value = value.lower() in TRUE_WORDS
        elif kind is int and isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        check_values({name: value}, lambda _n, flag=flag: flag)
        out[name] = value
    return out


def server_parser() -> argparse.ArgumentParser:
    """The engine's command line: a flag per field (a switch for a bool; no defaults: an absent flag
    leaves the field to --config-json or to the field's default) plus --config-json."""
    p = argparse.ArgumentParser(prog="python -m slime_rl.engines.embedded",
                                description="Serve an HF causal LM with SGLang's native HTTP API.")
    p.add_argument("--config-json", default=None,
                   help="the whole config as a JSON object of field names (what the driver passes); flags given "
                        "besides it override its fields")
    for name, f in FIELDS.items():
        meta, kind = f.metadata, _base_type(name)
        kw: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": meta["help"] or None}
        if kind is bool:
            kw["action"] = "store_true"
        else:
            kw["type"] = kind
            if meta["choices"]:
                kw["choices"] = meta["choices"]
        p.add_argument(*meta["flags"], **kw)
    return p


def parse_server_args(argv: list[str] | None = None) -> ServerConfig:
    """ServerConfig from the engine's argv: --config-json's fields, then the flags given; the key and
    the routing rounding default to their environment variables. SystemExit(2) with the flag named
    for a bad value (as argparse does)."""
    p = server_parser()
    args = vars(p.parse_args(argv))
    values: dict[str, Any] = {}
    raw = args.pop("config_json")
    if raw is not None:
        try:
            values = json.loads(raw)
        except json.JSONDecodeError as e:
            p.error(f"--config-json: not JSON ({e})")
        if not isinstance(values, dict) or set(values) - set(FIELDS):
            p.error(f"--config-json: expected an object of the fields {', '.join(FIELDS)}; unknown: "
                    f"{', '.join(sorted(set(values) - set(FIELDS))) if isinstance(values, dict) else type(values)}")
    values |= args
    if "model_path" not in values:
        p.error("--model-path is required")
    values.setdefault("api_key", None)
    values["api_key"] = values["api_key"] or os.environ.get(API_KEY_ENV) or None
    if values.get("routing_select_round") is None:
        values["routing_select_round"] = os.environ.get(ROUTING_SELECT_ROUND_ENV) or None
    try:
        return ServerConfig(**values)
    except ValueError as e:
        p.error(str(e))
        raise  # unreachable: p.error exits


def to_argv(cfg: ServerConfig) -> list[str]:
    """The engine's arguments for `cfg` (after `python -m slime_rl.engines.embedded`): the config as
    JSON. The key never goes on a command line (argv is world-readable): pass it in API_KEY_ENV."""
    if cfg.api_key:
        raise ValueError(f"the engine's API key goes in ${API_KEY_ENV}, not on its command line")
    return ["--config-json", cfg.to_json()]
