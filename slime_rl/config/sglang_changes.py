"""`--sglang-<name>` flags under an older SGLang's names: renamed ones passed on under the name of the
SGLang the run uses, removed ones refused with the release that removed them.

slime's scripts were written for SGLang 0.5.15; this project runs 0.5.23 (launch/setup.sh, and the
snapshot engines/sglang_server_args.json). `sglang_flag_changes.json`, next to this file, is the diff
of the two versions' own parsers (with every release between them), written by
tools/sglang_flag_changes.py:

- renamed: the old name becomes the new one, with the value converted where the shape changed (a
  switch that stood for a value gives that value, e.g. `--sglang-disable-piecewise-cuda-graph` ->
  `--sglang-cuda-graph-backend-prefill disabled`; old choices mapped as SGLang's alias said, e.g.
  `in-seq-split` -> `zigzag`). The run says so once per flag, a `ConfigNote`.
- ignored: flags that did nothing in 0.5.15 already (SGLang only warned): dropped, with a note.
- removed: refused (ConfigError) naming the release that removed the flag, the last that had it and
  its help text there (where SGLang says what replaces it), and why a successor it named does not
  apply.
- values_removed: a choice that SGLang removed from a flag both versions have is refused likewise.

An entry applies only when the SGLang the flags go to is at least the release that removed the old
name (`target_version`: the installed sglang's version, read from its distribution metadata without
importing it; else the diff's new version, which is the snapshot's). Router flags are not touched.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

from slime_rl.config.builtin_engine import switch_value
from slime_rl.config.checks import ConfigError

DATA = Path(__file__).with_name("sglang_flag_changes.json")
SWITCHES = ("flag", "bool")


@cache
def changes() -> dict[str, Any]:
    """The diff (see the module docstring): keys old, new, versions, renamed, ignored, removed, values_removed."""
    return json.loads(DATA.read_text())


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def target_version() -> str:
    """The SGLang release the --sglang-* flags go to: the installed one, else the diff's new version."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return changes()["new"]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _ours(name: str) -> str:
    return "--sglang-" + name.replace("_", "-")


def _switch(name: str, value: Any) -> bool:
    on = switch_value(value)
    if on is None:
        raise ConfigError(f"{_ours(name)}: a switch (give it bare, or true/false), got {value!r}")
    return on


def _shown(value: Any) -> str:
    if value is True:
        return ""
    return " " + (" ".join(map(str, value)) if isinstance(value, list | tuple) else str(value))


def _removed_message(name: str, entry: dict[str, Any], version: str) -> str:
    msg = (f"{_ours(name)}: SGLang {entry['removed_in']} removed {_flag(name)} (SGLang {entry['last']} was the last "
           "to take it)")
    if entry.get("successor"):
        msg += f"; its successor {entry['successor']} does not apply: {entry['why']}"
    msg += f"; SGLang {version} has no flag in its place: drop it"
    if entry.get("sglang_help"):
        msg += f". SGLang {entry['last']}'s help for it: \"{entry['sglang_help'].strip()}\""
    return msg


def _convert(name: str, entry: dict[str, Any], value: Any) -> Any:
    """The old flag's value as the new flag's (None: the flag is dropped, a switch given false)."""
    if entry["old_kind"] in SWITCHES:
        if not _switch(name, value):
            return None
        return entry.get("value", True)
    values = entry.get("values", {})
    items = [values.get(str(v), v) for v in (value if isinstance(value, list | tuple) else [value])]
    refused = [str(v) for v in items if str(v) in entry.get("values_refused", ())
               or (entry.get("choices") and str(v) not in entry["choices"])]
    if refused:
        raise ConfigError(f"{_ours(name)} {' '.join(refused)}: SGLang {entry['removed_in']} renamed {_flag(name)} to "
                          f"{_flag(entry['to'])}, which takes {', '.join(entry['choices'])}")
    return items if isinstance(value, list | tuple) else items[0]


def modernize(args: Mapping[str, Any], version: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """`{SGLang option name: value}` of one source (the command line or the YAML file) with older
    SGLang's names replaced: (the args, the notes to print, one per flag). ConfigError naming the flag
    for a removed flag or value, a value the renamed flag refuses, or an old and a new name of one flag
    given different values. `version`: the SGLang the flags go to (default `target_version()`)."""
    data, version = changes(), version or target_version()
    applies = (lambda entry: _key(version) >= _key(entry["removed_in"]))
    out: dict[str, Any] = {}
    notes: list[str] = []
    origin: dict[str, str] = {}  # new name -> the old name that set it
    for name, value in args.items():
        if name in data["removed"] and applies(data["removed"][name]) and value is not None:
            raise ConfigError(_removed_message(name, data["removed"][name], version))
        ignored = data["ignored"].get(name)
        if ignored is not None and applies(ignored):
            notes.append(f"{_ours(name)}: did nothing in SGLang {data['old']} already (it only warned: "
                         f"\"{ignored['sglang_help']}\") and SGLang {ignored['removed_in']} removed it; dropped")
            continue
        entry = data["renamed"].get(name)
        if entry is None or not applies(entry) or value is None:
            if name in out and out[name] != value:
                raise ConfigError(f"{_ours(name)} {value!r} and {_ours(origin[name])} (its older name, giving "
                                  f"{out[name]!r}) disagree: give one")
            out[name] = value
            continue
        new, converted = entry["to"], _convert(name, entry, value)
        if converted is None:
            notes.append(f"{_ours(name)} false: dropped (SGLang {entry['removed_in']} renamed {_flag(name)} to "
                         f"{_flag(new)})")
            continue
        if new in out and out[new] != converted:
            other = _ours(origin.get(new, new))
            raise ConfigError(f"{_ours(name)} and {other} set SGLang {version}'s {_flag(new)} to {converted!r} and "
                              f"{out[new]!r}: give one")
        out[new] = converted
        origin[new] = name
        mapped = f" (SGLang's new name for {value})" if entry.get("values", {}).get(str(value)) else ""
        notes.append(f"{_ours(name)}: SGLang {entry['removed_in']} removed {_flag(name)} ({data['old']} took it); "
                     f"passed as {_ours(new)}{_shown(converted)}{mapped}, its name in SGLang {version}")
    for name, value in out.items():
        gone = data["values_removed"].get(name)
        if gone is None or value is None:
            continue
        for item in value if isinstance(value, list | tuple) else [value]:
            removed_in = gone["values"].get(str(item))
            if removed_in is not None and _key(version) >= _key(removed_in):
                raise ConfigError(f"{_ours(origin.get(name, name))} {item}: SGLang {removed_in} removed the value "
                                  f"{item} of {_flag(name)}; SGLang {version} takes {', '.join(gone['choices'])}")
    return out, notes


def older_name_hint(name: str) -> str | None:
    """For an error about an unknown SGLang flag: what the diff says of `name`, if anything."""
    data = changes()
    if name in data["renamed"]:
        entry = data["renamed"][name]
        return f"SGLang {entry['removed_in']} renamed it {_flag(entry['to'])}{_shown(entry.get('value', True))}"
    for kind in ("removed", "ignored"):
        if name in data[kind]:
            return f"SGLang {data[kind][name]['removed_in']} removed it"
    return None
