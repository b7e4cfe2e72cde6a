"""This project's counterparts of slime's rollout-side modules, for user functions written for slime
(config/slime_imports.py maps slime's paths to these names where slime is not installed; the table of
docs/migration.md says what differs from slime's):

- `slime.rollout.sglang_rollout`: `GenerateState(args)`, the per-process state a slime generate
  function reads (`args`, `tokenizer` and `processor` of `args.hf_checkpoint`, `semaphore`,
  `sampling_params`, `group_sampling_seeds`, `dp_rank_context()`, `reset()`; not slime's rollout
  loop), and `get_model_url` (one model per run: the rollout's endpoint);
- `slime.rollout.filter_hub.dynamic_sampling_filters`: `check_reward_nonzero_std` and
  `check_reward_nonzero_std_with_fallback`, slime's signature and rule;
- `slime.utils.misc.SingletonMeta`, `slime.utils.processing_utils.load_tokenizer` / `load_processor`,
  `slime.utils.async_utils.run` / `get_async_loop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import threading
from collections.abc import Iterator
from typing import Any

from slime_rl.data.slime_compat import DynamicFilterOutput


class SingletonMeta(type):
    """slime.utils.misc.SingletonMeta: one instance per class per process (the first call's arguments)."""

    _instances: dict[type, Any] = {}

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls not in cls._instances:
            cls._instances[cls] = super().__call__(*args, **kwargs)
        return cls._instances[cls]

    def clear_instances(cls) -> None:
        cls._instances = {}


def load_tokenizer(name_or_path: str, **kwargs: Any) -> Any:
    """slime.utils.processing_utils.load_tokenizer: AutoTokenizer.from_pretrained."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path, **kwargs)


def load_processor(name_or_path: str, **kwargs: Any) -> Any:
    """slime.utils.processing_utils.load_processor: the checkpoint's processor, None when it has none (a
    text model's AutoProcessor is its tokenizer)."""
    from transformers import AutoProcessor, PreTrainedTokenizerBase, ProcessorMixin

    try:
        proc = AutoProcessor.from_pretrained(name_or_path, **kwargs)
    except (OSError, ValueError):
        return None
    return None if isinstance(proc, PreTrainedTokenizerBase) or not isinstance(proc, ProcessorMixin) else proc


class GenerateState(metaclass=SingletonMeta):
    """slime.rollout.sglang_rollout.GenerateState: what a slime generate function reads of it (see the
    module docstring); one per process, built from the first call's `args`."""

    def __init__(self, args: Any) -> None:
        self.args = args
        self.tokenizer = load_tokenizer(args.hf_checkpoint, trust_remote_code=True)
        self.processor = load_processor(args.hf_checkpoint, trust_remote_code=True)
        engines = max(1, (getattr(args, "rollout_num_gpus", None) or 1) // (args.rollout_num_gpus_per_engine or 1))
        self.semaphore = asyncio.Semaphore(args.sglang_server_concurrency * engines)
        self.sampling_params: dict[str, Any] = dict(
            temperature=args.rollout_temperature, top_p=args.rollout_top_p, top_k=args.rollout_top_k,
            max_new_tokens=args.rollout_max_response_len, stop=args.rollout_stop,
            stop_token_ids=args.rollout_stop_token_ids, skip_special_tokens=args.rollout_skip_special_tokens,
            no_stop_trim=True, spaces_between_special_tokens=False)
        if getattr(args, "sglang_enable_deterministic_inference", False):
            base = args.rollout_seed
            self.group_sampling_seeds = [base + i for i in range(args.n_samples_per_prompt)]
        self.dp_counts = [0] * (getattr(args, "sglang_dp_size", None) or 1)
        self.dp_rank = 0
        self.reset()

    @contextlib.contextmanager
    def dp_rank_context(self) -> Iterator[int]:
        """The least busy data-parallel rank (the lowest of the least busy ones; slime draws among them)."""
        rank = self.dp_counts.index(min(self.dp_counts))
        self.dp_counts[rank] += 1
        self.dp_rank = rank
        try:
            yield rank
        finally:
            self.dp_counts[rank] -= 1

    def reset(self) -> None:
        self.remaining_batch_size = 0
        self.pendings: set = set()
        self.aborted = False


def get_model_url(args: Any, model_name: str, endpoint: str = "/generate") -> str:
    """slime.rollout.sglang_rollout.get_model_url: one model per run here, so the rollout's endpoint."""
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}{endpoint}"


def check_reward_nonzero_std(args: Any, samples: list[Any], **kwargs: Any) -> DynamicFilterOutput:
    """slime's DAPO filter: keep the group when its rewards (`get_reward_value(args)`) have a sample
    standard deviation above 1e-6; a dropped group's reason is `zero_std_<first reward, 1 decimal>`."""
    rewards = [float(s.get_reward_value(args)) for s in samples]
    keep = len(rewards) > 1 and statistics.stdev(rewards) > 1e-6
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def check_reward_nonzero_std_with_fallback(args: Any, samples: list[Any], **kwargs: Any) -> DynamicFilterOutput:
    """slime's variant that asks to keep such groups when too few others remain (not honoured here)."""
    out = check_reward_nonzero_std(args, samples, **kwargs)
    out.keep_when_insufficient = True
    return out


class _LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="slime-async-utils")
        self._thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


_loop: _LoopThread | None = None
_loop_lock = threading.Lock()


def get_async_loop() -> _LoopThread:
    """slime.utils.async_utils.get_async_loop: the process's background event loop (started on first use)."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = _LoopThread()
    return _loop


def run(coro: Any) -> Any:
    """slime.utils.async_utils.run: run a coroutine on the background loop and wait for its result."""
    return get_async_loop().run(coro)
