"""The engines' roles: slime's --prefill-num-servers and --sglang-config (SGLang's prefill/decode disaggregation).

Every engine is `regular` (it prefills and decodes its requests) unless one of slime's two flags splits them:

- `--prefill-num-servers N`: the first N engines prefill, the others decode;
- `--sglang-config FILE`: slime's YAML of server groups (slime/backends/sglang_utils/sglang_config.py's format),
  under its top key `sglang`, a list of models, each with `server_groups` (or `engine_groups`):
  `worker_type` (regular, prefill or decode), `num_gpus` (of the group), `num_gpus_per_engine` (default the
  model's, else --rollout-num-gpus-per-engine) and `overrides` (SGLang ServerArgs fields set for that group's
  engines on top of the --sglang-* flags). Engines are numbered group after group, in the file's order.

What is built here: one model, the trained one (its `model_path` absent or --hf-checkpoint's, `update_weights`
absent or true); groups of the run's engine size (--rollout-num-gpus-per-engine) whose GPUs add up to
--rollout-num-gpus. A prefill engine runs SGLang with `--disaggregation-mode prefill` and a bootstrap port, a
decode engine with `--disaggregation-mode decode`; sglang-router runs in its PD mode in front of them (its
`--pd-disaggregation --prefill URL PORT --decode URL`), the rollout sends /generate to it, and weight updates,
pauses and aborts go to every engine, as for regular engines. SGLang moves each request's KV cache from its
prefill engine to its decode engine itself (`--sglang-disaggregation-transfer-backend`, mooncake by default), so
only SGLang engines can be split: the built-in engine has no KV transfer. Refused, each in a sentence naming the
file and the group: other models (a frozen reference or reward model served beside the policy), `placeholder`
and `encoder` groups (slime's GPU reservations and encoder-prefill-decode), groups of another engine size,
regular groups beside prefill/decode ones (the PD router routes to prefill/decode pairs only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROLES = ("regular", "prefill", "decode")


class ServerGroupError(ValueError):
    """--sglang-config or --prefill-num-servers cannot be built here; the message names the flag and the group."""


@dataclass(frozen=True)
class ServerGroup:
    worker_type: str  # regular, prefill or decode
    num_engines: int
    overrides: dict[str, Any] = field(default_factory=dict)  # SGLang ServerArgs fields for these engines


def from_prefill_num_servers(n: int, num_engines: int) -> tuple[ServerGroup, ...]:
    """--prefill-num-servers N: N prefill engines first, then the others decode (slime's split)."""
    if n >= num_engines:
        raise ServerGroupError(f"--prefill-num-servers {n}: the run has {num_engines} engine(s) (--rollout-num-gpus "
                               "/ --rollout-num-gpus-per-engine), which leaves no decode engine; give fewer prefill "
                               "servers or more engines")
    return (ServerGroup("prefill", n), ServerGroup("decode", num_engines - n))


def read_sglang_config(path: str, hf_checkpoint: str, num_gpus: int, num_gpus_per_engine: int,
                       server_arg_fields: set[str] | None = None) -> tuple[ServerGroup, ...]:
    """The server groups of slime's --sglang-config YAML (module docstring), checked against the run:
    ServerGroupError names the file, the model or group and the field. `server_arg_fields`: SGLang's ServerArgs
    field names an override must be one of (None: not checked)."""
    import yaml

    where = f"--sglang-config {path}"
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ServerGroupError(f"{where}: cannot read it ({exc})") from exc
    except yaml.YAMLError as exc:
        raise ServerGroupError(f"{where}: not YAML ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("sglang"), list) or not data["sglang"]:
        raise ServerGroupError(f"{where}: expected a top key 'sglang' holding a list of models (slime's format), "
                               f"got {sorted(data) if isinstance(data, dict) else type(data).__name__}")
    if len(data["sglang"]) != 1:
        names = [m.get("name") if isinstance(m, dict) else m for m in data["sglang"]]
        raise ServerGroupError(f"{where}: {len(names)} models ({names}); one is built here, the trained one (a "
                               "frozen reference or reward model served beside it is not)")
    model = data["sglang"][0]
    if not isinstance(model, dict):
        raise ServerGroupError(f"{where}: the model entry must be a mapping, got {model!r}")
    name = model.get("name", "?")
    at = f"{where}: model {name!r}"
    unknown = sorted(set(model) - {"name", "model_path", "num_gpus_per_engine", "server_groups", "engine_groups",
                                   "update_weights"})
    if unknown:
        raise ServerGroupError(f"{at}: unknown keys {unknown}")
    if model.get("model_path") not in (None, hf_checkpoint):
        raise ServerGroupError(f"{at}: model_path {model['model_path']!r} is not --hf-checkpoint {hf_checkpoint!r}; "
                               "the engines here serve the trained model")
    if model.get("update_weights") not in (None, True):
        raise ServerGroupError(f"{at}: update_weights {model['update_weights']!r}: the engines here serve the trained "
                               "model and get every weight update")
    raw_groups = model.get("server_groups") or model.get("engine_groups")
    if not isinstance(raw_groups, list) or not raw_groups:
        raise ServerGroupError(f"{at}: no server_groups")
    model_gpe = model.get("num_gpus_per_engine") or num_gpus_per_engine
    groups = []
    for i, g in enumerate(raw_groups):
        gat = f"{at}, server group {i}"
        if not isinstance(g, dict):
            raise ServerGroupError(f"{gat}: must be a mapping, got {g!r}")
        unknown = sorted(set(g) - {"worker_type", "num_gpus", "num_gpus_per_engine", "overrides"})
        if unknown:
            raise ServerGroupError(f"{gat}: unknown keys {unknown}")
        kind = g.get("worker_type")
        if kind in ("placeholder", "encoder"):
            what = "a GPU reservation without engines" if kind == "placeholder" else "encoder-prefill-decode"
            raise ServerGroupError(f"{gat}: worker_type {kind} ({what}) is not built here")
        if kind not in ROLES:
            raise ServerGroupError(f"{gat}: worker_type {kind!r}: expected one of {', '.join(ROLES)}")
        gpus, gpe = g.get("num_gpus"), g.get("num_gpus_per_engine") or model_gpe
        if not isinstance(gpus, int) or gpus <= 0:
            raise ServerGroupError(f"{gat}: num_gpus must be a positive integer, got {gpus!r}")
        if gpe != num_gpus_per_engine:
            raise ServerGroupError(f"{gat}: num_gpus_per_engine {gpe} differs from --rollout-num-gpus-per-engine "
                                   f"{num_gpus_per_engine}; engines of one size are built here")
        if gpus % gpe:
            raise ServerGroupError(f"{gat}: num_gpus {gpus} is not a multiple of num_gpus_per_engine {gpe}")
        overrides = g.get("overrides") or {}
        if not isinstance(overrides, dict):
            raise ServerGroupError(f"{gat}: overrides must be a mapping of SGLang ServerArgs fields, got {overrides!r}")
        overrides = {str(k).replace("-", "_"): v for k, v in overrides.items()}
        if "model_path" in overrides:  # slime injects the model's path there; only the trained one is served here
            if overrides["model_path"] not in (None, hf_checkpoint):
                raise ServerGroupError(f"{gat}: overrides.model_path {overrides['model_path']!r} is not "
                                       "--hf-checkpoint")
            del overrides["model_path"]
        if server_arg_fields is not None:
            bad = sorted(set(overrides) - server_arg_fields)
            if bad:
                raise ServerGroupError(f"{gat}: overrides {bad} are not fields of the installed SGLang's ServerArgs")
        groups.append(ServerGroup(kind, gpus // gpe, overrides))
    total = sum(g.num_engines for g in groups) * num_gpus_per_engine
    if total != num_gpus:
        raise ServerGroupError(f"{at}: its groups hold {total} GPUs, --rollout-num-gpus is {num_gpus}")
    kinds = {g.worker_type for g in groups}
    if kinds & {"prefill", "decode"} and "regular" in kinds:
        raise ServerGroupError(f"{at}: regular groups beside prefill/decode ones: sglang-router's PD mode routes to "
                               "prefill/decode pairs only")
    if kinds & {"prefill", "decode"} and kinds != {"prefill", "decode"}:
        missing = ({"prefill", "decode"} - kinds).pop()
        raise ServerGroupError(f"{at}: prefill/decode disaggregation needs both kinds of group; no {missing} group")
    return tuple(groups)


def engine_roles(groups: tuple[ServerGroup, ...], num_engines: int) -> tuple[tuple[str, dict[str, Any]], ...]:
    """(role, overrides) of each engine, in engine order; every engine regular without groups."""
    if not groups:
        return tuple(("regular", {}) for _ in range(num_engines))
    out = tuple((g.worker_type, g.overrides) for g in groups for _ in range(g.num_engines))
    assert len(out) == num_engines, (len(out), num_engines)
    return out
