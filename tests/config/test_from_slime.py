"""slime's scripts carry over: every flag of slime's scripts/run-qwen3-4B.sh (and the most common
ones of its other run-*.sh) is accepted with slime's meaning or refused with a message that names
it and says why. The argument lists are copied from THUDM/slime at 624b824a (scripts/run-qwen3-4B.sh,
paths under /root moved under the test's folder); expected values are slime's and Megatron-LM's
documented meanings (slime/utils/arguments.py, megatron/training/arguments.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from slime_rl.config import ConfigError, build_config, parse_flags
from slime_rl.config.checks import ConfigNote
from slime_rl.config.flags import FLAGS, FROM_SLIME_SECTION, flag
from slime_rl.config.from_slime import DEFAULTS_NOW_SLIMES, DIFFERENCES

# scripts/run-qwen3-4B.sh: MODEL_ARGS (scripts/models/qwen3-4B.sh; compared with config.json in preflight,
# tests/config/test_model_args.py), train.py's own flags, then CKPT / ROLLOUT / EVAL / PERF / GRPO / OPTIMIZER /
# SGLANG / MISC_ARGS in the script's order. PERF_ARGS' --expert-model-parallel-size 1 and
# --expert-tensor-parallel-size 1 are left out: MoE flags, another issue's (MoE support).
QWEN3_4B = """
--swiglu --num-layers 36 --hidden-size 2560 --ffn-hidden-size 9728 --num-attention-heads 32 --group-query-attention
--num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear --normalization RMSNorm
--norm-epsilon 1e-6 --rotary-base 1000000 --vocab-size 151936 --kv-channels 128 --qk-layernorm
--actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate
--hf-checkpoint /root/Qwen3-4B --ref-load /root/Qwen3-4B_torch_dist --load /root/Qwen3-4B_slime/
--save /root/Qwen3-4B_slime/ --save-interval 20
--prompt-data /root/dapo-math-17k/dapo-math-17k.jsonl --input-key prompt --label-key label --apply-chat-template
--rollout-shuffle --rm-type deepscaler --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8
--rollout-max-response-len 8192 --rollout-temperature 1 --global-batch-size 256 --balance-data
--eval-interval 20 --eval-prompt-data aime /root/aime-2024/aime-2024.jsonl --n-samples-per-eval-prompt 16
--eval-max-response-len 16384 --eval-top-p 1
--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1 --context-parallel-size 1
--recompute-granularity full --recompute-method uniform --recompute-num-layers 1
--use-dynamic-batch-size --max-tokens-per-gpu 9216
--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00
--eps-clip 0.2 --eps-clip-high 0.28
--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
--rollout-num-gpus-per-engine 2 --sglang-mem-fraction-static 0.7
--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32
--attention-backend flash
"""


def _script(tmp: Path, text: str = QWEN3_4B) -> list[str]:
    """The argument list with /root/... under `tmp`, and those files and folders made."""
    root = tmp / "root"
    argv = [t.replace("/root", str(root)) for t in text.split()]
    (root / "Qwen3-4B").mkdir(parents=True, exist_ok=True)
    (root / "Qwen3-4B" / "config.json").write_text("{}")
    (root / "Qwen3-4B_torch_dist").mkdir(exist_ok=True)
    for data in ("dapo-math-17k/dapo-math-17k.jsonl", "aime-2024/aime-2024.jsonl"):
        (root / data).parent.mkdir(exist_ok=True)
        (root / data).write_text('{"prompt": "1+1?", "label": "2"}\n')
    return argv


def test_every_flag_of_the_script_is_known(tmp_path):
    """No flag of the script is unrecognized (the parser knows them all)."""
    args, sglang = parse_flags(_script(tmp_path))
    assert sglang == {"mem_fraction_static": "0.7"}
    assert args.ref_load.endswith("Qwen3-4B_torch_dist") and args.balance_data and args.rm_type == "deepscaler"
    assert (args.num_layers, args.kv_channels, args.qk_layernorm) == (36, 128, True)


def test_the_script_builds_as_it_is(tmp_path):
    """The whole list builds, refusing nothing: --colocate with engines of two GPUs, each beside two
    trainer ranks (docs/colocate.md). The script's SGLang flag chooses SGLang (slime's engines), with a note."""
    with pytest.warns(UserWarning, match="--rollout-backend sglang: --sglang-mem-fraction-static"):
        cfg = build_config(_script(tmp_path) + ["--dry-run"])
    assert cfg.engine.backend == "sglang" and cfg.engine.sglang_args == {"mem_fraction_static": "0.7"}
    assert len(cfg.model.megatron_model_args) == 15  # MODEL_ARGS kept as given, for preflight to compare
    assert (cfg.engine.num_gpus_per_engine, cfg.engine.num_engines) == (2, 4)
    # slime's meaning of each value
    p = cfg.parallel
    assert (p.world_size, p.tensor_model_parallel_size, p.data_parallel_size) == (8, 2, 4)
    assert cfg.engine.colocate and cfg.engine.num_gpus == 8  # slime: colocated engines take every training GPU
    assert cfg.engine.sglang_args == {"mem_fraction_static": "0.7"}
    assert cfg.model.ref_load.endswith("Qwen3-4B_torch_dist") and cfg.checkpoint.save_interval == 20
    assert cfg.checkpoint.load == cfg.checkpoint.save  # an empty --load that --save fills: resume from it later
    assert (cfg.data.input_key, cfg.data.label_key, cfg.data.apply_chat_template, cfg.data.rollout_shuffle) == (
        "prompt", "label", True, True)
    assert (cfg.reward.rm_type, cfg.rollout.num_rollout, cfg.rollout.rollout_batch_size) == ("deepscaler", 3000, 32)
    assert (cfg.rollout.n_samples_per_prompt, cfg.rollout.max_response_len, cfg.rollout.temperature) == (8, 8192, 1.0)
    assert cfg.batch.global_batch_size == 256 and cfg.optimizer_steps_per_rollout == 1 and cfg.batch.balance_data
    assert cfg.eval.interval == 20 and cfg.eval.datasets[0][0] == "aime"
    assert (cfg.eval.n_samples_per_prompt, cfg.eval.max_response_len, cfg.eval.top_p) == (16, 16384, 1.0)
    assert cfg.trainer.sequence_parallel and (cfg.trainer.recompute_granularity, cfg.trainer.recompute_method,
                                              cfg.trainer.recompute_num_layers) == ("full", "uniform", 1)
    assert cfg.trainer.use_dynamic_batch_size and cfg.trainer.max_tokens_per_gpu == 9216
    a = cfg.algo
    assert (a.advantage_estimator, a.use_kl_loss, a.kl_loss_coef, a.kl_loss_type) == ("grpo", True, 0.0, "low_var_kl")
    assert a.use_reference  # --use-kl-loss with coefficient 0: slime still computes the KL (a metric)
    assert (a.entropy_coef, a.eps_clip, a.eps_clip_high) == (0.0, 0.2, 0.28)
    o = cfg.optimizer
    assert (o.optimizer, o.lr, o.lr_decay_style, o.weight_decay, o.adam_beta1, o.adam_beta2) == (
        "adam", 1e-6, "constant", 0.1, 0.9, 0.98)


# the most common flags of slime's other run-*.sh scripts (three uses or more, MoE's --moe-* /
# --expert-* and SGLang's pass-through --sglang-* aside): flag tokens -> the field and value they
# give (accepted), or the words of the reason (refused)
OTHER_SCRIPTS: list[tuple[list[str], tuple[str, object] | str]] = [
    (["--num-steps-per-rollout", "4"], ("batch.global_batch_size", 2)),  # 4 prompts x 2 samples / 4
    (["--over-sampling-batch-size", "8"], ("rollout.over_sampling_batch_size", 8)),
    (["--dynamic-sampling-filter-path", "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"],
     ("rollout.dynamic_sampling_filter_path",
      "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std")),
    (["--use-tis"], ("algo.use_tis", True)),
    (["--kl-coef", "0.00"], ("algo.kl_coef", 0.0)),
    (["--update-weight-buffer-size", str(2 * 1024**3)], ("weight_sync.update_weight_buffer_size", 2 * 1024**3)),
    (["--calculate-per-token-loss"], ("trainer.loss_agg_mode", "token-mean")),
    (["--sglang-server-concurrency", "512"], ("rollout.concurrency_per_engine", 512)),
    (["--min-lr", "1e-7"], ("optimizer.min_lr", 1e-7)),
    (["--lr-warmup-fraction", "0.1"], ("optimizer.lr_warmup_fraction", 0.1)),
    (["--num-epoch", "1"], ("data.num_epoch", 1)),
    (["--eval-temperature", "0.6"], ("eval.temperature", 0.6)),
    (["--use-precision-aware-optimizer"], ("optimizer.precision_aware", True)),
    (["--optimizer-cpu-offload"], ("optimizer.cpu_offload", True)),
    (["--overlap-cpu-optimizer-d2h-h2d"], ("optimizer.overlap_cpu_d2h_h2d", True)),
    (["--optimizer-offload-fraction", "0.5"], ("optimizer.offload_fraction", 0.5)),
    (["--optimizer-offload-fraction", "0"], "must be in (0, 1]"),
    (["--use-rollout-logprobs"], ("algo.use_rollout_logprobs", True)),
    (["--multimodal-keys", '{"image": "images"}'], ("data.image_key", "images")),  # slime's geo3k scripts
    (["--multimodal-keys", '{"image": "img", "video": "v"}'], "video is not read here"),
    (["--multimodal-keys", '{"image": "img"}', "--image-key", "pics"], "give one"),
    (["--multimodal-keys", "image=img"], "not JSON"),
    (["--use-rollout-logprobs", "--use-tis"], "the old log-probs would be the engine's"),
    (["--get-mismatch-metrics"], ("algo.get_mismatch_metrics", True)),
    (["--rollout-function-path", "slime.rollout.fully_async_rollout.generate_rollout_fully_async"],
     ("rollout.fully_async", True)),  # slime's examples/fully_async
    (["--fully-async", "--max-staleness", "2"], ("rollout.max_staleness", 2)),
    (["--max-staleness", "2"], "bounds --fully-async's staleness"),
    (["--fully-async", "--async"], "without the one-step bound"),
    (["--fully-async", "--colocate"], "keep generating while the trainer trains"),
    (["--fully-async", "--use-fault-tolerance"], "not built yet"),
    (["--fully-async", "--mask-offpolicy-in-partial-rollout"], ("rollout.mask_offpolicy_in_partial_rollout", True)),
    (["--use-tis", "--custom-tis-function-path", "slime.backends.megatron_utils.loss.icepop_function"],
     ("algo.tis_mode", "mask")),
    (["--custom-tis-function-path", "slime.my_tis.fn"], "--tis-level, --tis-mode"),
    (["--custom-tis-function-path", "examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp"],
     "reads its settings (use_tis, tis_mode, tis_upper_bound, use_rs, ...) from --custom-config-path"),
    (["--rollout-rs-veto-threshold", "0.001"], ("algo.rollout_rs_veto_threshold", 0.001)),
    (["--rollout-rs-veto-threshold", "0"], "must be > 0"),
    (["--use-rollout-logprobs", "--rollout-rs-veto-threshold", "0.001"], "no token could be rejected"),
    (["--use-tis", "--tis-batch-normalize"], ("algo.tis_batch_normalize", True)),
    (["--tis-batch-normalize"], "--tis-batch-normalize normalizes --use-tis's weights, which are off"),
    (["--tis-batch-normalize", "--use-tis", "--tis-level", "geometric"], "at token or sequence level"),
    (["--use-tis", "--tis-mode", "mask", "--tis-level", "geometric"], ("algo.tis_mode", "mask")),
    (["--tis-mode", "mask"], "--tis-mode mask shapes --use-tis's weights, which are off"),
    (["--rollout-rs", "token_k1,seq_max_k3", "--rollout-rs-threshold", "0.5_2.0,0.1"],
     ("algo.rollout_rs", "token_k1,seq_max_k3")),
    (["--rollout-rs", "token_k1"], "--rollout-rs token_k1 needs --rollout-rs-threshold"),
    (["--rollout-rs", "seq_k9", "--rollout-rs-threshold", "2"], "--rollout-rs 'seq_k9' is not an option"),
    (["--rollout-rs-threshold", "0.5_2", "--rollout-rs", "token_k2"], "for token_k2: expected one number"),
    (["--rollout-rs-threshold", "2,3,4", "--rollout-rs", "token_k1,token_k3"], "gives 3 thresholds for 2"),
    (["--rollout-rs-threshold", "2"], "--rollout-rs-threshold without --rollout-rs"),
    (["--use-rollout-logprobs", "--rollout-rs", "token_k1", "--rollout-rs-threshold", "2"],
     "no token could be rejected"),
    (["--loss-type", "sft_loss"], "supervised fine-tuning"),
    (["--disable-compute-advantages-and-returns"], "SFT"),
    (["--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout"], "--custom-generate-function-path"),
    (["--debug-train-only"], "needs --load-debug-rollout-data"),
    (["--train-backend", "fsdp"], "megatron-core"),
    (["--decoder-last-pipeline-num-layers", "5"], ("parallel.decoder_last_pipeline_num_layers", 5)),
]


def _base(tmp: Path) -> list[str]:
    (tmp / "model").mkdir(exist_ok=True)
    (tmp / "model" / "config.json").write_text("{}")
    (tmp / "d.jsonl").write_text('{"input": "1", "label": "1"}\n')
    return ["--hf-checkpoint", str(tmp / "model"), "--prompt-data", str(tmp / "d.jsonl"), "--rollout-backend",
            "sglang", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "3",
            "--rm-type", "digit"]


@pytest.mark.parametrize("tokens, expected", OTHER_SCRIPTS, ids=[t[0] for t, _ in OTHER_SCRIPTS])
def test_common_flags_of_slimes_other_scripts(tokens, expected, tmp_path):
    argv = _base(tmp_path)
    if tokens[0] == "--num-epoch":
        argv = argv[:argv.index("--num-rollout")] + argv[argv.index("--num-rollout") + 2:]
    if isinstance(expected, str):
        with pytest.raises(ConfigError) as info:
            build_config(argv + tokens)
        message = str(info.value)
        assert message.startswith(tokens[0] + " ") and expected in message, message
        return
    cfg = build_config(argv + tokens)
    group, field = expected[0].split(".")
    assert getattr(getattr(cfg, group), field) == expected[1]


# ---- the section of flags this trainer has one value for
# --custom-config-path reads a file, with every value its keys take (tests/config/test_slime_mis.py)
ONE_VALUE = [f for f in FLAGS if f.section == FROM_SLIME_SECTION and f.name != "--custom-config-path"]


def _accepted_and_refused(f) -> tuple[list[str] | None, list[str] | None]:
    """(tokens accepted, tokens refused) for a flag of the section (None: there is no such value)."""
    if f.action is not None:  # a switch: refused when its check says so, else always accepted
        return (None, [f.name]) if f.check is not None else ([f.name], None)
    if f.check is None:  # accepted with any value, changing nothing here (its help says what it is in slime)
        return [f.name, "7"], None
    if f.default is None and f.name not in ("--rollout-function-path", "--custom-tis-function-path"):
        return None, [f.name, "7"]  # refused whatever the value
    good = {"--attention-backend": "flash",
            "--rollout-function-path": "slime.rollout.fully_async_rollout.generate_rollout_fully_async",
            "--custom-tis-function-path": "slime.backends.megatron_utils.loss.vanilla_tis_function"}
    bad = {"--custom-tis-function-path": "my.tis:fn",
           "--attention-dropout": "0.1", "--hidden-dropout": "0.1", "--attention-backend": "fused",
           "--transformer-impl": "transformer_engine", "--loss-type": "custom_loss",
           "--rollout-function-path": "my.rollout:generate", "--train-backend": "fsdp"}
    return [f.name, good.get(f.name, str(f.default))], [f.name, bad[f.name]]


@pytest.mark.parametrize("f", ONE_VALUE, ids=[f.name for f in ONE_VALUE])
def test_one_value_flags_accept_it_and_refuse_another_naming_why(f, tmp_path):
    base = _base(tmp_path)
    good, bad = _accepted_and_refused(f)
    if good is not None:
        build_config(base + good)
    if bad is not None:
        with pytest.raises(ConfigError) as info:
            build_config(base + bad)
        message = str(info.value)
        # the flag, then the reason (a sentence, not just "invalid")
        assert message.startswith(f.name + " ") and len(message) > len(f.name) + 40, message
        reason = re.sub(r", got .*$", "", message.split(": ", 1)[1])
        assert reason in f.help, message  # the same reason as docs/flags.md shows


def test_the_differences_table_states_our_defaults():
    """docs/flags.md's "Coming from slime": each default of ours it states is the parser's."""
    for d in DIFFERENCES:
        if d.kind == "default":
            assert flag(d.flag).default == d.ours, d.flag
    for name, _, now in DEFAULTS_NOW_SLIMES:
        assert flag(name).default == now, name


def test_slimes_defaults_where_the_name_is_the_same(tmp_path):
    """Defaults read in slime's / Megatron-LM's argument files, now ours."""
    cfg = build_config(_base(tmp_path))
    assert cfg.algo.kl_loss_type == "k1"  # slime: --kl-loss-type default k1
    assert cfg.optimizer.weight_decay == 0.01  # Megatron-LM: --weight-decay default 0.01
    assert cfg.optimizer.lr_decay_style == "linear"  # Megatron-LM: SchedulerConfig.lr_decay_style "linear"
    assert cfg.trainer.loss_agg_mode == "token-mean"  # not slime's: in the differences table
    assert any(d.flag == "--calculate-per-token-loss" for d in DIFFERENCES)


def test_num_steps_per_rollout_and_global_batch_size_must_agree(tmp_path):
    base = _base(tmp_path)  # 4 prompts x 2 samples = 8 per rollout
    cfg = build_config(base + ["--num-steps-per-rollout", "2", "--global-batch-size", "4"])
    assert cfg.batch.global_batch_size == 4
    with pytest.raises(ConfigError, match=r"--global-batch-size \(2\) and --num-steps-per-rollout \(2\) disagree"):
        build_config(base + ["--num-steps-per-rollout", "2", "--global-batch-size", "2"])
    with pytest.raises(ConfigError, match=r"--num-steps-per-rollout \(3\) must divide"):
        build_config(base + ["--num-steps-per-rollout", "3"])


def test_lr_warmup_fraction(tmp_path):
    base = _base(tmp_path)
    with pytest.raises(ConfigError, match="--lr-warmup-fraction and --lr-warmup-iters exclude each other"):
        build_config(base + ["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"])
    with pytest.raises(ConfigError, match=r"--lr-warmup-fraction must be in \[0, 1\), got 1.0"):
        build_config(base + ["--lr-warmup-fraction", "1"])
    opt = build_config(base + ["--lr-warmup-fraction", "0.1", "--lr-decay-iters", "30"]).optimizer
    # Megatron-LM (training.py): lr_warmup_steps = lr_warmup_fraction * lr_decay_steps
    assert opt.warmup_steps(30) == pytest.approx(3.0)
    assert build_config(base + ["--lr-warmup-iters", "2"]).optimizer.warmup_steps(30) == 2


def test_calculate_per_token_loss_contradicts_a_per_sample_mode(tmp_path):
    with pytest.raises(ConfigError, match="--calculate-per-token-loss is --loss-agg-mode token-mean"):
        build_config(_base(tmp_path) + ["--calculate-per-token-loss", "--loss-agg-mode", "seq-mean-token-mean"])


def test_ref_load(tmp_path):
    base = _base(tmp_path)
    with pytest.raises(ConfigError, match="--ref-load .*nowhere: no such folder"):
        build_config(base + ["--use-kl-loss", "--ref-load", str(tmp_path / "nowhere")])
    # slime's scripts pass --ref-load also without a KL term: accepted, with a note that it is not used
    with pytest.warns(UserWarning, match="no KL term uses a reference model"):
        cfg = build_config(base + ["--ref-load", str(tmp_path)])
    assert cfg.model.ref_load == str(tmp_path) and not cfg.algo.use_reference


def test_an_hf_reference_of_another_model_is_refused_before_the_ranks_start(tiny_qwen2, tmp_path):
    from slime_rl.train import check_ref_load
    from tests.conftest import _load_tool

    wider = _load_tool("make_tiny_model").make_tiny_model(tmp_path / "wider", arch="qwen2", seed=3, hidden_size=32)
    same = _load_tool("make_tiny_model").make_tiny_model(tmp_path / "same", arch="qwen2", seed=3)
    (tmp_path / "d.jsonl").write_text('{"input": "1", "label": "1"}\n')
    base = ["--hf-checkpoint", str(tiny_qwen2), "--prompt-data", str(tmp_path / "d.jsonl"), "--rollout-batch-size",
            "4", "--num-rollout", "1", "--rm-type", "digit", "--use-kl-loss"]
    check_ref_load(build_config(base + ["--ref-load", str(same)]))  # other weights, same model: accepted
    with pytest.raises(ConfigError, match=r"--ref-load .*wider: another model than --hf-checkpoint .*hidden_size 32"):
        check_ref_load(build_config(base + ["--ref-load", str(wider)]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="--ref-load .*empty: neither a Megatron checkpoint"):
        check_ref_load(build_config(base + ["--ref-load", str(tmp_path / "empty")]))


def test_one_eval_file_without_a_name_is_named_aime_as_slime_names_it(tmp_path):
    """slime's legacy --eval-prompt-data PATH (scripts/low_precision/run-qwen3-30B-A3B-int4.sh): the one file
    gets the name aime (slime/utils/arguments.py, _resolve_eval_datasets), with a note; an odd count of two or
    more values stays an error."""
    argv = _base(tmp_path)
    data = str(tmp_path / "d.jsonl")
    with pytest.warns(ConfigNote, match="named 'aime' as slime names it"):
        cfg = build_config(argv + ["--eval-prompt-data", data, "--eval-interval", "5"])
    assert cfg.eval.datasets == (("aime", data),)
    with pytest.raises(ConfigError, match="NAME PATH pairs, got 3 values"):
        build_config(argv + ["--eval-prompt-data", "a", data, data, "--eval-interval", "5"])


def test_eval_data_without_an_interval_runs_no_eval_as_in_slime(tmp_path):
    """scripts/run-qwen3-235B-A22B.sh comments its --eval-interval out and keeps --eval-prompt-data: slime then
    never evaluates (train.py runs eval only with an interval); here too, with a note saying so."""
    data = str(tmp_path / "d.jsonl")
    argv = _base(tmp_path) + ["--eval-prompt-data", "aime", data]
    with pytest.warns(ConfigNote, match="without --eval-interval: no eval runs"):
        cfg = build_config(argv)
    assert cfg.eval.datasets == (("aime", data),) and not cfg.eval.enabled
    assert build_config(argv + ["--eval-interval", "3"]).eval.enabled
