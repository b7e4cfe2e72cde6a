"""Pass-through flags (`--sglang-<name>`, `--router-<name>`) checked against the command line of
the program they go to, and rendered the way that program's argparse reads them.

The tables come from the program's own parser: `ServerArgs.add_cli_args` (SGLang) and
`RouterArgs.add_cli_args` (sglang-router), read live when the package imports on this machine,
else from the snapshot checked in next to this file (written by tools/snapshot_cli_args.py from
the versions named in the file). A table maps every option string, without its dashes and with
underscores (`mem_fraction_static`, `model`, `no_enable_tf32_matmul`), to the argparse dest and
the shape of its value:

    flag      store_true / store_const: the bare flag, never a value
    bool      BooleanOptionalAction: `--x` for True, `--no-x` for False
    value     one value
    list      nargs '+' / '*': the flag followed by every item
    optional  nargs '?': bare flag, or flag and a value
    append    action 'append': the flag once per item

Why check at all: SGLang exits with "unrecognized arguments" minutes into a run, on a GPU node,
after the trainer was built; a typo caught here costs nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from slime_rl.config.builtin_engine import switch_value
from slime_rl.config.sglang_changes import older_name_hint

KINDS = ("flag", "bool", "value", "list", "optional", "append")
_HERE = Path(__file__).parent
SGLANG_SNAPSHOT = _HERE / "sglang_server_args.json"
ROUTER_SNAPSHOT = _HERE / "sglang_router_args.json"


class PassthroughError(ValueError):
    """A pass-through flag the target program would reject; the message names our flag."""


@dataclass(frozen=True)
class CliOption:
    dest: str
    kind: str


@dataclass(frozen=True)
class CliTable:
    program: str  # what the flags are passed to, e.g. "sglang 0.5.23 (python -m sglang.launch_server)"
    source: str  # "live" (read from the installed package) or the snapshot's file name
    options: dict[str, CliOption]  # option name, dashes -> underscores, without the leading "--"
    fields: frozenset[str]  # the args class's field names (some have no command-line flag)

    def to_json(self) -> dict[str, Any]:
        return {"program": self.program, "fields": sorted(self.fields),
                "options": {n: [o.dest, o.kind] for n, o in sorted(self.options.items())}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str) -> CliTable:
        options = {n: CliOption(dest, kind) for n, (dest, kind) in data["options"].items()}
        bad = sorted(n for n, o in options.items() if o.kind not in KINDS)
        if bad:
            raise ValueError(f"{source}: unknown option kinds for {bad}")
        return cls(data["program"], source, options, frozenset(data["fields"]))


def _kind(action: argparse.Action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction):
        return "bool"
    if isinstance(action, argparse._AppendAction):
        return "append"
    if action.nargs == 0:
        return "flag"
    if action.nargs in ("+", "*") or isinstance(action.nargs, int) and action.nargs > 1:
        return "list"
    if action.nargs == "?":
        return "optional"
    return "value"


def table_from_parser(parser: argparse.ArgumentParser, program: str, fields: Iterable[str],
                      source: str = "live") -> CliTable:
    """Every long option of `parser` (help excluded), keyed by its name with underscores."""
    options: dict[str, CliOption] = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        for opt in action.option_strings:
            if not opt.startswith("--"):
                continue
            kind = _kind(action)
            if kind == "bool" and opt.startswith("--no-"):
                kind = "flag"  # the negative spelling of a BooleanOptionalAction is a plain switch
            options[opt[2:].replace("-", "_")] = CliOption(action.dest, kind)
    return CliTable(program, source, options, frozenset(fields))


def _field_names(cls: type) -> list[str]:
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    return list(getattr(cls, "__struct_fields__", ()))  # SGLang >= 0.5.2x: a msgspec Struct


@cache
def sglang_server_table() -> CliTable:
    """SGLang's server flags: from `sglang.srt.server_args` when it imports, else the snapshot."""
    try:
        from sglang.srt.server_args import ServerArgs
        from sglang.version import __version__
    except ImportError:
        return CliTable.from_json(json.loads(SGLANG_SNAPSHOT.read_text()), SGLANG_SNAPSHOT.name)
    except (OSError, RuntimeError) as exc:  # installed but unusable here (e.g. a CUDA library missing)
        return CliTable.from_json(json.loads(SGLANG_SNAPSHOT.read_text()),
                                  f"{SGLANG_SNAPSHOT.name}; the installed sglang failed to import: {exc}")
    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    return table_from_parser(parser, f"sglang {__version__} (python -m sglang.launch_server)",
                             _field_names(ServerArgs))


