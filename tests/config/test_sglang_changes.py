"""`--sglang-*` flags under SGLang 0.5.15's names (config/sglang_changes.py): renamed ones go on under
SGLang 0.5.23's name with one note each, the built-in engine takes a renamed flag it takes under the
new name, removed flags and values are refused naming the release. The names on each side are SGLang's,
read in its 0.5.15 and 0.5.23 server_args.py (tests/contract/test_sglang_flag_changes.py checks them
against both parsers)."""

from __future__ import annotations

import shlex
import warnings
from pathlib import Path

import pytest

from slime_rl.config import ConfigError, build_config
from slime_rl.config.builtin_engine import from_sglang_args, parse_server_args
from slime_rl.config.checks import ConfigNote
from slime_rl.config.sglang_changes import changes, modernize
from slime_rl.train import main as train_main


def base_argv(tmp_path, *extra: str) -> list[str]:
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "data.jsonl").write_text('{"input": "x", "label": "1"}\n')
    return ["--hf-checkpoint", str(tmp_path / "model"), "--prompt-data", str(tmp_path / "data.jsonl"),
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "3", "--rm-type", "digit",
            *extra]


def _built(argv: list[str]):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cfg = build_config(argv)
    return cfg, [str(w.message) for w in seen if issubclass(w.category, ConfigNote)]


def test_each_renamed_flag_is_passed_on_under_its_new_name_with_one_note(tmp_path):
    cfg, notes = _built(base_argv(tmp_path, "--rollout-backend", "sglang", "--sglang-cuda-graph-bs", "1", "2",
                                  "--sglang-nsa-prefill-backend", "fa3", "--sglang-disable-piecewise-cuda-graph",
                                  "--sglang-mem-fraction-static", "0.7"))
    assert cfg.engine.sglang_args == {"cuda_graph_bs_decode": ["1", "2"], "dsa_prefill_backend": "fa3",
                                      "cuda_graph_backend_prefill": "disabled", "mem_fraction_static": "0.7"}
    renames = [n for n in notes if "removed --" in n]
    assert len(renames) == 3
    assert ("--sglang-cuda-graph-bs: SGLang 0.5.20 removed --cuda-graph-bs (0.5.15 took it); passed as "
            "--sglang-cuda-graph-bs-decode 1 2, its name in SGLang 0.5.23") in renames
    assert any(n.startswith("--sglang-disable-piecewise-cuda-graph:") and
               "--sglang-cuda-graph-backend-prefill disabled" in n for n in renames)


def test_a_mapped_choice_says_what_it_was(tmp_path):
    cfg, notes = _built(base_argv(tmp_path, "--rollout-backend", "sglang", "--sglang-prefill-cp-mode", "in-seq-split"))
    assert cfg.engine.sglang_args == {"cp_strategy": "zigzag"}
    assert any("--sglang-cp-strategy zigzag (SGLang's new name for in-seq-split)" in n for n in notes)


def test_the_built_in_engine_takes_an_old_name_as_it_takes_the_new_one(tmp_path):
    """--cuda-graph-max-bs is the built-in engine's setting cuda_graph_max_bs under SGLang 0.5.23's name
    --cuda-graph-max-bs-decode: the old name neither chooses SGLang nor is refused by the built-in engine."""
    old, notes = _built(base_argv(tmp_path, "--sglang-cuda-graph-max-bs", "16"))
    new, _ = _built(base_argv(tmp_path, "--sglang-cuda-graph-max-bs-decode", "16"))
    assert old.engine.backend == new.engine.backend == "embedded"
    assert old.engine.sglang_args == new.engine.sglang_args == {"cuda_graph_max_bs_decode": "16"}
    assert from_sglang_args(old.engine.sglang_args) == {"cuda_graph_max_bs": 16}
    assert not any("--rollout-backend sglang" in n for n in notes)
    embedded, _ = _built(base_argv(tmp_path, "--rollout-backend", "embedded", "--sglang-cuda-graph-max-bs", "8"))
    assert from_sglang_args(embedded.engine.sglang_args) == {"cuda_graph_max_bs": 8}
    with pytest.raises(ConfigError, match="--sglang-cuda-graph-max-bs-decode 0: must be >= 1"), \
            pytest.warns(ConfigNote):
        build_config(base_argv(tmp_path, "--rollout-backend", "embedded", "--sglang-cuda-graph-max-bs", "0"))


