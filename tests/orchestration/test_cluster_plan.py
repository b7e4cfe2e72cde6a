"""`--dry-run --cluster NODESxGPUS`: node/GPU ids per trainer rank and engine, the rank layout against
Megatron's own rank generator, and the whole dry run of the 7B recipes and of slime's Qwen3-4B script
(its MODEL_ARGS included) from a folder that holds only config.json."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from slime_rl.config import EngineConfig, ParallelConfig, build_config
from slime_rl.orchestration.placement import PlacementError, assign_devices, plan_placement, rank_coords
from slime_rl.train import main as train_main

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = Path(__file__).parent / "hf_configs"


def config_only(tmp_path: Path, name: str) -> Path:
    """An HF folder holding only config.json (no weights, no tokenizer)."""
    folder = tmp_path / name.removesuffix(".json")
    folder.mkdir()
    shutil.copy(CONFIGS / name, folder / "config.json")
    return folder


def test_seven_b_layout_on_two_nodes():
    # configs/qwen2_5_7b_grpo_math.yaml: 8 trainer ranks, 4 engines of TP 2
    plan = plan_placement(ParallelConfig(4, 1, 1, 8), EngineConfig(num_gpus=8, num_gpus_per_engine=2), cluster_gpus=16)
    devices = assign_devices(plan, 2, 8)
    assert [(devices[b].node, devices[b].gpus) for b in plan.trainer_bundles] == [(0, (g,)) for g in range(8)]
    assert [(devices[e.bundles[0]].node, devices[e.bundles[0]].gpus) for e in plan.engines] == [
        (1, (0, 1)), (1, (2, 3)), (1, (4, 5)), (1, (6, 7))]


def test_engines_fill_the_gpus_left_on_a_node_then_the_next():
    plan = plan_placement(ParallelConfig(1, 1, 1, 4), EngineConfig(num_gpus=12, num_gpus_per_engine=4),
                          cluster_gpus=16)
    devices = assign_devices(plan, 2, 8)
    assert [str(devices[e.bundles[0]]) for e in plan.engines] == [
        "node 0 GPU 4,5,6,7", "node 1 GPU 0,1,2,3", "node 1 GPU 4,5,6,7"]


def test_colocated_engine_shares_its_trainer_rank_gpu():
    plan = plan_placement(ParallelConfig(2, 1, 1, 8), EngineConfig(num_gpus=8, colocate=True), cluster_gpus=8)
    devices = assign_devices(plan, 1, 8)
    assert all(devices[e.bundles[0]] == devices[plan.trainer_bundles[e.engine_id]] for e in plan.engines)


def test_engine_wider_than_a_node_is_refused_naming_the_flag():
    plan = plan_placement(ParallelConfig(1, 1, 1, 1), EngineConfig(num_gpus=8, num_gpus_per_engine=8), cluster_gpus=12)
    with pytest.raises(PlacementError, match=r"--cluster 3x4: engine 0 needs 8 GPUs of one node "
                                             r"\(--rollout-num-gpus-per-engine\)"):
        assign_devices(plan, 3, 4)


def test_rank_coords_match_megatron_rank_generator():
    from megatron.core.parallel_state import RankGenerator

    tp, cp, dp, pp = 2, 2, 2, 2
    par = ParallelConfig(tp, pp, 2, 8, cp)
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    for axis in ("tp", "cp", "dp", "pp"):
        others = [a for a in ("tp", "cp", "dp", "pp") if a != axis]
        for group in gen.get_ranks(axis):
            coords = [rank_coords(r, par) for r in group]
            # one group: same coordinates on the other axes, its own axis 0..size-1 in rank order
            assert all(all(c[a] == coords[0][a] for a in others) for c in coords), (axis, group)
            assert [c[axis] for c in coords] == list(range(len(group))), (axis, group)


def recipe_argv(recipe: str, hf: Path, *extra: str) -> list[str]:
    return ["--config", str(ROOT / "configs" / recipe), "--hf-checkpoint", str(hf),
            "--prompt-data", "/data/not-on-this-machine.jsonl", "--rollout-backend", "sglang", *extra]


@pytest.mark.parametrize("recipe", ["qwen2_5_7b_grpo_math.yaml", "qwen2_5_7b_dapo_math.yaml"])
def test_seven_b_recipes_plan_for_two_nodes_with_estimates(recipe, tmp_path, capsys):
    hf = config_only(tmp_path, "qwen2_5_7b_instruct.json")
    code = train_main(recipe_argv(recipe, hf, "--dry-run", "--cluster", "2x8"))
    out = capsys.readouterr().out
    assert code == 0, out
    assert "cluster: 2 node(s) x 8 GPUs (--cluster 2x8)" in out
    assert "trainer: 8 ranks, TP 4 x PP 1 x CP 1 x DP 2" in out
    assert "rank 7: node 0 GPU 7 | tp 3 pp 0 cp 0 dp 1" in out
    assert "engine 3: node 1 GPU 6,7" in out
    assert "qwen2, 7.616 B parameters" in out
    for part in ("weights", "grads", "optimizer", "activations", "logits", "total"):
        assert re.search(rf"^  {part} +\d+\.\d\d GiB", out, flags=re.MULTILINE), part
    # 7,615,616,512 bf16 parameters over the inter-node link at the default 50 GB/s, + 3.5 ms, after the
    # source rank gathered 3/4 of the TP-split weights from the other 3 TP ranks at 360 GB/s: per layer
    # q, o 3584^2 each, k, v 3584 x 512 each, their biases 3584 + 2 x 512, the MLP 3 x 3584 x 18944; 28
    # layers; embedding and LM head 152064 x 3584 each (norms are whole on every rank)
    split = 28 * (2 * 3584**2 + 2 * 3584 * 512 + 3584 + 2 * 512 + 3 * 3584 * 18944) + 2 * 152064 * 3584
    gathered = 2 * split * 3 / 4
    assert "weight sync: 15.23 GB of bf16 HF weights per sync, inter-node" in out
    assert f"first {gathered / 1e9:.2f} GB gathered from the other TP/EP ranks at 360 GB/s" in out
    assert f"-> {2 * 7_615_616_512 / 50e9 + gathered / 360e9 + 0.0035:.3f} s per sync" in out
    assert "not checked here (--cluster): --prompt-data /data/not-on-this-machine.jsonl" in out
    assert "the tokenizer of --hf-checkpoint" in out
    # commands a person can paste: the job's launch line (the flags given, less the plan's own), and each
    # engine on node 1 with its two GPUs, the cluster's python, the node's address and the run's secret
    flags = " ".join(recipe_argv(recipe, hf))
    assert f"launch: on the head first: MASTER_ADDR=<head ip> NODE_RANK=0 NNODES=2 NUM_GPUS=8 bash " \
           f"launch/ray_multi_node.sh {flags}; then on node i = 1..1: MASTER_ADDR=<head ip> NODE_RANK=i NUM_GPUS=8 " \
           f"bash launch/ray_multi_node.sh (or, under Slurm: sbatch --nodes=2 launch/slurm_example.sbatch {flags})\n" \
           in out
    for e in range(4):
        assert re.search(rf'^engine {e}: CUDA_VISIBLE_DEVICES={2 * e},{2 * e + 1} python -m sglang.launch_server '
                         rf'--model-path {hf} --host "\$\{{NODE1_IP\}}" --port {30000 + 10 * e} --tp-size 2 '
                         r'--base-gpu-id 0 .*--api-key "\$\{SLIME_RL_API_KEY\}"', out, re.M), out


def test_train_only_plans_no_engine(tmp_path, capsys):
    """--load-debug-rollout-data: the trainer's bundles only, no engine command, no weight-sync estimate."""
    hf = config_only(tmp_path, "qwen2_5_7b_instruct.json")
    code = train_main(recipe_argv("qwen2_5_7b_grpo_math.yaml", hf, "--dry-run", "--cluster", "2x8",
                                  "--load-debug-rollout-data", "/dumps/rollout_{rollout_id}.pt"))
    out = capsys.readouterr().out
    assert code == 0, out
    assert "placement (GPU bundles: 8)" in out and "trainer: 8 ranks, TP 4 x PP 1 x CP 1 x DP 2" in out
    assert "engines: none (train-only: each rollout is read from --load-debug-rollout-data " \
           "/dumps/rollout_{rollout_id}.pt)" in out
    assert "engine 0" not in out and "weight sync" not in out and "weight-update" not in out
    assert "trainer memory per GPU" in out  # the rest of the plan as before


