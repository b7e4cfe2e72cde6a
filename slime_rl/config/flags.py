"""The command-line surface of `slime-rl train`, as one declarative table.

Megatron's own flag names for everything Megatron owns (parallel sizes, batch sizes, optimizer,
checkpoints) so that users carry their Megatron scripts over unchanged; slime's names for the RL
flags; `--sglang-*` passed through to SGLang's server under its own ServerArgs names.

We mirror Megatron's names instead of calling `megatron.training.arguments.parse_args`: this room
may not import Megatron (ARCHITECTURE.md), and Megatron's parser adds ~800 flags of which the trainer
derives the architecture ones from the HF config anyway.

`FLAGS` is the one place a flag is declared: its name, the config group field(s) it lands in
(`to`, "group.field"), its default (the group dataclasses take their field defaults from here,
`default_of`), its type/choices (argparse) and its own range check (`check`, applied by `checks.py`
with a message that names the flag). `derived` names the fields `load.py` computes from the flag
together with others (e.g. --eps-clip-high defaults to --eps-clip). `groups.py` checks at import
that every target field exists and that its default is the flag's, so a renamed field fails loudly.

The rows (`flag_spec.Flag`) are written by section in `flags_trainer.py`, `flags_rollout.py`,
`flags_algo.py` and `flags_from_slime.py`; `FLAGS` joins them in that order, the order of `--help`
and docs/flags.md. This module builds the parser from `FLAGS` and re-exports the names the rows
share (`flag_spec.py`: choices, pass-through prefixes).
"""

from __future__ import annotations

import argparse
from typing import Any

from slime_rl.config.estimators import ADVANTAGE_ESTIMATORS
from slime_rl.config.flag_spec import (
    EMBEDDED_SGLANG_ARGS,
    KL_LOSS_TYPES,
    LOSS_AGG_MODES,
    LR_DECAY_STYLES,
    OWN_SGLANG_FLAGS,
    REWARD_TYPES,
    ROLLOUT_BACKENDS,
    ROUTER_PREFIX,
    SGLANG_PREFIX,
    Flag,
)
from slime_rl.config.flags_algo import ALGO_FLAGS
from slime_rl.config.flags_from_slime import FROM_SLIME_FLAGS, FROM_SLIME_SECTION, SLIME_DEFAULT_ROLLOUT
from slime_rl.config.flags_model import MODEL_ARGS_SECTION, MODEL_FLAGS
from slime_rl.config.flags_rollout import ROLLOUT_FLAGS
from slime_rl.config.flags_trainer import TRAINER_FLAGS

__all__ = ["ADVANTAGE_ESTIMATORS", "EMBEDDED_SGLANG_ARGS", "FLAGS", "FROM_SLIME_SECTION", "KL_LOSS_TYPES",
           "LOSS_AGG_MODES", "LR_DECAY_STYLES", "MODEL_ARGS_SECTION", "OWN_SGLANG_FLAGS", "REWARD_TYPES",
           "ROLLOUT_BACKENDS", "ROUTER_PREFIX", "SGLANG_PREFIX", "SLIME_DEFAULT_ROLLOUT", "Flag", "build_parser",
           "default_of", "flag"]

# the sections in --help's order: options, the trainer's (Megatron names), the rollout side, the
# algorithm and the run's outputs, slime's MODEL_ARGS (compared with config.json), then slime's and
# Megatron-LM's flags this trainer has one value for
FLAGS: tuple[Flag, ...] = (*TRAINER_FLAGS, *ROLLOUT_FLAGS, *ALGO_FLAGS, *MODEL_FLAGS, *FROM_SLIME_FLAGS)

_BY_NAME: dict[str, Flag] = {f.name: f for f in FLAGS}
assert len(_BY_NAME) == len(FLAGS), "a flag is declared twice"
assert len({f.key for f in FLAGS}) == len(FLAGS), "two flags share a namespace attribute"


def flag(name: str) -> Flag:
    """The table entry of `name` ("--rollout-max-response-len")."""
    return _BY_NAME[name]


def default_of(name: str) -> Any:
    """The default a group field takes from its flag (the one place the value is written)."""
    return _BY_NAME[name].field_default


def build_parser() -> argparse.ArgumentParser:
    """All flags of `slime-rl train`, from `FLAGS`. Defaults follow Megatron (optimizer) and slime (RL)."""
    p = argparse.ArgumentParser(
        prog="slime-rl train",
        description="RL post-training: Megatron-core trainer, SGLang (or built-in) rollout engines, Ray.",
        allow_abbrev=False,
    )
    groups: dict[str, argparse._ActionsContainer] = {"options": p}
    for f in FLAGS:
        if f.section not in groups:
            groups[f.section] = p.add_argument_group(f.section)
        kwargs: dict[str, Any] = {"help": f.help}
        if f.dest is not None:
            kwargs["dest"] = f.dest
        if f.action is not None:
            kwargs["action"] = f.action
        else:
            kwargs |= {"default": f.default, "type": f.type, "choices": f.choices, "nargs": f.nargs,
                       "metavar": f.metavar}
            kwargs = {k: v for k, v in kwargs.items() if v is not None or k == "default"}
        groups[f.section].add_argument(f.name, **kwargs)
    return p
