"""What a row of the flag table is, and the vocabulary the rows share.

`Flag` (one flag of `slime-rl train`: its name, the config fields it lands in, default, argparse
type/choices, range check, help and section), `section` (stamps a run of rows with their argparse
group), the argparse value types the rows use (`_positive_int`, `_cluster_shape`, ...), and the
names the rows' choices and the `--sglang-*` / `--router-*` pass-through share with the code that
reads them (LOSS_AGG_MODES, REWARD_TYPES, SGLANG_PREFIX, ...). `flags.py` assembles the table
(`FLAGS`) from the row modules and builds the parser; it re-exports these names.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from slime_rl.config.builtin_engine import SGLANG_ARGS
from slime_rl.config.gpus import GpuMemory, parse_gpu

SGLANG_PREFIX = "--sglang-"
ROUTER_PREFIX = "--router-"
# --sglang-* flags that are ours (slime's names), not SGLang ServerArgs to pass through
OWN_SGLANG_FLAGS = ("--sglang-server-concurrency", "--sglang-router-port", "--sglang-config")
# SGLang ServerArgs the built-in engine reads too (its CLI takes the same names), so --sglang-<name>
# also works with --rollout-backend embedded: the ServerConfig fields that name one
EMBEDDED_SGLANG_ARGS = SGLANG_ARGS

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")

# off-policy corrections (slime_rl.algo.offpolicy): importance-weight levels and modes, verl's rejection options
IS_LEVELS = ("token", "sequence", "geometric")
TIS_MODES = ("truncate", "mask")
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
# the one definition of the loss-aggregation modes; their math is slime_rl.algo.aggregate's
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
ROLLOUT_BACKENDS = ("embedded", "sglang")
# the built-in --rm-type names, in the help's order; each is a RewardSpec in rewards/builtin.py REWARDS
# (which refuses to import unless it names these), plus remote_rm (needs --rm-url)
REWARD_TYPES = ("digit", "math", "format", "dapo", "f1", "math_format", "reasoning_gym", "deepscaler", "gpqa",
                "ifbench")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def _nonneg_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


class ClusterShape(NamedTuple):
    """`--cluster NODESxGPUS[:GPU]`: nodes, GPUs per node, and the GPU whose memory the plan is judged
    against (None: no fit verdict)."""

    nodes: int
    gpus: int
    gpu: GpuMemory | None = None


def _cluster_shape(text: str) -> ClusterShape:
    """`NODESxGPUS[:GPU]` (e.g. 2x8, 1x8:H100, 1x8:80) -> ClusterShape; GPU: a name or GiB (gpus.parse_gpu)."""
    shape, _, gpu = str(text).partition(":")
    nodes, sep, gpus = shape.lower().partition("x")
    if not sep or not nodes.isdigit() or not gpus.isdigit() or int(nodes) < 1 or int(gpus) < 1:
        raise argparse.ArgumentTypeError(f"must be NODESxGPUS[:GPU] with both >= 1 (e.g. 2x8 or 1x8:H100), "
                                         f"got {text!r}")
    memory = None
    if gpu:
        try:
            memory = parse_gpu(gpu)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: the GPU after ':' {exc}") from None
    return ClusterShape(int(nodes), int(gpus), memory)


def _tuple(value: Sequence | None) -> tuple:
    return () if value is None else tuple(value)


@dataclass(frozen=True)
class Flag:
    """One flag of `slime-rl train` (see `flags.py`'s module docstring)."""

    name: str                                 # "--rollout-max-response-len"
    to: str | tuple[str, ...] = ()            # "group.field" (a field of Config itself: "field") it lands in
    derived: str | tuple[str, ...] = ()       # fields load.py computes from it and other flags
    default: Any = None
    type: Callable[[str], Any] | None = None
    choices: Sequence[Any] | None = None
    nargs: str | None = None
    metavar: str | None = None
    action: str | None = None                 # "store_true" / "store_false" (default then False / True)
    dest: str | None = None                   # the namespace attribute when not the name's
    convert: Callable[[Any], Any] | None = None  # namespace value -> field value (e.g. a list -> a tuple)
    check: tuple[Callable[[Any], bool], str] | None = None  # (holds, "must be ..."); None values skip it
    required: bool = False                    # load.py refuses a run without it (the field default is a placeholder)
    help: str | None = None
    section: str = ""                         # the argparse group (docs/flags.md's table)

    def __post_init__(self) -> None:
        if self.action is not None:
            object.__setattr__(self, "default", self.action == "store_false")

    @property
    def key(self) -> str:
        """The attribute of the parsed namespace (and the YAML key, dashes as underscores)."""
        return self.dest or self.name[2:].replace("-", "_")

    @property
    def targets(self) -> tuple[tuple[str, str], ...]:
        """(group, field) pairs the value lands in as given; group "" is Config itself."""
        return tuple(_split(t) for t in _many(self.to))

    @property
    def derived_targets(self) -> tuple[tuple[str, str], ...]:
        return tuple(_split(t) for t in _many(self.derived))

    def value(self, namespace: argparse.Namespace) -> Any:
        """The field value from the parsed flags."""
        raw = getattr(namespace, self.key)
        return raw if self.convert is None else self.convert(raw)

    @property
    def field_default(self) -> Any:
        """What the target fields hold when the flag is not given."""
        return self.default if self.convert is None else self.convert(self.default)


def _many(x: str | tuple[str, ...]) -> tuple[str, ...]:
    return (x,) if isinstance(x, str) else x


def _split(target: str) -> tuple[str, str]:
    group, _, field = target.rpartition(".")
    return group, field


def section(title: str, *flags: Flag) -> tuple[Flag, ...]:
    return tuple(dataclasses.replace(f, section=title) for f in flags)
