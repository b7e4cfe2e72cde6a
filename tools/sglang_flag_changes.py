"""SGLang server flags that an older SGLang took and a newer one does not: renamed, removed, ignored.

    pip download --no-deps -d /tmp/sgl sglang==0.5.15 sglang==0.5.16 ... sglang==0.5.23
    python tools/sglang_flag_changes.py /tmp/sgl/sglang-0.5.15-*.whl ... /tmp/sgl/sglang-0.5.23-*.whl

The first version is the old one (what slime's scripts were written for), the last the new one (what
this project runs); versions in between say in which release a flag went. Each version's flags come
from its own parser: the wheel (or a folder holding `sglang/`) is put first on sys.path of a
subprocess that builds `ServerArgs.add_cli_args` (older releases register transformers configs
that a newer transformers already has; the subprocess lets those registrations overwrite). The
result, written to slime_rl/config/sglang_flag_changes.json (`--out`), is a diff of the parsers:

- renamed: an option string of the old version absent from the new one whose successor the old
  parsers name: SGLang's deprecated-alias actions (`new_flag`, a store-const's `const_value`), else
  the deprecation note of its help text in the last release that had it ("Alias for --x v", "Use
  --x=v"; a value only when the new flag takes it), else the option that stores into the same dest
  in the new version (`by` says which); with the value conversion when the shape changed (a switch
  that stored a constant becomes that value; choices mapped by the alias's own help text, "'X' maps
  to 'Y'").
- ignored: flags that already did nothing in the old version (SGLang's DeprecatedAction).
- removed: the rest, with the release that dropped it, the last release that had it and its help
  text there (SGLang's deprecation notes name what replaces a flag), and why its named successor
  does not count (itself removed, or a value the new flag refuses).
- values_removed: choices of an option both versions have that the new one refuses (each with the
  release that dropped it), and the new one's choices.

`--tables DIR` also writes each version's option table (the format of
slime_rl/engines/sglang_server_args.json) to DIR/sglang_server_args_<version>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "slime_rl" / "config" / "sglang_flag_changes.json"
SWITCHES = ("flag", "bool")
_MAPS_TO = re.compile(r"'([^']+)' maps to '([^']+)'")
# a deprecation note's successor: "Alias for --x-y recover.", "Use --x-y=cuda_ipc for ...", "Use --x-y instead."
_NOTE = re.compile(r"(?:Alias for|Use) (--[a-z0-9-]+)(?:[ =]([A-Za-z0-9_.-]+))?")


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def dump(out: str) -> None:
    """(In the subprocess.) The importable SGLang's server flags, with what the diff reads of each action."""
    import warnings

    warnings.filterwarnings("ignore")
    import transformers

    register = transformers.AutoConfig.register
    transformers.AutoConfig.register = staticmethod(lambda *a, **k: register(*a, **{**k, "exist_ok": True}))
    from sglang.srt.server_args import ServerArgs
    from sglang.version import __version__

    from slime_rl.engines.cli_args import _field_names, table_from_parser

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    table = table_from_parser(parser, f"sglang {__version__} (python -m sglang.launch_server)",
                              _field_names(ServerArgs))
    actions = {}
    for action in parser._actions:
        for opt in action.option_strings:
            if opt.startswith("--"):
                actions[opt[2:].replace("-", "_")] = {
                    "action": type(action).__name__, "choices": sorted(map(str, action.choices)) if action.choices
                    else None, "help": None if action.help == argparse.SUPPRESS else action.help,
                    "new_flag": getattr(action, "new_flag", None),
                    "const_value": _jsonable(getattr(action, "const_value", None))}
    Path(out).write_text(json.dumps({"version": __version__, "table": table.to_json(), "actions": actions}))


def read_version(source: Path, work: Path) -> dict[str, Any]:
    """One version's flags: `source` is a wheel or a folder holding sglang/."""
    if source.suffix == ".whl":
        folder = work / source.stem
        with zipfile.ZipFile(source) as whl:
            whl.extractall(folder, [n for n in whl.namelist() if n.startswith("sglang/")])
        source = folder
    out = work / f"{source.name}.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(source), str(ROOT)]))
    subprocess.run([sys.executable, __file__, "--dump", str(out)], env=env, check=True, cwd=work)
    return json.loads(out.read_text())


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version))


