"""Reward functions by name (`--rm-type`) or by dotted path (`--custom-rm-path`).

Protocol (the extension point): `def reward(sample: Sample) -> float`, or `async def` of the
same. The sample carries prompt, response, label and metadata; the float is the scalar reward.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

from slime_rl.data import Sample
from slime_rl.rewards.builtin import BUILTIN

RewardFn = Callable[[Sample], object]


class RewardError(ValueError):
    """The reward function could not be found or loaded; the message names the flag."""


def load_by_path(path: str, flag: str) -> Callable:
    """'pkg.module:function' or 'pkg.module.function' -> the function; errors name the flag."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise RewardError(f"{flag} {path!r}: expected 'module:function' or 'module.function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardError(f"{flag} {path!r}: cannot import module {module_name!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"{flag} {path!r}: module {module_name!r} has no function {attr!r}")
    return fn


def load_reward(rm_type: str | None, custom_rm_path: str | None) -> RewardFn:
    """The reward function the flags name (the custom path wins); sync or async."""
    if custom_rm_path:
        fn = load_by_path(custom_rm_path, "--custom-rm-path")
    elif rm_type in BUILTIN:
        fn = BUILTIN[rm_type]
    else:
        raise RewardError(f"--rm-type {rm_type!r}: unknown (built-in: {', '.join(sorted(BUILTIN))})")
    return fn


async def call_reward(fn: RewardFn, sample: Sample) -> float:
    """Score one sample with a sync or async reward function; the result must be a number."""
    value = fn(sample)
    if inspect.isawaitable(value):
        value = await value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RewardError(f"reward function {getattr(fn, '__name__', fn)!r} returned {value!r}; "
                          "expected a number")
    return float(value)
