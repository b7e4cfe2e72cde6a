"""The flag reference (docs/flags.md) rendered from the parser, so the docs cannot drift from it."""

from __future__ import annotations

import argparse

from slime_rl.config.flags import EMBEDDED_SGLANG_ARGS, FROM_SLIME_SECTION, MODEL_ARGS_SECTION, build_parser
from slime_rl.config.from_slime import DEFAULTS_NOW_SLIMES, DIFFERENCES


def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off" if isinstance(action, argparse._StoreTrueAction) else "on"
    return "" if action.default is None else f"`{action.default}`"


def render_flag_reference() -> str:
    """Markdown: one table per argument group, one row per flag (name, default, choices, help)."""
    parser = build_parser()
    lines = ["# `slime-rl train` flags", "",
             "Generated from the parser by `python tools/gen_flag_reference.py`; a test keeps it in sync.",
             "Any `--sglang-<name> VALUE` not listed here is passed to SGLang's server as `--<name> VALUE`.",
             "With `--rollout-backend embedded` only "
             + " and ".join(f"`--sglang-{n.replace('_', '-')}`" for n in EMBEDDED_SGLANG_ARGS)
             + " are accepted: the built-in engine reads them too (decoding with CUDA graphs on GPU).", ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not actions:
            continue
        lines += [f"## {group.title}", "", "| flag | default | choices | meaning |", "|---|---|---|---|"]
        for a in actions:
            choices = ", ".join(str(c) for c in a.choices) if a.choices else ""
            meaning = (a.help or "").replace("|", "\\|").replace("\n", " ")
            lines.append(f"| `{'`, `'.join(a.option_strings)}` | {_default(a)} | {choices} | {meaning} |")
        lines.append("")
    return "\n".join(lines + _coming_from_slime())


def _cell(value: object) -> str:
    return str(value).replace("|", "\\|")


def _coming_from_slime() -> list[str]:
    """The "Coming from slime" section: flags of the same name that differ (config/from_slime.py)."""
    lines = ["## Coming from slime", "",
             "slime's scripts carry over: Megatron's and slime's flag names are this trainer's, the model is built "
             "from `--hf-checkpoint`'s config.json and a script's `MODEL_ARGS` are compared with it (the table "
             f"*{MODEL_ARGS_SECTION}* above: a flag that describes another model is refused naming both values), and "
             "an unknown flag is an error. "
             f"Flags this trainer has one value for are in the table *{FROM_SLIME_SECTION}* above: accepted with "
             "that value, refused with the reason otherwise. Where a flag of the same name has another default "
             "or meaning here:", "",
             "| flag | slime / Megatron-LM | here | why |", "|---|---|---|---|"]
    for d in DIFFERENCES:
        ours = f"`{d.ours}`" if d.kind == "default" else d.ours
        lines.append(f"| `{d.flag}` | {_cell(d.theirs)} | {_cell(ours)} | {_cell(d.why)} |")
    lines += ["", "Defaults that are now slime's / Megatron-LM's (the recipes in `configs/` give the old value "
              "explicitly): " + ", ".join(f"`{name}` {new} (was {old})" for name, old, new in DEFAULTS_NOW_SLIMES)
              + ".", ""]
    return lines
