"""argv (+ the YAML file of --config) -> the flat namespace of `slime-rl train` and the pass-through.

Order of precedence: parser defaults < YAML file (`--config`) < command line < slime's
`--custom-config-path` file (slime sets its keys over the parsed flags; config/slime_mis.py). The `--sglang-<name>`
and `--router-<name>` flags are taken out of argv first and returned as a dict (router names keyed
`router:<name>`, `split_router_args` separates them). An EasyR1 YAML is mapped to these flags first
(config/easyr1.py); slime's flags this trainer does not have are refused by name (config/slime_args.py);
`--sglang-*` flags under an older SGLang's names are renamed or refused (config/sglang_changes.py).
Errors raise `ConfigError` naming the flag (or the YAML file and key).
"""

from __future__ import annotations

import argparse
import difflib
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from slime_rl.config.builtin_engine import not_taken
from slime_rl.config.checks import ConfigError, ConfigNote
from slime_rl.config.easyr1 import describe, is_easyr1, map_easyr1, merge_cli, split_cli
from slime_rl.config.flags import OWN_SGLANG_FLAGS, ROUTER_PREFIX, SGLANG_PREFIX, build_parser
from slime_rl.config.sglang_changes import modernize
from slime_rl.config.slime_args import refuse_slime_only
from slime_rl.config.slime_mis import MIS_FUNCTION, MIS_KEYS, mis_flags

# how parse_flags keys a `--router-<name>` in its pass-through dict: `--sglang-router-ip` (slime's
# external-router flag) stays the SGLang name `router_ip` and cannot be taken for a router flag
ROUTER_KEY = "router:"


DOCS_HINT = ("The flags are listed in docs/flags.md; slime's and Megatron-LM's, and what each becomes, in "
             "docs/migration.md")


def explain_parse_error(message: str, options: Sequence[str]) -> str:
    """argparse's terse message -> a sentence naming each flag (or value) and what to do instead:
    an unknown flag gets its closest known names, a bad value the values or type the flag takes."""
    if message.startswith("unrecognized arguments: "):  # argparse's own message: its tokens split on spaces
        return explain_unrecognized(message.removeprefix("unrecognized arguments: ").split(), options)
    m = re.fullmatch(r"argument (\S+?)(?:/\S+)?: invalid choice: (.+?) \(choose from (.+)\)", message)
    if m:
        flag, value, choices = m.groups()
        return f"{flag} {value}: not a value it takes here; it takes {choices}"
    m = re.fullmatch(r"argument (\S+?)(?:/\S+)?: invalid (\w+) value: (.+)", message)
    if m:
        flag, kind, value = m.groups()
        # a type function of the table (flag_spec.py: _positive_int, ...) reads as words
        words = kind.strip("_").replace("_", " ").replace("nonneg", "non-negative").replace("int", "integer")
        what = {"integer": "an integer", "float": "a number"}.get(words, f"a {words}")
        return f"{flag} {value}: expected {what}"
    m = re.fullmatch(r"argument (\S+?)(?:/\S+)?: expected (one argument|at least one argument)", message)
    if m:
        return f"{m.group(1)} needs a value"
    m = re.fullmatch(r"argument (\S+?)(?:/\S+)?: ignored explicit argument (.+)", message)
    if m:
        return f"{m.group(1)} is a switch: it takes no value (got {m.group(2)})"
    m = re.fullmatch(r"argument (\S+?)(?:/\S+)?: (.+)", message)  # a type function's own message
    return f"{m.group(1)}: {m.group(2)}" if m else message


def explain_unrecognized(tokens: Sequence[str], options: Sequence[str]) -> str:
    """The tokens argparse could not place (each as given: a value may hold spaces) -> one sentence each:
    an unknown flag with its closest known names (its own value not reported again), a stray value."""
    parts, after_flag = [], False
    for token in tokens:
        if not token.startswith("-") and after_flag:  # the unknown flag's own value
            after_flag = False
            continue
        after_flag = token.startswith("-") and "=" not in token
        if token.startswith("-"):
            name = token.partition("=")[0]
            close = difflib.get_close_matches(name, options, n=3, cutoff=0.75)
            hint = f" (did you mean {' or '.join(close)}?)" if close else ""
            parts.append(f"{name} is not a flag of slime-rl train, nor a flag of slime's or Megatron-LM's that "
                         f"it reads{hint}")
        else:
            parts.append(f"{token!r} is a value with no flag before it that takes one")
    return "; ".join(parts) + f". {DOCS_HINT}"