@cache
def router_table() -> CliTable:
    """sglang-router's flags: from `sglang_router.router_args` when it imports, else the snapshot."""
    try:
        from sglang_router.router_args import RouterArgs
        from sglang_router.version import __version__
    except ImportError:
        return CliTable.from_json(json.loads(ROUTER_SNAPSHOT.read_text()), ROUTER_SNAPSHOT.name)
    parser = argparse.ArgumentParser(add_help=False)
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return table_from_parser(parser, f"sglang-router {__version__} (python -m sglang_router.launch_router)",
                             _field_names(RouterArgs))


def _as_bool(ours: str, value: Any) -> bool:
    on = switch_value(value)
    if on is None:
        raise PassthroughError(f"{ours}: a switch (give it bare, or true/false), got {value!r}")
    return on


def check_passthrough(args: Mapping[str, Any], table: CliTable, prefix: str,
                      owned: Mapping[str, str]) -> dict[str, Any]:
    """Validate `{name: value}` (name = option name with underscores, as `--<prefix><name>` gave it)
    against `table`; returns the values normalized (switches as bool). Raises PassthroughError naming
    `--<prefix><name>`: unknown names (with close matches), names whose dest we set ourselves (`owned`:
    dest -> the flag or mechanism that sets it), and values of the wrong shape."""
    out: dict[str, Any] = {}
    for name, value in args.items():
        if value is None:  # `key: null` in YAML: not set, the program's default applies
            continue
        ours = f"--{prefix}{name.replace('_', '-')}"
        opt = table.options.get(name)
        if opt is None:
            raise PassthroughError(_unknown(ours, name, table, prefix))
        if opt.dest in owned:
            raise PassthroughError(f"{ours}: --{name.replace('_', '-')} is set by slime_rl itself "
                                   f"({owned[opt.dest]}); drop {ours}")
        out[name] = _normalize(ours, opt, value)
    return out


def _unknown(ours: str, name: str, table: CliTable, prefix: str) -> str:
    msg = f"{ours}: {table.program} has no flag --{name.replace('_', '-')}"
    older = older_name_hint(name) if prefix == "sglang-" else None
    if older:  # slime-rl train renames these (config/sglang_changes.py); this is a direct caller
        msg += f" ({older})"
    if name in table.fields:
        msg += f" ('{name}' is a field without a command-line flag)"
    close = difflib.get_close_matches(name, list(table.options), n=3, cutoff=0.6)
    if close:
        msg += "; did you mean " + ", ".join(f"--{prefix}{c.replace('_', '-')}" for c in close) + "?"
    if table.source != "live":
        msg += f" (checked against the snapshot {table.source}; with the package installed here the " \
               "installed version is used)"
    return msg


def _normalize(ours: str, opt: CliOption, value: Any) -> Any:
    if opt.kind in ("flag", "bool"):
        return _as_bool(ours, value)
    if value is True:
        if opt.kind == "optional":
            return True
        raise PassthroughError(f"{ours} needs a value")
    if opt.kind == "value":
        if isinstance(value, list | tuple):
            raise PassthroughError(f"{ours} takes one value, got {len(value)}: {list(value)}")
        return value
    if opt.kind == "optional":
        return value
    return list(value) if isinstance(value, list | tuple) else [value]  # list, append


def render(args: Mapping[str, Any], table: CliTable) -> list[str]:
    """argv for checked args, each under its own option string, in the shape its action reads."""
    argv: list[str] = []
    for name, value in args.items():
        flag, kind = "--" + name.replace("_", "-"), table.options[name].kind
        if kind == "flag":
            argv += [flag] if value else []
        elif kind == "bool":
            argv.append(flag if value else "--no-" + flag[2:])
        elif kind == "optional" and value is True:
            argv.append(flag)
        elif kind == "list":
            argv += [flag, *(str(v) for v in value)]
        elif kind == "append":
            for item in value:
                argv += [flag, *(str(v) for v in (item if isinstance(item, list | tuple) else [item]))]
        else:
            argv += [flag, str(value)]
    return argv
