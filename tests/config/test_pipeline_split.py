"""Megatron-LM's uneven pipeline split (config/pipeline.py): --decoder-first/last-pipeline-num-layers give the
first / last stage its count, the stages between share the rest evenly; a split that does not work is refused
before any process starts, naming the flags and the layer count."""

from __future__ import annotations

import pytest

from slime_rl.config import ConfigError, build_config
from slime_rl.config.pipeline import stage_first_layer, stage_layer_counts
from slime_rl.train import preflight


@pytest.mark.parametrize("layers, pp, first, last, want", [
    (24, 4, None, None, (6, 6, 6, 6)),
    (4, 2, 1, None, (1, 3)),
    (4, 2, None, 1, (3, 1)),
    (4, 2, 3, 1, (3, 1)),
    (10, 3, 2, None, (2, 4, 4)),
    (61, 4, None, 13, (16, 16, 16, 13)),  # 48 layers over the 3 stages before the last
    (94, 8, 11, 11, (11, 12, 12, 12, 12, 12, 12, 11)),  # 72 over 6
])
def test_counts_by_hand(layers, pp, first, last, want):
    counts = stage_layer_counts(layers, pp, first, last)
    assert counts == want and sum(counts) == layers
    assert [stage_first_layer(counts, k) for k in range(pp)] == [sum(want[:k]) for k in range(pp)]


@pytest.mark.parametrize("layers, pp, first, last, message", [
    (4, 2, 1, 1, "must add up to num_hidden_layers=4"),
    (9, 3, 2, None, "7 layers --decoder-first-pipeline-num-layers 2 leave for 2 pipeline stage(s)"),
    (10, 4, None, None, "10 layers are for 4 pipeline stage(s)"),
    (47, 2, None, None, "47 layers are for 2 pipeline stage(s), which must share them evenly "
                        "(--pipeline-model-parallel-size 2); Megatron-LM refuses this split too"),
    (4, 1, 2, None, "--decoder-first-pipeline-num-layers needs --pipeline-model-parallel-size > 1"),
    (4, 2, 0, None, "a stage needs at least 1 layer"),
    (4, 3, 3, None, "1 layers --decoder-first-pipeline-num-layers 3 leave for 2 pipeline stage(s)"),
])
def test_splits_that_do_not_work_are_named(layers, pp, first, last, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        stage_layer_counts(layers, pp, first, last)


def test_preflight_refuses_a_split_of_the_checkpoints_layers(tiny_qwen2, tmp_path):
    (tmp_path / "d.jsonl").write_text('{"input": "1", "label": "1"}\n')
    argv = ["--hf-checkpoint", str(tiny_qwen2), "--prompt-data", str(tmp_path / "d.jsonl"), "--rm-type", "digit",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1",
            "--pipeline-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"]
    with pytest.raises(ConfigError, match=r"num_hidden_layers=2: 0 layers --decoder-first-pipeline-num-layers 2 "
                                          r"leave for 1 pipeline stage"):
        preflight(build_config(argv + ["--decoder-first-pipeline-num-layers", "2", "--dry-run"]))
    cfg, _ = preflight(build_config(argv + ["--decoder-first-pipeline-num-layers", "1", "--dry-run"]))
    assert cfg.parallel.stage_layers(2) == (1, 1)