class _Parser(argparse.ArgumentParser):
    def _options(self) -> list[str]:
        return [o for a in self._actions for o in a.option_strings if o.startswith("--")]

    def parse_args(self, args=None, namespace=None):  # as argparse's, with the unplaced tokens kept whole
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            raise ConfigError(explain_unrecognized(extras, self._options()))
        return ns

    def error(self, message: str):  # argparse would print and exit(2); we want an exception naming the flag
        raise ConfigError(explain_parse_error(message, self._options()))


def _make_parser() -> argparse.ArgumentParser:
    base = build_parser()
    parser = _Parser(prog=base.prog, description=base.description, allow_abbrev=False,
                     parents=[base], add_help=False, conflict_handler="resolve")
    return parser


def _split_passthrough(argv: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """Pull `--sglang-<name> [VALUE ...]` and `--router-<name> [VALUE ...]` out of argv; returns
    (rest, {name: value}) with router names as `router:<name>`. No value: True (a switch); several
    values (our flags take no positionals, so every token up to the next `--` belongs to it): a list."""
    rest: list[str] = []
    sglang: dict[str, Any] = {}
    i = 0
    argv = list(argv)
    while i < len(argv):
        tok = argv[i]
        if tok.partition("=")[0] in OWN_SGLANG_FLAGS:
            rest.append(tok)
        elif tok.startswith(SGLANG_PREFIX) or tok.startswith(ROUTER_PREFIX):
            key, _, inline = tok.partition("=")
            name = key[len(SGLANG_PREFIX):] if key.startswith(SGLANG_PREFIX) else ROUTER_KEY + key[
                len(ROUTER_PREFIX):]
            name = name.replace("-", "_")
            values = []
            while not inline and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                values.append(argv[i + 1])
                i += 1
            value: Any = inline or (values[0] if len(values) == 1 else values or True)
            sglang[name] = value
        else:
            rest.append(tok)
        i += 1
    return rest, sglang


def split_router_args(passthrough: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """parse_flags' pass-through dict -> ({sglang name: value}, {router name: value})."""
    sglang = {k: v for k, v in passthrough.items() if not k.startswith(ROUTER_KEY)}
    router = {k[len(ROUTER_KEY):]: v for k, v in passthrough.items() if k.startswith(ROUTER_KEY)}
    return sglang, router


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, except that a key given twice in one mapping is an error naming the key
    and both lines (YAML says keys are unique; PyYAML would keep the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.setdefault(key, line)
            except TypeError:  # an unhashable key: the base class says so
                break
            if first != line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (lines {first} and {line}); which one is meant?",
                    key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(flag: str, path: str) -> Any:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{flag}: file not found: {path}")
    try:
        return yaml.load(file.read_text(), Loader=UniqueKeyLoader) or {}  # a SafeLoader: no object tags
    except yaml.YAMLError as exc:
        raise ConfigError(f"{flag} {path}: not valid YAML: {exc}") from exc


def _yaml_overlay(parser: argparse.ArgumentParser, path: str | None, backend: str | None = None,
                  easyr1_cli: Sequence[str] = ()) -> tuple[dict[str, Any], dict[str, Any]]:
    """The --config file as flag defaults and --sglang-* pass-through; EasyR1's nested layout is
    mapped first (config/easyr1.py) and the mapping printed. `backend`: --rollout-backend from the
    command line (the EasyR1 mapping depends on it). `easyr1_cli`: EasyR1's own command line instead of a
    --config file (`config=FILE section.key=value ...`, merged as EasyR1's main merges it)."""
    if easyr1_cli:
        data, where = merge_cli(easyr1_cli, lambda file: _read_yaml("config=", file), ConfigError)
    else:
        data, where = _read_yaml("--config", path), f"--config {path}"
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: top level must be a mapping of flag names to values")
    if easyr1_cli or is_easyr1(data):
        mapping = map_easyr1(data, where, ConfigError, backend)
        print(describe(mapping, where), flush=True)
        # (how errors name the key, the flag key, the value)
        items = [(f"{mapping.origin[k]} -> --{k.replace('_', '-')}", k, v) for k, v in mapping.flags.items()]
    else:
        refuse_slime_only([str(k) for k in data], f"{where}: ", ConfigError)
        items = [(k, k, v) for k, v in data.items()]
    return _flag_values(parser, items, f"{where}: ")


def _flag_values(parser: argparse.ArgumentParser, items: list[tuple[Any, Any, Any]],
                 where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(how errors name the key, the flag key, the value) of a YAML file -> ({dest: typed value}, --sglang-*
    pass-through); `where` starts each error."""
    dests = {a.dest: a for a in parser._actions}
    # a key may also be the flag's own name where it differs from its dest: `no-pack-sequences: true`
    # (store_false, dest pack_sequences) says what `--no-pack-sequences` says; `pack-sequences: false` too
    flags = {o.lstrip("-").replace("-", "_"): a for a in parser._actions for o in a.option_strings
             if o.startswith("--") and o.lstrip("-").replace("-", "_") != a.dest}
    defaults: dict[str, Any] = {}
    sglang: dict[str, Any] = {}
    for raw_key, flag_key, value in items:
        key = str(flag_key).lstrip("-").replace("-", "_")
        if key.startswith("sglang_") and "--" + key.replace("_", "-") not in OWN_SGLANG_FLAGS:
            sglang[key[len("sglang_"):]] = value
            continue
        if key.startswith("router_"):  # --router-<name>: kept as router:<name> like on the command line
            sglang[ROUTER_KEY + key[len("router_"):]] = value
            continue
        if key not in dests and key in flags and flags[key].nargs == 0:  # a switch by its flag name
            action = flags[key]
            if not isinstance(value, bool):
                raise ConfigError(f"{where}key '{raw_key}': expected true or false, got {value!r:.40}")
            if value:  # true: as if the switch were given; false: as if it were not
                defaults[action.dest] = action.const
            continue
        if key in ("config", "help") or key not in dests:
            raise ConfigError(f"{where}unknown key '{raw_key}' (not a flag of slime-rl train)")
        action = dests[key]
        if value is None:  # `key:` or `key: null` leaves the flag at its default (None would bypass its type)
            continue
        if action.nargs == 0 and value is not None and not isinstance(value, bool):  # store_true/false
            raise ConfigError(f"{where}key '{raw_key}': expected true or false, got {value!r:.40}")
        many = action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 0)
        if many and value is not None:  # a list flag: one value is a list of one
            value = list(value) if isinstance(value, list) else [value]
        elif isinstance(value, (list, dict)):
            raise ConfigError(f"{where}key '{raw_key}': expected one value, got {type(value).__name__}")
        if not many and action.type is None and action.nargs != 0:  # a string flag (a path, a name)
            if isinstance(value, bool):
                raise ConfigError(f"{where}key '{raw_key}': expected a string, got {value!r}")
            value = str(value)  # a number written without quotes (a folder named 2024)
        if value is not None and action.type is not None:  # a bool for a number is refused here too
            try:
                value = [action.type(str(v)) for v in value] if many else action.type(str(value))
            except (argparse.ArgumentTypeError, ValueError) as exc:
                raise ConfigError(f"{where}key '{raw_key}': {exc}") from exc
        if many and value is not None:
            value = [str(v) if action.type is None else v for v in value]
        if action.choices is not None and value is not None and value not in action.choices:
            raise ConfigError(f"{where}key '{raw_key}': {value!r} is not one of {list(action.choices)}")
        defaults[key] = value
    return defaults, sglang


def parse_flags(argv: Sequence[str]) -> tuple[argparse.Namespace, dict[str, Any]]:
    """Parse argv (YAML overlay included); returns the flat namespace and the --sglang-* args."""
    rest, sglang_cli = _split_passthrough(argv)
    rest, easyr1_cli = split_cli(rest)
    parser = _make_parser()
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    pre.add_argument("--rollout-backend", default=None)
    known, _ = pre.parse_known_args(rest)
    if known.config and easyr1_cli:
        raise ConfigError(f"--config {known.config} and EasyR1's command line ({' '.join(easyr1_cli[:2])}"
                          f"{' ...' if len(easyr1_cli) > 2 else ''}): give one (EasyR1's file as config=FILE with "
                          "its overrides, or a file of this project's flags as --config FILE)")
    refuse_slime_only([t for t in rest if t.startswith("--")], "", ConfigError)
    sglang: dict[str, Any] = {}
    if known.config or easyr1_cli:
        defaults, sglang = _yaml_overlay(parser, known.config, known.rollout_backend, easyr1_cli)
        given = {t.partition("=")[0] for t in rest if t.startswith("--")}
        # the two ways to say how long to train exclude each other: the command line's wins over the file's
        for flag, other in (("--num-rollout", "num_epoch"), ("--num-epoch", "num_rollout")):
            if flag in given:
                defaults.pop(other, None)
        parser.set_defaults(**defaults)
    args = parser.parse_args(rest)
    sglang = _current_names(sglang) | _current_names(sglang_cli)  # each source alone: the command line wins
    if args.custom_config_path:  # slime sets its keys after parsing: over the command line
        sglang |= _current_names(_custom_config(parser, args))
    explicit = known.rollout_backend is not None or (bool(known.config or easyr1_cli) and "rollout_backend" in defaults)
    if not explicit:
        _backend_from_flags(args, sglang)
    return args, sglang


def _custom_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """slime's --custom-config-path: the mismatch helper's keys as the off-policy flags (config/slime_mis.py,
    the mapping said in a note), every other key as the flag of its name; set on `args` over the command
    line, as slime sets them on its args. A helper key without the helper, or one that contradicts a flag the
    command line gave, is refused. Returns the file's --sglang-* pass-through."""
    path = args.custom_config_path
    where = f"--custom-config-path {path}: "
    data = _read_yaml("--custom-config-path", path)
    if not isinstance(data, dict):
        raise ConfigError(f"{where}top level must be a mapping of settings to values")
    helper = {k: v for k, v in data.items() if k in MIS_KEYS}
    if helper:
        if args.custom_tis_function_path != MIS_FUNCTION:
            raise ConfigError(f"{where}key '{next(iter(helper))}' is a setting of slime's mismatch helper: it takes "
                              f"effect with --custom-tis-function-path {MIS_FUNCTION} (slime ignores it without)")
        flags, said = mis_flags(helper, where, ConfigError)
        for dest, value in flags.items():
            given = getattr(args, dest)
            if given != parser.get_default(dest) and given != value:
                raise ConfigError(f"{where}the mismatch helper's settings give --{dest.replace('_', '-')} "
                                  f"{value}; the command line gives {given}: give one")
            setattr(args, dest, value)
        warnings.warn(f"{where}slime's mismatch helper: {said}", ConfigNote, stacklevel=3)
    rest = [k for k in data if k not in MIS_KEYS]
    refuse_slime_only([str(k) for k in rest], where, ConfigError)
    values, sglang = _flag_values(parser, [(k, k, data[k]) for k in rest], where)
    for dest, value in values.items():
        setattr(args, dest, value)
    return sglang


def _current_names(passthrough: dict[str, Any]) -> dict[str, Any]:
    """One source's pass-through with older SGLang's flag names replaced by the current ones (or
    refused), each replacement said once in a note (config/sglang_changes.py)."""
    sglang, router = split_router_args(passthrough)
    sglang, notes = modernize(sglang)
    for note in notes:
        warnings.warn(note, ConfigNote, stacklevel=4)
    return sglang | {ROUTER_KEY + k: v for k, v in router.items()}


def _backend_from_flags(args: argparse.Namespace, sglang: dict[str, Any]) -> None:
    """No --rollout-backend given: a script written for SGLang (slime's always are) gets SGLang. Its
    server flags that the built-in engine does not take, or engines over several GPUs, choose it; the
    run says so first (a warning) and how to get the built-in engine instead."""
    foreign = not_taken(split_router_args(sglang)[0])
    reasons = []
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        what = "is an SGLang server flag" if len(foreign) == 1 else "are SGLang server flags"
        reasons.append(f"{', '.join(foreign[:3])}{more} {what}, which the built-in engine does not take")
    if args.rollout_num_gpus_per_engine > 1:
        reasons.append(f"--rollout-num-gpus-per-engine {args.rollout_num_gpus_per_engine} needs a multi-GPU engine")
    if reasons and args.rollout_backend != "sglang":
        args.rollout_backend = "sglang"
        warnings.warn(f"--rollout-backend sglang: {'; '.join(reasons)} (give --rollout-backend embedded, without "
                      "them, for the built-in engine)", ConfigNote, stacklevel=3)