def test_vl_recipe_counts_the_vision_tower(tmp_path, capsys):
    hf = config_only(tmp_path, "qwen2_5_vl_7b_instruct.json")
    code = train_main(recipe_argv("qwen2_5_vl_7b_geo3k_grpo.yaml", hf, "--dry-run", "--cluster", "1x8"))
    out = capsys.readouterr().out
    assert code == 0, out
    assert "qwen2_5_vl, 8.292 B parameters" in out and "vision tower" in out
    assert "intra-node: 360 GB/s (--plan-intra-node-gbps)" in out


@pytest.mark.parametrize("value", ["2x", "x8", "0x8", "2x0", "2by8", "-1x8"])
def test_bad_cluster_value_names_the_flag(value, tmp_path, capsys):
    hf = config_only(tmp_path, "qwen2_5_7b_instruct.json")
    assert train_main(recipe_argv("qwen2_5_7b_grpo_math.yaml", hf, "--dry-run", f"--cluster={value}")) == 2
    assert "--cluster" in capsys.readouterr().err


def test_cluster_needs_dry_run(tmp_path):
    hf = config_only(tmp_path, "qwen2_5_7b_instruct.json")
    with pytest.raises(ValueError, match="--cluster plans for another cluster and needs --dry-run"):
        build_config(recipe_argv("qwen2_5_7b_grpo_math.yaml", hf, "--cluster", "2x8"))


