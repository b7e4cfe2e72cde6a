"""--seed and --rollout-seed reach every rollout-side random choice (config/seeds.py): the formulas
checked by hand, and each place that draws from them (prompt order, request seeds, engine seed)."""

from __future__ import annotations

import random

from slime_rl.config import DataConfig, build_config
from slime_rl.config.seeds import SEED_MODULUS, data_order_seed, engine_seed, run_seed, sampling_seed
from slime_rl.data import PromptDataset, Sample, write_records
from slime_rl.rollout.routing import ClientPool
from tests.config.test_config import base_argv


class CharTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_formulas_by_hand():
    assert SEED_MODULUS == 2_147_483_647
    assert run_seed(0, 5) == 5
    assert run_seed(7, 42) == 7_000_273  # 7 * 1_000_033 + 42
    assert run_seed(1234, 42) == 1_234_040_764  # the defaults: 1_234_000_000 + 40_722 + 42
    assert sampling_seed(5, 2, 10) == 5_015_863  # 5 * 1_000_003 + 2 * 7919 + 10, below the modulus
    # 7_000_273 * 1_000_003 + 3 * 7919 + 5 = 7_000_294_024_581 = 3259 * 2_147_483_647 + 1_644_819_008
    assert sampling_seed(7_000_273, 3, 5) == 1_644_819_008
    assert sampling_seed(SEED_MODULUS, 0, 0) == 0
    assert engine_seed(5, 1) == 6 and engine_seed(SEED_MODULUS - 1, 1) == 0
    assert data_order_seed(5, 2) == 5_000_017


def test_either_flag_changes_the_run_seed_and_the_same_flags_repeat_it(tmp_path):
    def seeds(*extra):
        cfg = build_config(base_argv(tmp_path) + ["--deterministic-rollout", *extra])
        return cfg.data.seed, cfg.rollout.sample_seed

    default = seeds()
    assert default == (1_234_040_764, 1_234_040_764) == seeds()
    assert seeds("--seed", "7") == (7_000_273, 7_000_273)
    assert seeds("--rollout-seed", "7") == (1_234_040_729,) * 2  # 1234 * 1_000_033 + 7
    assert len({default, seeds("--seed", "7"), seeds("--seed", "2026"), seeds("--rollout-seed", "43")}) == 4
    assert build_config(base_argv(tmp_path)).rollout.sample_seed is None  # no per-request seed without the flag


def test_prompt_order_is_the_stated_permutation(tmp_path):
    f = write_records([{"input": str(i), "label": i} for i in range(20)], tmp_path / "d.jsonl")

    def order(seed: int, epochs: int = 2) -> list[int]:
        ds = PromptDataset(DataConfig(prompt_data=str(f), rollout_shuffle=True, seed=seed), CharTokenizer())
        return [r.label for r in ds.next_batch(20 * epochs)]

    def stated(seed: int, epoch: int) -> list[int]:  # the docstring's formula, with Python's own shuffle
        order = list(range(20))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        return order

    assert order(11) == stated(11, 0) + stated(11, 1) == order(11)
    assert order(11)[:20] != order(12)[:20]


def test_request_seed_is_the_stated_function_of_the_sample(tmp_path):
    pool = ClientPool([object()], tokenizer=None, sample_seed=7_000_273)
    sample = Sample(index=3, group_index=0, prompt="", prompt_ids=[1, 2])
    assert pool.seeded(sample, [1, 2, 3, 4, 5], {"temperature": 1.0}) == {"temperature": 1.0,
                                                                          "sampling_seed": 1_644_819_008}
    assert ClientPool([object()], tokenizer=None).seeded(sample, [1], {"t": 1}) == {"t": 1}  # no seed without the flag


def test_engine_seed_follows_both_flags(tmp_path):
    from slime_rl.config.builtin_engine import parse_server_args
    from slime_rl.orchestration.engines import engine_command
    from slime_rl.orchestration.placement import plan_placement

    def random_seeds(*extra):
        cfg = build_config(base_argv(tmp_path) + ["--rollout-num-gpus", "2", *extra])
        plan = plan_placement(cfg.parallel, cfg.engine, cluster_gpus=0, cluster_cpus=4)
        out = []
        for slot in plan.engines:
            argv = engine_command(cfg, slot, host="h", port=1, api_key=None, use_gpu=False)
            out.append(parse_server_args(argv[3:]).random_seed)
        return out

    assert random_seeds() == [1_234_040_764, 1_234_040_765]
    assert random_seeds("--seed", "7") == [7_000_273, 7_000_274]
    assert random_seeds("--rollout-seed", "43") == [1_234_040_765, 1_234_040_766]


def test_embedded_engine_deterministic_inference_from_either_flag(tmp_path):
    """--deterministic-rollout starts the built-in engine with --enable-deterministic-inference (its
    per-request seeds need it); SGLang's own switch passed through does too, without seeding requests."""
    from slime_rl.config.builtin_engine import parse_server_args
    from slime_rl.orchestration.engines import engine_command
    from slime_rl.orchestration.placement import plan_placement

    def started(*extra):
        cfg = build_config(base_argv(tmp_path) + list(extra))
        plan = plan_placement(cfg.parallel, cfg.engine, cluster_gpus=0, cluster_cpus=4)
        argv = engine_command(cfg, plan.engines[0], host="h", port=1, api_key=None, use_gpu=False)
        return parse_server_args(argv[3:]).enable_deterministic_inference, cfg.rollout.sample_seed

    assert started() == (False, None)
    assert started("--deterministic-rollout")[0] is True
    assert started("--deterministic-rollout")[1] is not None
    assert started("--sglang-enable-deterministic-inference") == (True, None)