def test_the_dry_run_prints_the_note_once_and_the_engine_reads_the_value(tiny_qwen2, tmp_path, capsys):
    from slime_rl.data.digits import make_rows, write_jsonl

    data = write_jsonl(make_rows(8, seed=0), tmp_path / "d.jsonl")
    code = train_main(["--hf-checkpoint", str(tiny_qwen2), "--prompt-data", str(data), "--rollout-batch-size", "2",
                       "--num-rollout", "1", "--rm-type", "digit", "--sglang-cuda-graph-max-bs", "16", "--dry-run"])
    captured = capsys.readouterr()
    assert code == 0
    lines = [ln for ln in captured.err.splitlines()
             if ln.startswith("slime-rl train: note: --sglang-cuda-graph-max-bs:")]
    assert len(lines) == 1 and "passed as --sglang-cuda-graph-max-bs-decode 16" in lines[0]
    (line,) = [ln for ln in captured.out.splitlines() if ln.startswith("engine 0:")]
    argv = shlex.split(line)[2:]
    assert parse_server_args(argv[argv.index("-m") + 2:]).cuda_graph_max_bs == 16


def test_the_yaml_file_and_the_command_line_are_renamed_apart(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("rollout-backend: sglang\nsglang_cuda_graph_max_bs: 8\nsglang_stream_output: false\n")
    cfg, notes = _built(base_argv(tmp_path, "--config", str(cfg_file), "--sglang-cuda-graph-max-bs-decode", "16"))
    assert cfg.engine.sglang_args == {"cuda_graph_max_bs_decode": "16"}  # the command line wins, as for any flag
    assert any(n.startswith("--sglang-stream-output false: dropped") for n in notes)


@pytest.mark.parametrize(("extra", "refusal"), [
    (["--sglang-torchao-config", "int8wo"],
     "--sglang-torchao-config: SGLang 0.5.18 removed --torchao-config (SGLang 0.5.17 was the last to take it)"),
    (["--sglang-enable-expert-distribution-metrics"], "Use --expert-balancedness-report-mode"),
    (["--sglang-piecewise-cuda-graph-compiler", "inductor"], "removed --cuda-graph-tc-compiler too"),
    (["--sglang-kv-cache-dtype", "fp4_e2m1"], "SGLang 0.5.21 removed the value fp4_e2m1 of --kv-cache-dtype"),
    (["--sglang-mamba-scheduler-strategy", "fastest"], "renamed --mamba-scheduler-strategy to "
     "--mamba-radix-cache-strategy, which takes auto, extra_buffer"),
    (["--sglang-disable-piecewise-cuda-graph", "--sglang-cuda-graph-backend-prefill", "full"], "disagree: give one"),
    (["--sglang-stream-output", "3"], "--sglang-stream-output: a switch"),
])
def test_refusals_name_the_flag_and_the_release(tmp_path, extra, refusal):
    with pytest.raises(ConfigError, match=refusal.replace("(", r"\(").replace(")", r"\)")):
        build_config(base_argv(tmp_path, "--rollout-backend", "sglang", *extra))


def test_flags_dropped_before_0_5_15_ended_did_nothing_there():
    args, notes = modernize({"collect_tokens_histogram": True, "dp_size": "2"}, version="0.5.23")
    assert args == {"dp_size": "2"} and len(notes) == 1 and "dropped" in notes[0]


def test_an_older_installed_sglang_keeps_the_names_it_still_has():
    # SGLang 0.5.19 still took --cuda-graph-bs; 0.5.22 still took --speculative-skip-dp-mlp-sync
    assert modernize({"cuda_graph_bs": ["1"]}, version="0.5.19") == ({"cuda_graph_bs": ["1"]}, [])
    assert modernize({"speculative_skip_dp_mlp_sync": True}, version="0.5.22") == (
        {"speculative_skip_dp_mlp_sync": True}, [])
    with pytest.raises(ConfigError, match="SGLang 0.5.23 removed --speculative-skip-dp-mlp-sync"):
        modernize({"speculative_skip_dp_mlp_sync": True}, version="0.5.23")


def test_docs_migration_lists_every_flag_of_the_diff():
    text = (Path(__file__).resolve().parents[2] / "docs" / "migration.md").read_text()
    data = changes()
    names = [*data["renamed"], *data["removed"], *data["ignored"]]
    missing = [n for n in names if f"`--{n.replace('_', '-')}" not in text]
    assert not missing, missing