def test_config_only_folder_without_cluster_is_refused_naming_the_flag(tmp_path, capsys):
    """transformers builds an empty tokenizer from config.json alone; a real run must not start on it."""
    hf = config_only(tmp_path, "qwen2_5_7b_instruct.json")
    data = tmp_path / "d.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n')
    argv = recipe_argv("qwen2_5_7b_grpo_math.yaml", hf, "--dry-run")
    argv[argv.index("--prompt-data") + 1] = str(data)
    assert train_main(argv) == 2
    assert f"--hf-checkpoint {hf}: no tokenizer files there" in capsys.readouterr().err


# slime's scripts/run-qwen3-4B.sh (THUDM/slime 624b824a), its argument list as the script passes it to train.py:
# MODEL_ARGS (scripts/models/qwen3-4B.sh, compared with config.json here), then the script's own lists
SLIME_QWEN3_4B = """
--swiglu --num-layers 36 --hidden-size 2560 --ffn-hidden-size 9728 --num-attention-heads 32 --group-query-attention
--num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear --normalization RMSNorm
--norm-epsilon 1e-6 --rotary-base 1000000 --vocab-size 151936 --kv-channels 128 --qk-layernorm
--actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate
--ref-load /root/Qwen3-4B_torch_dist --load /root/Qwen3-4B_slime/ --save /root/Qwen3-4B_slime/ --save-interval 20
--prompt-data /root/dapo-math-17k/dapo-math-17k.jsonl --input-key prompt --label-key label --apply-chat-template
--rollout-shuffle --rm-type deepscaler --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8
--rollout-max-response-len 8192 --rollout-temperature 0.8 --global-batch-size 256 --balance-data
--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00
--eps-clip 0.2 --eps-clip-high 0.28
--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1 --context-parallel-size 1
--expert-model-parallel-size 1 --expert-tensor-parallel-size 1
--recompute-granularity full --recompute-method uniform --recompute-num-layers 1
--use-dynamic-batch-size --max-tokens-per-gpu 9216
--eval-interval 20 --eval-prompt-data aime /root/aime-2024/aime-2024.jsonl --n-samples-per-eval-prompt 16
--eval-max-response-len 16384 --eval-top-p 0.7
--rollout-num-gpus-per-engine 2 --sglang-mem-fraction-static 0.7
--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32
--attention-backend flash
""".split()


def _plan(argv: list[str], capsys) -> tuple[int, str, str]:
    code = train_main(argv)
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()[-1] if captured.err.strip() else ""
    assert "unrecognized arguments" not in err, err  # every flag of slime's list is known here
    return code, captured.out, err


def _assert_plan(out: str) -> None:
    assert "trainer: 8 ranks, TP 2 x PP 1 x CP 1 x DP 4" in out
    assert "qwen3, 4.022 B parameters" in out
    # 4,022,468,096 parameters: 2 bytes each with --bf16 (which the list does not give), else 4
    assert "trainer memory per GPU, estimated" in out
    assert re.search(r"weight sync: (8\.04 GB of bf16|16\.09 GB of fp32) HF weights per sync", out)


