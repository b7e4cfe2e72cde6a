"""slime's `Sample` as slime's extension functions see it, and the few slime modules they import.

A function written for slime (`rm(args, sample)`, `generate(args, sample, sampling_params)`,
`filter(args, samples)`) gets a `SlimeSample`: slime's field names (slime/utils/types.py: `tokens`
= prompt + response ids, `response_length`, `rollout_log_probs`, `status` of `Sample.Status`,
`weight_versions`, `metadata`, ...), its `get_reward_value(args)` and `append_response_tokens(...)`.
`to_slime` builds one from our `Sample`; the rollout turns a returned one back
(`slime_rl.rollout.slime_compat.from_slime`).

Where slime itself is not installed, slime's module paths resolve to this project's counterparts
(`slime_rl.config.slime_imports`): `slime.utils.types.Sample` is `SlimeSample`,
`slime.utils.http_utils.post` / `get` are `post` / `get` here, `slime.utils.misc.load_function` is
`load_function` and `slime.rollout.filter_hub.base_types.DynamicFilterOutput` is `DynamicFilterOutput`.
With slime installed its own modules are used (its `Sample` is read field by field, so either works).

`post` names the sample it was called for (`CURRENT_SAMPLE`, set by the rollout around a slime
generate call) in the header `SAMPLE_HEADER`, so that the rollout's HTTP endpoint can file the
request under the sample's group and abort it with the group.
"""

from __future__ import annotations

import contextvars
import enum
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

from slime_rl.config.slime_imports import SHIM, real_slime_spec
from slime_rl.data.sample import ROLLOUT_STATUS_KEY, TOKEN_VERSIONS_KEY, Sample

# our own per-sample bookkeeping in Sample.metadata, not shown to user functions
INTERNAL_METADATA = (ROLLOUT_STATUS_KEY, TOKEN_VERSIONS_KEY)
SAMPLE_HEADER = "X-Slime-RL-Sample"  # "<group_index>/<index>" of the sample a request is for
CURRENT_SAMPLE: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("slime_rl_sample",
                                                                                        default=None)


class Status(enum.Enum):
    """slime's Sample.Status (values as slime spells them)."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class DynamicFilterOutput:
    """What slime's dynamic-sampling filters return (slime/rollout/filter_hub/base_types.py)."""

    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False


@dataclass
class SlimeSample:
    """slime's Sample (the fields our rollout can fill; see the module docstring)."""

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    # SGLang's routed_experts per position fed to the engine: slime keeps [rows, layers, top_k]
    rollout_routed_experts: Any = None
    remove_sample: bool = False
    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict | None = None
    session_id: str | None = None

    Status = Status  # slime spells it Sample.Status.COMPLETED

    def get_reward_value(self, args: Any) -> float:
        """slime's: the reward, or its `args.reward_key` entry when the reward is a dict."""
        if isinstance(self.reward, dict):
            return self.reward[getattr(args, "reward_key", None) or "score"]
        return self.reward

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def append_response_tokens(self, args: Any = None, *, tokens: Any = None, log_probs: Any = None,
                               trainable: bool = True, meta_info: dict | None = None, text: str | None = None,
                               update_terminal_info: bool = True) -> None:
        """slime's: append model tokens (trainable, with log-probs and SGLang's meta_info) or
        environment tokens (trainable=False: loss mask 0, log-prob 0); sets the status from
        meta_info's finish_reason and records its weight_version."""
        tokens = [int(t) for t in (tokens if tokens is not None else [])]
        log_probs = None if log_probs is None else [float(x) for x in log_probs]
        if log_probs is not None and len(log_probs) != len(tokens):
            raise ValueError(f"log_probs length {len(log_probs)} != tokens length {len(tokens)}")
        if tokens and trainable and log_probs is None:
            raise ValueError("trainable response tokens require rollout log probabilities.")
        if tokens and not trainable:
            if log_probs is not None:
                raise ValueError("non-trainable response tokens should not pass rollout log probabilities.")
            log_probs = [0.0] * len(tokens)
        if text is not None:
            self.response += text
        before = self.response_length
        if tokens:
            self.tokens += tokens
            self.response_length += len(tokens)
            if self.loss_mask is None:
                self.loss_mask = [1] * before
            self.loss_mask += [1 if trainable else 0] * len(tokens)
        if log_probs is not None:
            if self.rollout_log_probs is None:
                self.rollout_log_probs = [0.0] * before
            self.rollout_log_probs += log_probs
        if meta_info is None or not update_terminal_info or "finish_reason" not in meta_info:
            return
        if "weight_version" in meta_info:
            self.weight_versions.append(meta_info["weight_version"])
        finish = meta_info["finish_reason"]
        kind = finish.get("type") if isinstance(finish, dict) else finish
        self.status = {"length": Status.TRUNCATED, "abort": Status.ABORTED, "stop": Status.COMPLETED}.get(
            kind, self.status)