def diff(versions: list[dict[str, Any]]) -> dict[str, Any]:
    """The changes from versions[0] to versions[-1] (each a `dump`; ordered by release)."""
    names = [v["version"] for v in versions]
    old, new = versions[0], versions[-1]
    new_opts = new["table"]["options"]

    def having(name: str) -> list[int]:
        return [i for i, v in enumerate(versions) if name in v["table"]["options"]]

    def last_had(name: str) -> dict[str, Any]:
        return versions[having(name)[-1]]

    def first_without(name: str) -> str:
        return names[having(name)[-1] + 1]

    def choices(name: str) -> list[str] | None:
        return new["actions"][name]["choices"]

    def by_dest(dest: str) -> str | None:  # the new version's own option of a dest (no deprecated alias)
        found = [n for n, (d, _) in new_opts.items() if d == dest and "Deprecated" not in new["actions"][n]["action"]]
        return min(found, key=len) if found else None

    def value_map(version: dict[str, Any], dest: str) -> dict[str, str]:
        out: dict[str, str] = {}
        for n, (d, _) in version["table"]["options"].items():
            if d == dest:
                out |= dict(_MAPS_TO.findall(version["actions"][n]["help"] or ""))
        return out

    renamed, removed, ignored = {}, {}, {}
    for name in sorted(set(old["table"]["options"]) - set(new_opts)):
        last = last_had(name)
        dest, old_kind = last["table"]["options"][name]
        act = last["actions"][name]
        record: dict[str, Any] = {"removed_in": first_without(name), "last": last["version"],
                                  "sglang_help": act["help"]}
        if old["actions"][name]["action"] == "DeprecatedAction":  # parsed and dropped already in the old version
            ignored[name] = record
            continue
        flag, _, const = (act["new_flag"] or "").partition("=")
        by = "new_flag" if flag else None
        value = const or (act["const_value"] if act["action"] == "DeprecatedStoreConstAction" else None)
        note = _NOTE.search(act["help"] or "") if re.search(r"deprecated|removed", act["help"] or "", re.I) else None
        if not flag and note:
            flag, by = note.group(1), "help"
            named = (note.group(2) or "").rstrip(".") or None  # "... join-mode recover." ends the sentence
            if named is not None and named in (new["actions"].get(flag[2:].replace("-", "_"), {}).get("choices") or []):
                value = named
        target = flag[2:].replace("-", "_") if flag else by_dest(dest)
        if target is None:
            removed[name] = record
            continue
        by = by or "dest"
        where = f"--{target.replace('_', '-')}" + (f" {value}" if value is not None else "")
        if target not in new_opts:
            removed[name] = record | {"successor": where,
                                      "why": f"SGLang {first_without(target)} removed --{target.replace('_', '-')} "
                                             "too"}
            continue
        kind = new_opts[target][1]
        entry = {"to": target, "kind": kind, "old_kind": old_kind, "by": by,
                 "to_since": names[having(target)[0]]} | record
        if value is not None:  # a switch that stored a constant: the new flag with that value
            if choices(target) and str(value) not in choices(target):
                gone = [names[i] for i in range(len(versions)) if target in versions[i]["actions"]
                        and value not in (versions[i]["actions"][target]["choices"] or [value])]
                removed[name] = record | {"successor": where, "why": f"SGLang {gone[0]} took the value {value} from "
                                          f"--{target.replace('_', '-')} (it takes {', '.join(choices(target))})"}
                continue
            entry["value"] = value
        elif (old_kind in SWITCHES) != (kind in SWITCHES):  # SGLang names the successor but not the value
            removed[name] = record | {"successor": where, "why": f"a switch, and --{target.replace('_', '-')} takes a "
                                      "value that SGLang's note does not give"}
            continue
        if old_kind not in SWITCHES:
            mapped = value_map(last, dest)
            old_choices = act["choices"] or []
            if choices(target) and old_choices:
                if any(mapped.get(c, c) != c for c in old_choices):
                    entry["values"] = {c: mapped.get(c, c) for c in old_choices if mapped.get(c, c) != c}
                lost = [c for c in old_choices if mapped.get(c, c) not in choices(target)]
                if lost:
                    entry["values_refused"] = lost
            if choices(target):
                entry["choices"] = choices(target)
        renamed[name] = entry
    values_removed: dict[str, dict[str, Any]] = {}
    for name in sorted(set(old["table"]["options"]) & set(new_opts)):
        before, after = old["actions"][name]["choices"], choices(name)
        if before and after and set(before) - set(after):
            gone = {}
            for value in sorted(set(before) - set(after)):
                last = max(i for i, v in enumerate(versions) if name in v["actions"]
                           and value in (v["actions"][name]["choices"] or []))
                gone[value] = names[last + 1]
            values_removed[name] = {"values": gone, "choices": after}
    return {"about": f"SGLang server flags of {names[0]} that {names[-1]} does not take, from the parsers of "
                     f"{', '.join(names)} (tools/sglang_flag_changes.py); option names with underscores",
            "old": names[0], "new": names[-1], "versions": names,
            "renamed": renamed, "ignored": ignored, "removed": removed, "values_removed": values_removed}


def _table_text(table: dict[str, Any]) -> str:
    sys.path.insert(0, str(ROOT / "tools"))
    from snapshot_cli_args import _compact

    return _compact(table)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sources", nargs="*", help="wheels or folders holding sglang/, oldest first (at least two)")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--tables", default=None, help="also write each version's option table here")
    p.add_argument("--dump", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.dump:
        dump(a.dump)
        return 0
    if len(a.sources) < 2:
        p.error("give at least two versions, oldest first")
    with tempfile.TemporaryDirectory() as work:
        read: dict[Path, dict] = {}  # a source given twice is read once (each read starts SGLang's parser)
        sources = [Path(s).resolve() for s in a.sources]
        for source in sources:
            if source not in read:
                read[source] = read_version(source, Path(work))
        versions = [read[source] for source in sources]
    versions.sort(key=lambda v: _key(v["version"]))
    result = diff(versions)
    Path(a.out).write_text(json.dumps(result, indent=1, sort_keys=False) + "\n")
    print(f"{a.out}: {len(result['renamed'])} renamed, {len(result['removed'])} removed, "
          f"{len(result['ignored'])} ignored, values removed from {len(result['values_removed'])} flags "
          f"({result['old']} -> {result['new']})")
    if a.tables:
        Path(a.tables).mkdir(parents=True, exist_ok=True)
        for v in versions:
            path = Path(a.tables) / f"sglang_server_args_{v['version']}.json"
            path.write_text(_table_text(v["table"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