def test_slime_qwen3_4b_script_plans_as_slime_runs_it(tmp_path, capsys):
    hf = config_only(tmp_path, "qwen3_4b.json")
    argv = ["--hf-checkpoint", str(hf), *SLIME_QWEN3_4B, "--dry-run", "--cluster", "1x8"]
    code, out, err = _plan(argv, capsys)
    assert code == 0, err
    _assert_plan(out)
    assert "colocated" in out
    assert f"note: slime's MODEL_ARGS: 15 flags agree with {hf}'s config.json, from which the model is built\n" in out
    # --colocate, 4 SGLang engines of TP 2, engine e's TP rank i on trainer rank 2e+i's GPU
    assert "engines: 4 (sglang, TP 2, colocated)" in out
    for e in range(4):
        assert f"  engine {e}: node 0 GPU {2 * e},{2 * e + 1} | beside trainer ranks {2 * e}..{2 * e + 1}\n" in out
        assert re.search(rf"^engine {e}: CUDA_VISIBLE_DEVICES={2 * e},{2 * e + 1} \S*python -m sglang.launch_server "
                         r".* --tp-size 2 --base-gpu-id 0 ", out, re.M)


def test_user_modules_of_another_cluster_are_listed_not_refused(tmp_path, capsys, tiny_qwen2):
    """Planned with --cluster, a reward or generate module that is not on this machine at all (the user's tree
    on the cluster, as slime's retool and search-r1 scripts name theirs) is listed as not checked here; one that
    is here but imports something missing is still refused; without --cluster a missing module is refused."""
    hf = config_only(tmp_path, "qwen2_5_7b_instruct.json")
    absent = ["--custom-rm-path", "my_tree_only_there.reward:score",
              "--custom-generate-function-path", "my_tree_only_there.generate:generate"]
    code = train_main(recipe_argv("qwen2_5_7b_grpo_math.yaml", hf, "--dry-run", "--cluster", "2x8", *absent))
    out = capsys.readouterr().out
    assert code == 0, out
    for flag, path in (("--custom-rm-path", "my_tree_only_there.reward:score"),
                       ("--custom-generate-function-path", "my_tree_only_there.generate:generate")):
        assert f"not checked here (--cluster): {flag} '{path}' (module 'my_tree_only_there." in out, out
    broken = tmp_path / "broken_user_module.py"
    broken.write_text("import a_dependency_nobody_installed\n\nasync def generate(args, sample, params):\n    pass\n")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        code = train_main(recipe_argv("qwen2_5_7b_grpo_math.yaml", hf, "--dry-run", "--cluster", "2x8",
                                      "--custom-generate-function-path", "broken_user_module:generate"))
    finally:
        sys.path.remove(str(tmp_path))
    err = capsys.readouterr().err
    assert code == 2 and "No module named 'a_dependency_nobody_installed'" in err, err
    (tmp_path / "d.jsonl").write_text('{"input": "1", "label": "1"}\n')
    code = train_main(["--hf-checkpoint", str(tiny_qwen2), "--prompt-data", str(tmp_path / "d.jsonl"), "--dry-run",
                       "--rollout-batch-size", "4", "--num-rollout", "1", *absent])
    err = capsys.readouterr().err
    assert code == 2 and "cannot import module 'my_tree_only_there" in err, err


def test_the_plan_of_an_adapter_sync_counts_the_adapters(tmp_path, capsys):
    """--lora-rank 8 --lora-sync adapter on the 7B recipe: the adapters A [8, in] and B [out, 8] of q, k, v, o,
    gate, up, down in each of 28 layers, counted by hand from config.json (hidden 3584, 512 of k/v, MLP 18944),
    bf16; each engine's request carries them base64 (4/3) once per TP rank (2)."""
    hf = config_only(tmp_path, "qwen2_5_7b_instruct.json")
    code = train_main(recipe_argv("qwen2_5_7b_grpo_math.yaml", hf, "--dry-run", "--cluster", "2x8",
                                  "--lora-rank", "8", "--lora-sync", "adapter"))
    out = capsys.readouterr().out
    assert code == 0, out
    h, kv, f = 3584, 512, 18944
    nbytes = 2 * 28 * 8 * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + f) + (f + h))
    assert (f"--lora-sync adapter: that sync once (the base), then {nbytes / 1e6:.1f} MB of adapters per sync"
            in out), out
    assert f"base64: {nbytes * 4 / 3 * 2 / 1e6:.1f} MB per engine" in out