def _status_of(sample: Sample) -> Status:
    state = sample.metadata.get(ROLLOUT_STATUS_KEY)
    if state is not None:
        return Status(state)
    if sample.finish_reason == "length":
        return Status.TRUNCATED
    if sample.finish_reason == "abort":
        return Status.ABORTED
    return Status.COMPLETED if sample.response_ids or sample.finish_reason else Status.PENDING


def to_slime(sample: Sample, cls: type = SlimeSample) -> Any:
    """Our `Sample` as slime's (a copy of every list; `metadata` without our own keys). `cls`:
    slime's own Sample class when slime is installed, else `SlimeSample`."""
    n = len(sample.response_ids)
    out = cls()
    values = {
        "group_index": sample.group_index, "index": sample.index, "prompt": sample.prompt,
        "tokens": list(sample.prompt_ids) + list(sample.response_ids), "response": sample.response,
        "response_length": n, "label": sample.label, "reward": sample.reward,
        "loss_mask": list(sample.loss_mask) if n else None,
        "rollout_log_probs": list(sample.rollout_logprobs) if n else None,
        "rollout_routed_experts": None if sample.rollout_routed_experts is None
        else sample.rollout_routed_experts.copy(),
        "weight_versions": [sample.weight_version] if sample.weight_version is not None else [],
        "metadata": {k: v for k, v in sample.metadata.items() if k not in INTERNAL_METADATA},
        "multimodal_inputs": {"images": list(sample.images)} if sample.images else None,
    }
    for name, value in values.items():
        setattr(out, name, value)
    status_cls = getattr(cls, "Status", Status)
    out.status = status_cls(_status_of(sample).value)
    return out


def status_value(slime_sample: Any) -> str:
    """The status of a slime-style sample as its string value ("completed", ...)."""
    status = getattr(slime_sample, "status", None)
    return str(getattr(status, "value", status))


# ---- slime's utilities a user function imports (config/slime_imports.py maps slime's paths here)

_http_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its httpx client


async def post(url: str, payload: dict, max_retries: int = 60, headers: dict | None = None) -> Any:
    """slime.utils.http_utils.post: POST JSON, return the JSON answer (raises on HTTP errors)."""
    import asyncio

    import httpx

    loop = asyncio.get_running_loop()
    client = _http_clients.get(loop)
    if client is None:  # one connection pool per event loop (a client is bound to the loop it ran on)
        client = _http_clients[loop] = httpx.AsyncClient(timeout=None)
    headers = dict(headers or {})
    current = CURRENT_SAMPLE.get()
    if current is not None:
        headers.setdefault(SAMPLE_HEADER, f"{current[0]}/{current[1]}")
    response = await client.post(url, json=payload, headers=headers)
    response.raise_for_status()
    return response.json()


async def get(url: str) -> Any:
    """slime.utils.http_utils.get."""
    import httpx

    async with httpx.AsyncClient(timeout=None) as client:
        response = await client.get(url)
        response.raise_for_status()
        return response.json()


def load_function(path: str) -> Any:
    """slime.utils.misc.load_function ('module.function')."""
    import importlib

    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def slime_installed() -> bool:
    """Whether a real slime package is importable (the stand-ins of config/slime_imports do not count)."""
    module = sys.modules.get("slime")
    if module is not None:
        return not getattr(module, SHIM, False)
    return real_slime_spec() is not None


def slime_sample_class() -> type:
    """slime's own Sample when slime is installed, else `SlimeSample`."""
    if slime_installed():
        from slime.utils.types import Sample as RealSample  # pragma: no cover - slime is not a dependency

        return RealSample
    return SlimeSample
