"""tools/sglang_flag_changes.py: the diff of SGLang parsers, on made-up versions whose answers are
worked out by hand, and the dump of a real parser (the installed SGLang) read the tool's way."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tools.sglang_flag_changes import diff, main

ROOT = Path(__file__).resolve().parents[2]


def _version(version: str, options: dict[str, tuple]) -> dict:
    """A dump: {name: (dest, kind, action class, choices, help, new_flag, const_value)}, shorter tuples
    filled with a plain store action."""
    table, actions = {}, {}
    for name, spec in options.items():
        dest, kind, action, choices, help_, new_flag, const = (*spec, *(None,) * (7 - len(spec)))
        table[name] = [dest, kind]
        actions[name] = {"action": action or "_StoreAction", "choices": choices, "help": help_,
                         "new_flag": new_flag, "const_value": const}
    return {"version": version, "table": {"program": f"sglang {version}", "fields": [], "options": table},
            "actions": actions}


OLD = _version("1.0", {
    "bs": ("bs_decode", "list", "DeprecatedAliasStoreAction", None, "Deprecated alias", "--bs-decode"),
    "bs_decode": ("bs_decode", "list"),
    "no_graph": ("backend", "flag", "DeprecatedStoreConstAction", None, "alias", "--backend=off", "off"),
    "old_graph": ("backend", "flag", "DeprecatedStoreConstAction", None, "alias", "--backend=piece", "piece"),
    "backend": ("backend", "value", None, ["full", "off", "piece"]),
    "mode": ("mode", "value", "DeprecatedAliasStoreAction", ["a-split", "b-split"],
             "Use --strategy. 'a-split' maps to 'zig'; 'b-split' maps to 'zag'.", "--strategy"),
    "strategy": ("strategy", "value", None, ["zag", "zig"]),
    "rejoin": ("rejoin", "flag", "_StoreTrueAction"),
    "join_mode": ("join_mode", "value", None, ["recover", "scale"]),
    "metrics": ("metrics", "flag", "_StoreTrueAction"),
    "report": ("report", "value", None, ["off", "log"]),
    "alias_of_gone": ("compiler", "value", "DeprecatedAliasStoreAction", None, "alias", "--compiler"),
    "compiler": ("compiler", "value"),
    "noop": ("noop", "flag", "DeprecatedAction", None, "Deprecated: does nothing."),
    "torchao": ("torchao", "value", None, None, "Optimize with torchao."),
    "same_dest_old": ("speed", "value"),
    "quant": ("quant", "value", None, ["fp8", "marlin"]),
})
MIDDLE = _version("1.1", {**{k: (v[0], v[1], OLD["actions"][k]["action"], OLD["actions"][k]["choices"],
                                 OLD["actions"][k]["help"], OLD["actions"][k]["new_flag"],
                                 OLD["actions"][k]["const_value"]) for k, v in OLD["table"]["options"].items()
                              if k != "torchao"},
                           "rejoin": ("rejoin", "flag", "_StoreTrueAction", None, "[Deprecated] Alias for --join-mode "
                                      "recover."),
                           "metrics": ("metrics", "flag", "DeprecatedAction", None, "Removed. Use --report with one "
                                       "of: off, log."),
                           "backend": ("backend", "value", None, ["full", "off"])})
NEW = _version("1.2", {
    "bs_decode": ("bs_decode", "list"),
    "backend": ("backend", "value", None, ["full", "off"]),
    "strategy": ("strategy", "value", None, ["zag", "zig"]),
    "join_mode": ("join_mode", "value", None, ["recover", "scale"]),
    "report": ("report", "value", None, ["off", "log"]),
    "speed_now": ("speed", "value"),
    "quant": ("quant", "value", None, ["fp8"]),
})


def test_renames_by_alias_constant_note_and_dest():
    out = diff([OLD, MIDDLE, NEW])
    assert (out["old"], out["new"], out["versions"]) == ("1.0", "1.2", ["1.0", "1.1", "1.2"])
    r = out["renamed"]
    assert sorted(r) == ["bs", "mode", "no_graph", "rejoin", "same_dest_old"]
    assert (r["bs"]["to"], r["bs"]["by"], r["bs"]["kind"], r["bs"]["removed_in"]) == ("bs_decode", "new_flag", "list",
                                                                                       "1.2")
    assert (r["no_graph"]["to"], r["no_graph"]["value"], r["no_graph"]["old_kind"]) == ("backend", "off", "flag")
    assert r["mode"]["values"] == {"a-split": "zig", "b-split": "zag"} and r["mode"]["choices"] == ["zag", "zig"]
    # the deprecation note of the last release that had it: "Alias for --join-mode recover."
    assert (r["rejoin"]["to"], r["rejoin"]["by"], r["rejoin"]["value"]) == ("join_mode", "help", "recover")
    assert (r["same_dest_old"]["to"], r["same_dest_old"]["by"]) == ("speed_now", "dest")


def test_removed_ignored_and_values_removed():
    out = diff([OLD, MIDDLE, NEW])
    removed = out["removed"]
    assert sorted(removed) == ["alias_of_gone", "compiler", "metrics", "old_graph", "torchao"]
    assert (removed["torchao"]["removed_in"], removed["torchao"]["last"]) == ("1.1", "1.0")
    assert removed["torchao"]["sglang_help"] == "Optimize with torchao."
    assert "removed --compiler too" in removed["alias_of_gone"]["why"]
    # the constant it stood for is a value the new flag no longer takes (gone in 1.1)
    assert removed["old_graph"]["successor"] == "--backend piece" and "1.1 took the value piece" in \
        removed["old_graph"]["why"]
    # the note names a flag with values but no value: not guessed
    assert removed["metrics"]["successor"] == "--report" and "does not give" in removed["metrics"]["why"]
    assert list(out["ignored"]) == ["noop"]  # a DeprecatedAction in the old version already did nothing
    assert out["values_removed"] == {"backend": {"values": {"piece": "1.1"}, "choices": ["full", "off"]},
                                     "quant": {"values": {"marlin": "1.2"}, "choices": ["fp8"]}}


def test_the_dump_of_the_installed_sglang_is_its_snapshot(tmp_path, capsys):
    """The tool reads a version in a subprocess by its own parser; the installed SGLang, given twice, has
    no changes and its table is the checked-in snapshot (written by tools/snapshot_cli_args.py)."""
    sglang = pytest.importorskip("sglang.version", reason="sglang is not installed (pip install --no-deps sglang)")
    if sglang.__version__ != "0.5.23":
        pytest.skip(f"sglang {sglang.__version__} is installed; the snapshot is 0.5.23's")
    site = str(Path(sys.modules["sglang"].__file__).parents[1])
    out = tmp_path / "changes.json"
    assert main([site, site, "--out", str(out), "--tables", str(tmp_path)]) == 0
    result = json.loads(out.read_text())
    assert (result["renamed"], result["removed"], result["ignored"]) == ({}, {}, {})
    snapshot = ROOT / "slime_rl" / "engines" / "sglang_server_args.json"
    assert (tmp_path / "sglang_server_args_0.5.23.json").read_text() == snapshot.read_text()
