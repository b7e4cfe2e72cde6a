"""slime's `--sglang-*` flags of SGLang 0.5.15 against SGLang's own parsers: 0.5.15's (its option table,
written from its parser by `tools/sglang_flag_changes.py --tables`, checked in next to this file) and
0.5.23's, installed. Each case says where 0.5.15 stored the value (its parser's dest) and what 0.5.23's
parser makes of the argv slime-rl passes on; the expected settings were read in the two versions'
server_args.py, not taken from config/sglang_flag_changes.json."""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import pytest

from slime_rl.config import ConfigError, build_config
from slime_rl.config.checks import ConfigNote
from slime_rl.config.sglang_changes import changes
from slime_rl.engines.cli_args import CliTable
from slime_rl.engines.launch import check_engine_config, sglang_extra_args
from tests.config.test_sglang_changes import base_argv

server_args = pytest.importorskip("sglang.srt.server_args",
                                  reason="sglang 0.5.23 is not importable here (pip install --no-deps sglang)")

HERE = Path(__file__).parent
OLD = CliTable.from_json(json.loads((HERE / "sglang_server_args_0.5.15.json").read_text()),
                         "sglang_server_args_0.5.15.json")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    server_args.ServerArgs.add_cli_args(p)
    return p


NEW_OPTIONS = {o[2:].replace("-", "_") for a in _parser()._actions for o in a.option_strings if o.startswith("--")}


def _argv(tmp_path, *extra: str) -> list[str]:
    return base_argv(tmp_path, "--rollout-backend", "sglang", *extra)


def _engine_argv(tmp_path, *extra: str) -> tuple[list[str], list[str]]:
    """(SGLang's argv for the run's --sglang-* flags, the notes the run printed)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cfg = build_config(_argv(tmp_path, *extra))
    notes = [str(w.message) for w in seen if issubclass(w.category, ConfigNote)]
    return sglang_extra_args(check_engine_config(cfg.engine).sglang_args), notes


def test_the_diff_is_between_the_versions_it_names():
    import sglang.version

    assert OLD.program.startswith("sglang 0.5.15 ")
    assert (changes()["old"], changes()["new"]) == ("0.5.15", sglang.version.__version__)


def test_every_flag_0_5_15_had_and_0_5_23_lacks_is_renamed_removed_or_ignored():
    data = changes()
    assert set(OLD.options) - NEW_OPTIONS == set(data["renamed"]) | set(data["removed"]) | set(data["ignored"])
    assert {e["to"] for e in data["renamed"].values()} <= NEW_OPTIONS


# (slime's flag and value, where 0.5.15 stored it, the setting 0.5.23's parser gives for the passed-on argv)
SCRIPT_FLAGS = [
    (["--sglang-cuda-graph-bs", "1", "2", "4"], "cuda_graph_bs_decode", ("cuda_graph_bs_decode", [1, 2, 4])),
    (["--sglang-cuda-graph-max-bs", "8"], "cuda_graph_max_bs_decode", ("cuda_graph_max_bs_decode", 8)),
    (["--sglang-nsa-prefill-backend", "flashmla_sparse"], "dsa_prefill_backend",
     ("dsa_prefill_backend", "flashmla_sparse")),
    (["--sglang-nsa-decode-backend", "flashmla_kv"], "dsa_decode_backend", ("dsa_decode_backend", "flashmla_kv")),
    (["--sglang-mamba-scheduler-strategy", "extra_buffer"], "mamba_radix_cache_strategy",
     ("mamba_radix_cache_strategy", "extra_buffer")),
    # 0.5.15: DeprecatedStoreConstAction, const_value Backend.DISABLED, "Deprecated alias for
    # --cuda-graph-backend-prefill=disabled."
    (["--sglang-disable-piecewise-cuda-graph"], "cuda_graph_backend_prefill",
     ("cuda_graph_backend_prefill", "disabled")),
    # 0.5.15: "[Deprecated] Use --enable-prefill-cp instead."
    (["--sglang-enable-nsa-prefill-context-parallel"], "enable_dsa_prefill_context_parallel",
     ("enable_prefill_cp", True)),
    # 0.5.19's --cp-strategy help: "'interleave' is the former round-robin-split mode"
    (["--sglang-nsa-prefill-cp-mode", "round-robin-split"], "dsa_prefill_cp_mode", ("cp_strategy", "interleave")),
]


@pytest.mark.parametrize(("flag", "old_dest", "setting"), SCRIPT_FLAGS, ids=[c[0][0] for c in SCRIPT_FLAGS])
def test_an_old_name_reaches_the_same_setting_of_0_5_23(tmp_path, flag, old_dest, setting):
    old = flag[0][len("--sglang-"):].replace("-", "_")
    assert OLD.options[old].dest == old_dest and old not in NEW_OPTIONS
    argv, notes = _engine_argv(tmp_path, *flag)
    ns = _parser().parse_args(["--model-path", "/m", *argv])
    assert getattr(ns, setting[0]) == setting[1]
    assert len([n for n in notes if n.startswith(flag[0] + ":")]) == 1  # said once


@pytest.mark.parametrize(("flag", "refusal"), [
    (["--sglang-torchao-config", "int8wo"], "SGLang 0.5.18 removed --torchao-config"),
    (["--sglang-attention-backend", "cutlass_mla"], "SGLang 0.5.20 removed the value cutlass_mla"),
    (["--sglang-enforce-piecewise-cuda-graph"], "SGLang 0.5.22 took the value tc_piecewise"),
])
def test_what_0_5_23_refuses_is_refused_before_the_run(tmp_path, flag, refusal):
    old = flag[0][len("--sglang-"):]
    assert old.replace("-", "_") in OLD.options  # 0.5.15 took it
    with pytest.raises((argparse.ArgumentError, SystemExit)):  # SGLang 0.5.23 itself would stop at its start
        _parser().parse_args(["--model-path", "/m", "--" + old, *flag[1:]])
    with pytest.raises(ConfigError, match=refusal):
        build_config(_argv(tmp_path, *flag))
