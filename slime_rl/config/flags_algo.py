"""The flag table's rows of the RL objective and the run's outputs: algorithm (estimator, clipping,
KL, TIS), the PPO critic, logging, and slime's debug dumps with their train-only replay.
`flags.FLAGS` takes them after `flags_rollout.ROLLOUT_FLAGS`, in this order.
"""

from __future__ import annotations

import operator

from slime_rl.config.estimators import ADVANTAGE_ESTIMATORS
from slime_rl.config.flag_spec import (
    IS_LEVELS,
    KL_LOSS_TYPES,
    LOSS_AGG_MODES,
    RS_OPTIONS,
    TIS_MODES,
    Flag,
    _nonneg_float,
    _nonneg_int,
    _positive_int,
    section,
)

ALGO_FLAGS: tuple[Flag, ...] = (
    *section('algorithm',
        Flag('--advantage-estimator', 'algo.advantage_estimator', default='grpo', choices=ADVANTAGE_ESTIMATORS),
        Flag('--disable-grpo-std-normalization', 'algo.normalize_group_std', action="store_true", convert=operator.not_,
             help='Dr.GRPO: centre rewards by the group mean without dividing by the std'),
        Flag('--overlong-buffer-len', 'algo.overlong_buffer_len', default=0, type=_nonneg_int,
             help='DAPO overlong shaping: penalty ramps over the last N tokens of --rollout-max-response-len'),
        Flag('--overlong-penalty-factor', 'algo.overlong_penalty_factor', default=1.0, type=_nonneg_float),
        Flag('--eps-clip', 'algo.eps_clip', default=0.2, type=float, check=(lambda v: 0 <= v < 1, "must be in [0, 1)")),
        Flag('--eps-clip-high', derived='algo.eps_clip_high', type=float, help='default: --eps-clip'),
        Flag('--loss-agg-mode', 'trainer.loss_agg_mode', default='token-mean', choices=LOSS_AGG_MODES,
             help='token-mean: over all tokens of the global batch (DAPO); seq-mean-*: per sample first'),
        Flag('--calculate-per-token-loss', action="store_true",
             help="slime's / Megatron's name of --loss-agg-mode token-mean (slime's default without it is "
                  'seq-mean-token-mean)'),
        Flag('--eps-clip-c', 'algo.eps_clip_c', type=float, check=(lambda v: v > 1, "must be > 1"),
             help='dual-clip constant c > 1 (for A < 0)'),
        Flag('--use-kl-loss', 'algo.use_kl_loss', action="store_true", help='KL to the reference model in the loss'),
        Flag('--kl-loss-coef', 'algo.kl_loss_coef', default=0.0, type=_nonneg_float),
        Flag('--kl-coef', 'algo.kl_coef', default=0.0, type=_nonneg_float,
             help='KL to the reference folded into token rewards (REINFORCE++)'),
        Flag('--gamma', 'algo.gamma', default=1.0, type=float, check=(lambda v: 0 < v <= 1, "must be in (0, 1]"),
             help="discount of token returns (REINFORCE++, PPO's GAE)"),
        Flag('--lambd', 'algo.lambd', default=1.0, type=float, help='GAE lambda (PPO)'),
        Flag('--value-clip', 'algo.value_clip', default=0.2, type=float,
             help='PPO value-loss clip around the rollout-time values'),
        Flag('--entropy-coef', 'algo.entropy_coef', default=0.0, type=_nonneg_float, help='entropy bonus in the loss'),
        Flag('--sapo-tau-pos', 'algo.sapo_tau_pos', default=1.0, type=float, check=(lambda v: v > 0, "must be > 0"),
             help="--advantage-estimator sapo: the soft gate's temperature for tokens with a positive advantage"),
        Flag('--sapo-tau-neg', 'algo.sapo_tau_neg', default=1.05, type=float, check=(lambda v: v > 0, "must be > 0"),
             help="--advantage-estimator sapo: the gate's temperature for the other tokens (larger: their "
                  "off-policy updates fade sooner)"),
        Flag('--use-tis', 'algo.use_tis', action="store_true",
             help="importance weights pi_old / pi_engine on each token's pg term, correcting for the engine "
                  "having sampled the tokens (TIS; with --tis-mode mask: MIS / IcePop; decoupled PPO); "
                  "docs/off_policy.md"),
        Flag('--tis-clip', 'algo.tis_clip', default=2.0, type=float, help="the weights' upper bound"),
        Flag('--tis-clip-low', 'algo.tis_clip_low', default=0.0, type=float, help="the weights' lower bound"),
        Flag('--tis-level', 'algo.tis_level', default='token', choices=IS_LEVELS,
             help='--use-tis: one weight per token, or per sample: the product of its ratios (sequence) or their '
                  'geometric mean (geometric)'),
        Flag('--tis-mode', 'algo.tis_mode', default='truncate', choices=TIS_MODES,
             help='--use-tis: truncate clamps a weight to [--tis-clip-low, --tis-clip]; mask gives a weight '
                  'outside those bounds 0 (MIS; at token level IcePop)'),
        Flag('--rollout-rs', 'algo.rollout_rs', type=str,
             help="verl's rejection of tokens or samples whose trainer/engine divergence is out of bounds: "
                  f"comma-separated options of {', '.join(RS_OPTIONS)}; a rejected token's pg term is 0"),
        Flag('--rollout-rs-threshold', 'algo.rollout_rs_threshold', type=str,
             help="--rollout-rs's bounds, verl's syntax: one for all options or one per option (comma-separated); "
                  "k1 options 'lower_upper' or 'upper' (ratio bounds, lower 1/upper), k2 / k3 an upper bound"),
        Flag('--rollout-rs-veto-threshold', 'algo.rollout_rs_veto_threshold', type=float,
             check=(lambda v: v > 0, "must be > 0"),
             help="a sample with any trained token whose pi_old / pi_engine is below this is rejected whole (its pg "
                  "terms 0): slime's mismatch helper rs_veto_threshold (verl's former "
                  "rollout_token_veto_threshold); with or without --rollout-rs"),
        Flag('--tis-batch-normalize', 'algo.tis_batch_normalize', action="store_true",
             help="--use-tis: divide the weights by their mean in each micro-batch (over its trained tokens at "
                  "--tis-level token, over its samples at sequence), as slime's mismatch helper "
                  "(tis_batch_normalize); verl's rollout_is_batch_normalize takes the mean over the whole batch"),
        Flag('--get-mismatch-metrics', 'algo.get_mismatch_metrics', action="store_true",
             help="slime's: log train/rollout_corr/* (KL k1 / k3, perplexities, chi^2, ratio stats between the "
                  "trainer's old policy and the engine; verl's names) without changing the loss; on with "
                  "--use-tis or --rollout-rs"),
        Flag('--kl-loss-type', 'algo.kl_loss_type', default='k1', choices=KL_LOSS_TYPES),
        Flag('--separate-old-logprobs', 'algo.separate_old_logprobs', action="store_true",
             help='compute the old log-probs in their own forward pass even when a step is on-policy (one '
                  "optimizer step per rollout on each rank); default then: the training forward's own, "
                  'detached (ratio exactly 1, one forward pass fewer; TRL and verl do the same)'),
        Flag('--use-rollout-logprobs', 'algo.use_rollout_logprobs', action="store_true",
             help="slime's: the engine's log-probs of the sampled tokens are the old log-probs (the ratio's "
                  "denominator and the advantages' log-probs) instead of the trainer's recomputed ones; the "
                  "trainer's forward still runs for train/entropy and train/rollout_logprob_abs_diff (as slime "
                  "with --get-mismatch-metrics). Not with --use-tis (slime refuses the pair: the weights would be 1)"),
        Flag('--use-opd', 'algo.use_opd', action="store_true",
             help="slime's on-policy distillation: each token's advantage less --opd-kl-coef x (the old policy's "
                  "log-prob - the teacher's), the reverse KL to the teacher (after the advantage estimator); "
                  "needs --opd-type (megatron with --opd-teacher-load, or sglang with --rm-url)"),
        Flag('--opd-type', 'algo.opd_type', choices=('megatron', 'sglang'),
             help="megatron: the teacher (--opd-teacher-load, the policy's architecture) runs a forward on the "
                  "trainer ranks in each step, as the reference does; sglang: the teacher is a server at --rm-url "
                  "(its /generate: SGLang, or the built-in engine; any model of the policy's tokenizer), asked for "
                  "the log-prob of each token of each finished sample (max_new_tokens 0, logprob_start_len 0), as "
                  "slime's on_policy_distillation example"),
        Flag('--opd-kl-coef', 'algo.opd_kl_coef', default=1.0, type=_nonneg_float,
             help="--use-opd: the reverse KL's weight in the advantages"),
        Flag('--ref-update-interval', 'algo.ref_update_interval', type=_positive_int,
             help='replace the frozen reference (KL) with the current policy every N rollouts; default: the '
                  'initial policy for the whole run'),
    ),
    *section("critic (PPO: --advantage-estimator ppo; slime's names)",
        Flag('--critic-num-nodes', derived='critic.num_nodes', type=_positive_int, help='default: --actor-num-nodes'),
        Flag('--critic-num-gpus-per-node', derived='critic.num_gpus_per_node', type=_positive_int,
             help='critic ranks per node, default: --actor-num-gpus-per-node (CPU processes without GPUs)'),
        Flag('--critic-lr', derived='critic.lr', type=float, help='default: --lr'),
        Flag('--critic-lr-warmup-iters', 'critic.lr_warmup_iters', default=0, type=_nonneg_int),
        Flag('--critic-load', 'critic.load',
             help='checkpoint folder of a critic (--critic-save); default: the --hf-checkpoint backbone with a new '
                  'value head'),
        Flag('--critic-save', 'critic.save', help='save the critic here with every --save'),
        Flag('--num-critic-only-steps', 'critic.num_critic_only_steps', default=0, type=_nonneg_int,
             help='first steps train only the critic (the policy is not updated)'),
    ),
    *section('logging',
        Flag('--run-dir', derived='logging.run_dir', help='where metrics.jsonl goes; default runs/<time>'),
        Flag('--use-wandb', 'logging.use_wandb', action="store_true"),
        Flag('--wandb-project', 'logging.wandb_project', default='slime_rl'),
        Flag('--wandb-group', 'logging.wandb_group'),
        Flag('--wandb-team', 'logging.wandb_team', metavar='ENTITY',
             help="slime's: the wandb team (entity) the run is logged under (default: the key's own)"),
        Flag('--wandb-host', 'logging.wandb_host', metavar='URL',
             help="slime's: the wandb server to log to (a self-hosted one; WANDB_BASE_URL for this process)"),
        Flag('--wandb-mode', 'logging.wandb_mode', default='online', choices=('online', 'offline', 'disabled')),
        Flag('--wandb-key', 'logging.wandb_key', metavar='KEY',
             help="slime's: the wandb API key to log in with (else wandb's own login or WANDB_API_KEY); not "
                  "written to the run's config"),
        Flag('--use-tensorboard', 'logging.use_tensorboard', action="store_true",
             help='scalars to <run-dir>/tensorboard'),
        Flag('--use-swanlab', 'logging.use_swanlab', action="store_true"),
        Flag('--swanlab-project', 'logging.swanlab_project', default='slime_rl'),
        Flag('--swanlab-mode', 'logging.swanlab_mode', default='online',
             choices=('online', 'offline', 'local', 'disabled'),
             help='offline/local keep the run under <run-dir>/swanlog'),
        Flag('--dump-rollouts', 'logging.dump_rollouts', action="store_true",
             help="write each step's prompts, responses and rewards to <run-dir>/rollouts/step_NNNNNN.jsonl"),
    ),
    *section("debug dumps and train-only replay (slime's names)",
        Flag('--save-debug-rollout-data', 'debug.save_rollout_data', metavar='PATH',
             help="after each rollout, torch.save its samples to PATH.format(rollout_id=N) (the only placeholder "
                  "allowed): {'rollout_id', 'samples': one dict per sample, every Sample field (prompt_ids, "
                  "response_ids, rollout_logprobs: the engine's, loss_mask, reward, label, group_index, index, ...) "
                  "plus tokens and response_length}"),
        Flag('--save-debug-train-data', 'debug.save_train_data', metavar='PATH',
             help="after each step's training, each data-parallel rank (its TP rank 0, CP rank 0 of the last "
                  "pipeline stage) torch.saves what it trained on to PATH.format(rollout_id=N, rank=DP_RANK) (the "
                  "placeholders allowed): {'rollout_id', 'rank', 'dp_size', 'log_probs_from', 'samples': one dict "
                  "per sample (tokens, response_ids, response_length, log_probs: the trainer's old-policy log-probs "
                  "that train/rollout_logprob_abs_diff compares with rollout_log_probs, the engine's; loss_mask, "
                  "advantages per response token, reward)}"),
        Flag('--load-debug-rollout-data', 'debug.load_rollout_data', metavar='PATH',
             help="train only, on saved rollouts: each step's rollout is read from PATH.format(rollout_id=N) (the "
                  "only placeholder allowed; the files --save-debug-rollout-data writes) instead of generated, "
                  "its rewards as saved; its groups must be --rollout-batch-size groups of --n-samples-per-prompt "
                  "samples. Implies --debug-train-only: no rollout engine (nor router) is started, no weight sync, "
                  "no engine release in --colocate; the generation flags are accepted and unused, and eval "
                  "(--eval-prompt-data) is skipped with a warning, since it needs the engines"),
        Flag('--debug-train-only', derived='debug.train_only', action="store_true",
             help="start no rollout engine; needs --load-debug-rollout-data (which implies it), the one source of "
                  "training data here without generation (slime also trains SFT data with it, which this RL "
                  "trainer has not)"),
    ),
)
