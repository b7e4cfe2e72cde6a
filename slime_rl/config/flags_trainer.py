"""The flag table's first rows: the run's own options (--config, --dry-run and its --cluster plan),
then the trainer's flags under Megatron-LM's names: parallelism, mixture of experts, batches,
optimizer (with --seed, --bf16, --freeze-vision-tower) and checkpoints. `flags.FLAGS` takes them
first, in this order (the order of `--help` and docs/flags.md).
"""

from __future__ import annotations

from slime_rl.config.flag_spec import (
    LR_DECAY_STYLES,
    Flag,
    _cluster_shape,
    _nonneg_float,
    _nonneg_int,
    _positive_float,
    _positive_int,
    section,
)

TRAINER_FLAGS: tuple[Flag, ...] = (
    *section('options',
        Flag('--config', help="YAML file whose keys are these flags' names"),
        Flag('--dry-run', 'dry_run', action="store_true", help='print the placement plan and engine commands'),
        Flag('--cluster', 'plan.cluster', type=_cluster_shape, metavar='NODESxGPUS[:GPU]',
             help='with --dry-run: plan for a cluster of NODES nodes of GPUS GPUs each (e.g. 2x8) instead of this '
                  "machine's devices; the data and tokenizer are checked only where they exist here. With :GPU "
                  '(H100, H800, H200, H20, A100, A100-40, A800, B200, L40S, or its memory in GiB: 1x8:H100, 2x8:80) '
                  'the plan says whether the trainer and engine GPUs fit, and the dry run exits 1 when one does '
                  'not'),
        Flag('--plan-intra-node-gbps', 'plan.intra_node_gbps', default=360.0, type=_positive_float,
             help='GB/s of a weight-sync broadcast inside a node, for the --dry-run estimate (default: 360, the raw '
                  'NCCL broadcast measured between two NVLink H200s)'),
        Flag('--plan-inter-node-gbps', 'plan.inter_node_gbps', default=50.0, type=_positive_float,
             help='GB/s of a weight-sync broadcast between nodes, for the --dry-run estimate (default: 50, one '
                  '400 Gb/s InfiniBand NIC; not measured here)'),
    ),
    *section('parallelism (Megatron names)',
        Flag('--tensor-model-parallel-size', 'parallel.tensor_model_parallel_size', default=1, type=_positive_int),
        Flag('--pipeline-model-parallel-size', 'parallel.pipeline_model_parallel_size', default=1, type=_positive_int),
        Flag('--decoder-first-pipeline-num-layers', 'parallel.decoder_first_pipeline_num_layers', type=_positive_int,
             help="Megatron's: the first pipeline stage's decoder layers (it also holds the embedding); the stages "
                  "between the first and the last share the rest evenly"),
        Flag('--decoder-last-pipeline-num-layers', 'parallel.decoder_last_pipeline_num_layers', type=_positive_int,
             help="Megatron's: the last pipeline stage's decoder layers (it also holds the LM head and the loss)"),
        Flag('--sequence-parallel', 'trainer.sequence_parallel', action="store_true",
             help='Megatron sequence parallelism (needs TP > 1)'),
        Flag('--context-parallel-size', 'parallel.context_parallel_size', default=1, type=_positive_int,
             help="split every sequence over this many ranks (megatron's load-balanced 2*CP chunks; padded and "
                  'packed micro-batches)'),
        Flag('--actor-num-nodes', 'parallel.actor_num_nodes', default=1, type=_positive_int),
        Flag('--actor-num-gpus-per-node', 'parallel.actor_num_gpus_per_node', default=1, type=_positive_int,
             help='trainer ranks per node (CPU processes when there is no GPU)'),
        Flag('--expert-model-parallel-size', 'parallel.expert_model_parallel_size', default=1, type=_positive_int,
             help='mixture-of-experts checkpoints: spread each layer\'s experts over this many ranks (EP)'),
        Flag('--expert-tensor-parallel-size', 'parallel.expert_tensor_parallel_size', type=_positive_int,
             help='split each expert over this many ranks (ETP); default: --tensor-model-parallel-size'),
    ),
    *section('mixture of experts (Megatron names)',
        Flag('--moe-aux-loss-coeff', 'trainer.moe_aux_loss_coeff', default=0.0, type=_nonneg_float,
             help='weight of the routers\' load-balancing loss in the gradient (0: off)'),
        Flag('--moe-router-load-balancing-type', 'trainer.moe_router_load_balancing_type', default='aux_loss',
             choices=('aux_loss', 'seq_aux_loss', 'global_aux_loss', 'none')),
        Flag('--moe-token-dispatcher-type', 'trainer.moe_token_dispatcher_type', default='alltoall',
             choices=('alltoall', 'allgather', 'flex'),
             help='how tokens reach the experts of other EP ranks (flex, slime\'s DeepEP choice: alltoall here, '
                  'with a note; allgather: every micro-batch is padded to '
                  'the longest over the EP x expert-TP ranks; not with pipeline or context parallelism, and with '
                  'EP or TP only on packed sequences)'),
        Flag('--moe-grouped-gemm', 'trainer.moe_grouped_gemm', action="store_true",
             help="an MoE layer's local experts as two grouped matrix products (torch._grouped_mm: one kernel for "
                  "all experts; megatron's TEGroupedMLP needs TransformerEngine) instead of one GEMM per expert "
                  "(SequentialMLP); the same parameters, checkpoints and names; every slime MoE script gives it"),
        Flag('--use-rollout-routing-replay', 'trainer.use_rollout_routing_replay', action="store_true",
             help="slime's R3 (arXiv 2510.11370): the engines return the experts each MoE layer chose per token "
                  "(SGLang's --enable-return-routed-experts) and the trainer's routers use them in every forward "
                  "(gates from its own logits); train/routing_agreement reports how often it would choose alike"),
        Flag('--use-routing-replay', 'trainer.use_routing_replay', action="store_true",
             help="slime's R2 (arXiv 2507.18071): the experts the trainer's routers choose in the forward that "
                  "computes the old log-probs (the rollout's weights) are recorded and replayed in the training "
                  "forwards of the same step, so later mini-batches (--global-batch-size below the rollout, "
                  "--num-steps-per-rollout > 1) and a separate old-log-prob pass (--separate-old-logprobs) route "
                  "as the old-log-prob pass did. On the fused on-policy path (one optimizer step per rollout, old "
                  "log-probs from the training forward itself) it changes nothing. Implied by "
                  "--use-rollout-routing-replay, as in slime (the engines' routing is then replayed throughout)"),
    ),
    *section('multi-token prediction (slime names)',
        Flag('--enable-mtp-training', 'trainer.enable_mtp_training', action="store_true",
             help="slime's: train the --mtp-num-layers multi-token-prediction layers (DeepSeek-V3's, which SGLang's "
                  "EAGLE speculative decoding drafts with): each training forward adds megatron-core's MTP loss "
                  "(cross-entropy of token i+2 from the hidden state of token i and the embedding of token i+1, over "
                  "the response tokens the loss mask keeps, averaged per micro-batch (under context parallelism "
                  "over each rank's own positions, then over the ranks, as megatron-core does)) times "
                  "--mtp-loss-scaling-factor; its gradient reaches the MTP layers only (the decoder, the embedding "
                  "and the output layer are detached from it); train/mtp_loss logs it, and weight sync sends the MTP "
                  "layers to the engines' draft models"),
        Flag('--mtp-loss-scaling-factor', 'trainer.mtp_loss_scaling_factor', default=0.2, type=_nonneg_float,
             help="slime's: the MTP loss's weight (divided by the number of MTP layers), with --enable-mtp-training "
                  "(default: 0.2, slime's)"),
    ),
    *section('batches (Megatron names)',
        Flag('--micro-batch-size', 'batch.micro_batch_size', default=1, type=_positive_int),
        Flag('--global-batch-size', derived='batch.global_batch_size', type=_positive_int,
             help='samples per optimizer step; default: one step per rollout'),
        Flag('--use-dynamic-batch-size', 'trainer.use_dynamic_batch_size', action="store_true",
             help='fill micro-batches up to --max-tokens-per-gpu tokens instead of --micro-batch-size samples'),
        Flag('--max-tokens-per-gpu', 'trainer.max_tokens_per_gpu', type=_positive_int),
        Flag('--no-pack-sequences', 'trainer.pack_sequences', action="store_false", dest='pack_sequences',
             help='right-padded micro-batches instead of packed (THD) sequences'),
        Flag('--recompute-granularity', 'trainer.recompute_granularity', choices=('full', 'selective')),
        Flag('--deterministic-mode', 'trainer.deterministic_mode', action="store_true",
             help="Megatron-LM's (slime's reproducibility script): the trainer ranks run torch's deterministic "
                  "algorithms (torch.use_deterministic_algorithms, cuDNN deterministic, CUBLAS_WORKSPACE_CONFIG "
                  ":4096:8 unless set) and megatron's deterministic code paths (TransformerConfig.deterministic_mode); "
                  "the engines' side is --deterministic-rollout / --sglang-enable-deterministic-inference"),
        Flag('--recompute-method', 'trainer.recompute_method', choices=('uniform', 'block')),
        Flag('--recompute-num-layers', 'trainer.recompute_num_layers', type=_positive_int),
        Flag('--num-steps-per-rollout', derived='batch.global_batch_size', type=_positive_int,
             help="slime's: optimizer steps per rollout, i.e. --global-batch-size = --rollout-batch-size x "
                  '--n-samples-per-prompt / N'),
        Flag('--balance-data', 'batch.balance_data', action="store_true",
             help="slime's: split each rollout over the data-parallel ranks with equal sample counts and balanced "
                  'token counts (prompt + response) instead of contiguous slices; a group\'s samples may then land '
                  'in different optimizer steps'),
    ),
    *section('optimizer (Megatron names)',
        Flag('--optimizer', 'optimizer.optimizer', default='adam', choices=('adam', 'sgd')),
        Flag('--lr', 'optimizer.lr', default=1e-06, type=float, check=(lambda v: v > 0, "must be > 0")),
        Flag('--min-lr', 'optimizer.min_lr', default=0.0, type=float),
        Flag('--lr-decay-style', 'optimizer.lr_decay_style', default='linear', choices=LR_DECAY_STYLES),
        Flag('--lr-warmup-iters', 'optimizer.lr_warmup_iters', default=0, type=_nonneg_int),
        Flag('--lr-warmup-fraction', 'optimizer.lr_warmup_fraction', type=float,
             check=(lambda v: 0 <= v < 1, "must be in [0, 1)"),
             help="Megatron's: warm up over this fraction of the decay steps (--lr-decay-iters, else all optimizer "
                  "steps) instead of --lr-warmup-iters (EasyR1's lr_warmup_ratio)"),
        Flag('--lr-decay-iters', 'optimizer.lr_decay_iters', type=_positive_int),
        Flag('--weight-decay', 'optimizer.weight_decay', default=0.01, type=_nonneg_float),
        Flag('--clip-grad', 'optimizer.clip_grad', default=1.0, type=_nonneg_float),
        Flag('--adam-beta1', 'optimizer.adam_beta1', default=0.9, type=float,
             check=(lambda v: 0 <= v < 1, "must be in [0, 1)")),
        Flag('--adam-beta2', 'optimizer.adam_beta2', default=0.999, type=float,
             check=(lambda v: 0 <= v < 1, "must be in [0, 1)")),
        Flag('--adam-eps', 'optimizer.adam_eps', default=1e-08, type=float),
        Flag('--optimizer-cpu-offload', 'optimizer.cpu_offload', action="store_true",
             help="Megatron's: each rank's shard of the fp32 main params, their grads and the Adam states lives in "
                  "host memory and Adam steps on the CPU (megatron-core's HybridDeviceOptimizer, torch's AdamW): "
                  "16 bytes per parameter / data-parallel size leave the GPU. Ranks on CPU: no effect (the "
                  "optimizer is there already)"),
        Flag('--optimizer-offload-fraction', 'optimizer.offload_fraction', default=1.0, type=float,
             check=(lambda v: 0 < v <= 1, "must be in (0, 1]"),
             help="Megatron's: with --optimizer-cpu-offload, the fraction of the shard's parameters whose "
                  "optimizer runs on the CPU (the rest stays on the GPU)"),
        Flag('--overlap-cpu-optimizer-d2h-h2d', 'optimizer.overlap_cpu_d2h_h2d', action="store_true",
             help="Megatron's: with --optimizer-cpu-offload, one CPU optimizer per parameter, so the copies to "
                  "and from the GPU overlap the CPU steps (on their own CUDA streams)"),
        Flag('--use-precision-aware-optimizer', 'optimizer.precision_aware', action="store_true",
             help="Megatron's: on with --optimizer-cpu-offload (Megatron-LM requires both); without it no effect: "
                  "main params and Adam states stay fp32 either way (Megatron's --exp-avg-dtype and friends, "
                  "which would lower them with TransformerEngine's FusedAdam, are not flags here)"),
        Flag('--seed', 'model.seed', derived=('data.seed', 'rollout.sample_seed'), default=1234, type=int,
             help="Megatron's seed (the trainer's RNGs); with --rollout-seed it also seeds the prompt order, "
                  "each request's sampling_seed and the engines' own seed (config/seeds.py)"),
        Flag('--bf16', 'model.bf16', action="store_true"),
        Flag('--freeze-vision-tower', 'model.freeze_vision_tower', action="store_true",
             help="vision-language checkpoints: the vision tower does not train (EasyR1's freeze_vision_tower); "
                  'weight sync sends it once, then only the language model'),
    ),
    *section('LoRA (PEFT\'s names)',
        Flag('--lora-rank', 'model.lora_rank', default=0, type=_nonneg_int,
             help="train LoRA adapters of this rank instead of the whole model (0: off): the base weights frozen, "
                  "the optimizer over the adapters only, the reference policy of the KL terms the base without "
                  "adapters; the engines get merged weights, or the adapters alone (--lora-sync; docs/lora.md)"),
        Flag('--lora-alpha', 'model.lora_alpha', type=_positive_float,
             help="PEFT's lora_alpha: the adapters' output is scaled by alpha / rank (default: PEFT's, 8)"),
        Flag('--lora-dropout', 'model.lora_dropout', default=0.0, type=_nonneg_float,
             check=(lambda v: v < 1, "must be in [0, 1)"),
             help="PEFT's lora_dropout on the adapters' input, in the training forward only (the log-prob "
                  "forwards run without it)"),
        Flag('--lora-target-modules', 'model.lora_target_modules', nargs='+', default=("all-linear",),
             convert=lambda v: tuple(x.strip() for item in ([v] if isinstance(v, str) else v)
                                     for x in str(item).split(",") if x.strip()),
             metavar='NAME',
             help="the HF linears to adapt, as PEFT's target_modules: q_proj k_proj v_proj o_proj gate_proj "
                  "up_proj down_proj (comma- or space-separated), or all-linear (every attention and MLP linear "
                  "but MoE routers and routed experts, which are refused)"),
        Flag('--lora-load', 'model.lora_load',
             help="start from a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) of the "
                  "--hf-checkpoint model; its r, lora_alpha and target_modules are the run's (a --lora-* flag "
                  "given too must agree)"),
        Flag('--lora-sync', 'model.lora_sync', default="merged", choices=("merged", "adapter"),
             help="what each weight sync sends the engines: merged (every adapted weight as W + B A alpha / r, "
                  "through the usual paths) or adapter (the first sync sends the base, every sync the adapters "
                  "alone as PEFT's tensors through SGLang's /load_lora_adapter_from_tensors; the requests name "
                  "the newest; SGLang serves them unmerged, the built-in engine merges them)"),
    ),
    *section('checkpoints (Megatron names)',
        Flag('--save', 'checkpoint.save'),
        Flag('--load', 'checkpoint.load',
             help='resume: a --save folder (its newest complete checkpoint) or one iteration folder of it '
                  '(iter_0000002: exactly that one); a missing or empty folder starts fresh (the first run of '
                  '--load X --save X), a path naming an incomplete checkpoint is an error'),
        Flag('--ckpt-step', 'checkpoint.ckpt_step', type=_nonneg_int,
             help="with --load of a save folder: resume from its iteration N instead of the newest (Megatron-LM's "
                  'flag)'),
        Flag('--opd-teacher-load', 'model.opd_teacher_load',
             help="--use-opd --opd-type megatron: the teacher, a Megatron checkpoint or an HF folder of the policy's "
                  "architecture (as --ref-load), kept on the host and swapped in for its forward"),
        Flag('--ref-load', 'model.ref_load',
             help='the reference model of the KL terms (--use-kl-loss, --kl-loss-coef, --kl-coef): a Megatron '
                  'checkpoint (torch_dist: tools/convert_hf_to_megatron.py, a --save, Megatron-LM\'s) or an HF '
                  'folder of the same architecture; default: the initial policy (--hf-checkpoint). The policy '
                  'still starts from --hf-checkpoint (or resumes from --load)'),
        Flag('--save-interval', 'checkpoint.save_interval', type=_positive_int,
             help='steps between saves (and at the end)'),
        Flag('--keep-last', 'checkpoint.keep_last', type=_positive_int, help='keep only the newest N checkpoints'),
        Flag('--exit-signal-handler', 'checkpoint.exit_signal_handler', action="store_true",
             help="on SIGTERM (a scheduler's preemption) finish the step under way, save a checkpoint into --save "
                  "and stop (exit 143), as Megatron-LM's flag does; a second SIGTERM stops at once without it. "
                  'Without the flag SIGTERM stops at once, resuming from the last --save-interval checkpoint'),
        Flag('--save-hf', 'checkpoint.save_hf',
             help='also write an HF folder at every save and at the end; a path template that may contain '
                  '{rollout_id} (e.g. runs/x/hf_{rollout_id})'),
    ),
)
