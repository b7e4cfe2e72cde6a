"""The command-line surface of `slime-rl train`, as one declarative table.

Megatron's own flag names for everything Megatron owns (parallel sizes, batch sizes, optimizer,
checkpoints) so that users carry their Megatron scripts over unchanged; slime's names for the RL
flags; `--sglang-*` passed through to SGLang's server under its own ServerArgs names.

We mirror Megatron's names instead of calling `megatron.training.arguments.parse_args`: this room
may not import Megatron (ARCHITECTURE.md), and Megatron's parser adds ~800 flags of which the trainer
derives the architecture ones from the HF config anyway.

`FLAGS` is the one place a flag is declared: its name, the config group field(s) it lands in
(`to`, "group.field"), its default (the group dataclasses take their field defaults from here,
`default_of`), its type/choices (argparse) and its own range check (`check`, applied by `load.py`
with a message that names the flag). `derived` names the fields `load.py` computes from the flag
together with others (e.g. --eps-clip-high defaults to --eps-clip). `groups.py` checks at import
that every target field exists and that its default is the flag's, so a renamed field fails loudly.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from slime_rl.config.builtin_engine import SGLANG_ARGS
from slime_rl.config.estimators import ADVANTAGE_ESTIMATORS

SGLANG_PREFIX = "--sglang-"
ROUTER_PREFIX = "--router-"
# --sglang-* flags that are ours (slime's names), not SGLang ServerArgs to pass through
OWN_SGLANG_FLAGS = ("--sglang-server-concurrency", "--sglang-router-port")
# SGLang ServerArgs the built-in engine reads too (its CLI takes the same names), so --sglang-<name>
# also works with --rollout-backend embedded: the ServerConfig fields that name one
EMBEDDED_SGLANG_ARGS = SGLANG_ARGS

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")
# the one definition of the loss-aggregation modes; their math is slime_rl.algo.aggregate's
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
ROLLOUT_BACKENDS = ("embedded", "sglang")
# the built-in --rm-type names, in the help's order; each is a RewardSpec in rewards/builtin.py REWARDS
# (which refuses to import unless it names these), plus remote_rm (needs --rm-url)
REWARD_TYPES = ("digit", "math", "format", "dapo", "f1", "math_format", "reasoning_gym", "deepscaler")

__all__ = ["ADVANTAGE_ESTIMATORS", "EMBEDDED_SGLANG_ARGS", "FLAGS", "KL_LOSS_TYPES", "LOSS_AGG_MODES",
           "LR_DECAY_STYLES", "OWN_SGLANG_FLAGS", "ROLLOUT_BACKENDS", "ROUTER_PREFIX", "SGLANG_PREFIX", "Flag",
           "build_parser", "default_of", "flag"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def _nonneg_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _cluster_shape(text: str) -> tuple[int, int]:
    """`NODESxGPUS` (e.g. 2x8) -> (nodes, GPUs per node)."""
    nodes, sep, gpus = text.lower().partition("x")
    if not sep or not nodes.isdigit() or not gpus.isdigit() or int(nodes) < 1 or int(gpus) < 1:
        raise argparse.ArgumentTypeError(f"must be NODESxGPUS with both >= 1 (e.g. 2x8), got {text!r}")
    return int(nodes), int(gpus)


def _tuple(value: Sequence | None) -> tuple:
    return () if value is None else tuple(value)


@dataclass(frozen=True)
class Flag:
    """One flag of `slime-rl train` (see the module docstring)."""

    name: str                                 # "--rollout-max-response-len"
    to: str | tuple[str, ...] = ()            # "group.field" (a field of Config itself: "field") it lands in
    derived: str | tuple[str, ...] = ()       # fields load.py computes from it and other flags
    default: Any = None
    type: Callable[[str], Any] | None = None
    choices: Sequence[Any] | None = None
    nargs: str | None = None
    metavar: str | None = None
    action: str | None = None                 # "store_true" / "store_false" (default then False / True)
    dest: str | None = None                   # the namespace attribute when not the name's
    convert: Callable[[Any], Any] | None = None  # namespace value -> field value (e.g. a list -> a tuple)
    check: tuple[Callable[[Any], bool], str] | None = None  # (holds, "must be ..."); None values skip it
    required: bool = False                    # load.py refuses a run without it (the field default is a placeholder)
    help: str | None = None
    section: str = ""                         # the argparse group (docs/flags.md's table)

    def __post_init__(self) -> None:
        if self.action is not None:
            object.__setattr__(self, "default", self.action == "store_false")

    @property
    def key(self) -> str:
        """The attribute of the parsed namespace (and the YAML key, dashes as underscores)."""
        return self.dest or self.name[2:].replace("-", "_")

    @property
    def targets(self) -> tuple[tuple[str, str], ...]:
        """(group, field) pairs the value lands in as given; group "" is Config itself."""
        return tuple(_split(t) for t in _many(self.to))

    @property
    def derived_targets(self) -> tuple[tuple[str, str], ...]:
        return tuple(_split(t) for t in _many(self.derived))

    def value(self, namespace: argparse.Namespace) -> Any:
        """The field value from the parsed flags."""
        raw = getattr(namespace, self.key)
        return raw if self.convert is None else self.convert(raw)

    @property
    def field_default(self) -> Any:
        """What the target fields hold when the flag is not given."""
        return self.default if self.convert is None else self.convert(self.default)


def _many(x: str | tuple[str, ...]) -> tuple[str, ...]:
    return (x,) if isinstance(x, str) else x


def _split(target: str) -> tuple[str, str]:
    group, _, field = target.rpartition(".")
    return group, field


def section(title: str, *flags: Flag) -> tuple[Flag, ...]:
    return tuple(dataclasses.replace(f, section=title) for f in flags)


# ---- flags of slime's scripts and Megatron-LM's that this trainer has no choice for (docs/flags.md,
# "Coming from slime"): accepted with the one value it has, or refused with the reason and what to use
FROM_SLIME_SECTION = "from slime and Megatron-LM: accepted with this trainer's one value, or refused"
SLIME_DEFAULT_ROLLOUT = "slime.rollout.sglang_rollout.generate_rollout"
_NO_DROPOUT = ("must be 0: dropout is off in the trainer, whose log-probs must equal the engine's (Megatron's default "
               "is 0.1; slime's scripts set 0.0)")
_ATTENTION = ("must be auto or flash: the trainer's core attention is torch SDPA (trainer/attention.py), which takes "
              "the flash kernel where it applies; fused, unfused and local are TransformerEngine / Megatron kernels "
              "it does not build")
_LOCAL_SPEC = "must be local: the trainer builds megatron-core's local layer spec, without TransformerEngine"
_POLICY_LOSS = ("must be policy_loss: this is an RL trainer; slime's sft_loss (supervised fine-tuning) and "
                "custom_loss are not supported")
_ROLLOUT_FN = (f"must be {SLIME_DEFAULT_ROLLOUT} (slime's default, the built-in rollout here): a whole-rollout "
               "function is not supported; use --custom-generate-function-path (one sample at a time) and "
               "--dynamic-sampling-filter-path")
_REFUSED_SWITCHES = (
    ('--disable-compute-advantages-and-returns', "is refused: it belongs to slime's SFT scripts (--loss-type "
     "sft_loss); every --advantage-estimator here computes advantages"),
    ('--no-check-for-nan-in-loss-and-grad', "is refused: the trainer always stops on a non-finite gradient (the "
     "optimizer step reports it and the run fails naming the rank)"),
    ('--use-precision-aware-optimizer', "is refused: megatron-core needs TransformerEngine's FusedAdam for it, which "
     "this trainer does not use (local layer spec, torch Adam): main params and Adam states stay fp32, sharded over "
     "the data-parallel ranks"),
    ('--optimizer-cpu-offload', "is refused: megatron-core's HybridDeviceOptimizer (which also needs "
     "--use-precision-aware-optimizer) does not take the trainer's distributed-optimizer shards (megatron-core "
     "0.19.2 fails on them); the Adam state is already sharded over the data-parallel ranks: add ranks, or save "
     "activation memory with --recompute-granularity full"),
    ('--overlap-cpu-optimizer-d2h-h2d', "is refused: it is part of --optimizer-cpu-offload, which is refused"),
)
_REFUSED_VALUES = (
    ('--decoder-first-pipeline-num-layers', "is refused: pipeline stages hold an even split, num_hidden_layers / "
     "--pipeline-model-parallel-size layers each"),
    ('--decoder-last-pipeline-num-layers', "is refused: pipeline stages hold an even split, num_hidden_layers / "
     "--pipeline-model-parallel-size layers each"),
)
# Megatron's model-shape flags (slime's scripts/models/*.sh): the shape is read from config.json here
_SHAPE = ("is refused: the model's shape comes from --hf-checkpoint's config.json (drop slime's MODEL_ARGS from "
          "the command line)")
_SHAPE_SWITCHES = ('--swiglu', '--group-query-attention', '--use-rotary-position-embeddings', '--disable-bias-linear',
                   '--qk-layernorm', '--untie-embeddings-and-output-weights', '--add-qkv-bias')
_SHAPE_VALUES = ('--num-layers', '--hidden-size', '--ffn-hidden-size', '--num-attention-heads', '--num-query-groups',
                 '--normalization', '--norm-epsilon', '--rotary-base', '--vocab-size', '--kv-channels',
                 '--max-position-embeddings', '--position-embedding-type')


def _never(value: Any) -> bool:
    """The check of a refused flag that takes a value: any value given is refused."""
    return False


FLAGS: tuple[Flag, ...] = (
    *section('options',
        Flag('--config', help="YAML file whose keys are these flags' names"),
        Flag('--dry-run', 'dry_run', action="store_true", help='print the placement plan and engine commands'),
        Flag('--cluster', 'plan.cluster', type=_cluster_shape, metavar='NODESxGPUS',
             help='with --dry-run: plan for a cluster of NODES nodes of GPUS GPUs each (e.g. 2x8) instead of this '
                  "machine's devices; the data and tokenizer are checked only where they exist here"),
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
             choices=('alltoall', 'allgather'),
             help='how tokens reach the experts of other EP ranks (allgather: every micro-batch is padded to '
                  'the longest over the EP x expert-TP ranks; not with pipeline or context parallelism, and with '
                  'EP or TP only on packed sequences)'),
        Flag('--moe-grouped-gemm', 'trainer.moe_grouped_gemm', action="store_true",
             help="TransformerEngine's grouped GEMM for the experts (refused: the trainer builds the local spec)"),
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
        Flag('--seed', 'model.seed', derived=('data.seed', 'rollout.sample_seed'), default=1234, type=int,
             help="Megatron's seed (the trainer's RNGs); with --rollout-seed it also seeds the prompt order, "
                  "each request's sampling_seed and the engines' own seed (config/seeds.py)"),
        Flag('--bf16', 'model.bf16', action="store_true"),
        Flag('--freeze-vision-tower', 'model.freeze_vision_tower', action="store_true",
             help="vision-language checkpoints: the vision tower does not train (EasyR1's freeze_vision_tower); "
                  'weight sync sends it once, then only the language model'),
    ),
    *section('checkpoints (Megatron names)',
        Flag('--save', 'checkpoint.save'),
        Flag('--load', 'checkpoint.load'),
        Flag('--ref-load', 'model.ref_load',
             help='the reference model of the KL terms (--use-kl-loss, --kl-loss-coef, --kl-coef): a Megatron '
                  'checkpoint (torch_dist: tools/convert_hf_to_megatron.py, a --save, Megatron-LM\'s) or an HF '
                  'folder of the same architecture; default: the initial policy (--hf-checkpoint). The policy '
                  'still starts from --hf-checkpoint (or resumes from --load)'),
        Flag('--save-interval', 'checkpoint.save_interval', type=_positive_int,
             help='steps between saves (and at the end)'),
        Flag('--keep-last', 'checkpoint.keep_last', type=_positive_int, help='keep only the newest N checkpoints'),
        Flag('--save-hf', 'checkpoint.save_hf',
             help='also write an HF folder at every save and at the end; a path template that may contain '
                  '{rollout_id} (e.g. runs/x/hf_{rollout_id})'),
    ),
    *section('model and data',
        Flag('--hf-checkpoint', 'model.hf_checkpoint', required=True,
             help='HF model folder (config, safetensors, tokenizer)'),
        Flag('--prompt-data', 'data.prompt_data', required=True, help='jsonl file of prompts'),
        Flag('--input-key', 'data.input_key', default='input'),
        Flag('--label-key', 'data.label_key', default='label'),
        Flag('--apply-chat-template', 'data.apply_chat_template', action="store_true"),
        Flag('--metadata-key', 'data.metadata_key', help="a dict column merged into each sample's metadata"),
        Flag('--tool-key', 'data.tool_key', help='a column of tools passed to the chat template'),
        Flag('--apply-chat-template-kwargs', 'data.chat_template_kwargs',
             help='JSON, e.g. \'{"enable_thinking": false}\''),
        Flag('--format-prompt', 'data.format_prompt',
             help="a jinja2 file rendering each prompt from `content` before the chat template (EasyR1's "
                  'format_prompt), e.g. configs/prompts/think_boxed.jinja'),
        Flag('--num-epoch', 'data.num_epoch', type=_positive_int, help='instead of --num-rollout'),
        Flag('--rollout-shuffle', 'data.rollout_shuffle', action="store_true"),
        Flag('--rollout-max-prompt-len', 'data.rollout_max_prompt_len', type=_positive_int),
        Flag('--image-key', 'data.image_key', default='images',
             help='column of image paths/bytes (vision-language models); rows without it are text-only'),
        Flag('--min-pixels', 'data.min_pixels', type=_positive_int,
             help="smallest image area after resizing (default: the checkpoint's image processor)"),
        Flag('--max-pixels', 'data.max_pixels', type=_positive_int,
             help="largest image area after resizing (default: the checkpoint's image processor)"),
    ),
    *section('rollout',
        Flag('--rollout-batch-size', 'rollout.rollout_batch_size', type=_positive_int, required=True,
             help='prompts per step'),
        Flag('--n-samples-per-prompt', 'rollout.n_samples_per_prompt', default=1, type=_positive_int),
        Flag('--rollout-max-response-len', ('rollout.max_response_len', 'trainer.loss_agg_max_len'),
             derived='eval.max_response_len', default=1024, type=_positive_int),
        Flag('--rollout-temperature', ('rollout.temperature', 'algo.temperature'), derived='eval.temperature',
             default=1.0, type=float, check=(lambda v: 0 < v < math.inf, "must be > 0 and finite")),
        Flag('--rollout-top-p', 'rollout.top_p', derived='eval.top_p', default=1.0, type=float,
             check=(lambda v: 0 < v <= 1, "must be in (0, 1]")),
        # SGLang's SamplingParams.verify: -1 (whole vocabulary) or >= 1; it maps -1 to 1 << 30, the bound
        Flag('--rollout-top-k', 'rollout.top_k', default=-1, type=int,
             check=(lambda v: v == -1 or 1 <= v <= 1 << 30, "must be -1 (whole vocabulary) or in [1, 2^30]")),
        Flag('--rollout-seed', 'rollout.seed', derived=('data.seed', 'rollout.sample_seed'), default=42, type=int,
             help="slime's seed of the prompt shuffle and the requests' sampling_seed; combined with --seed "
                  '(config/seeds.py), so changing either changes every rollout-side random choice'),
        Flag('--deterministic-rollout', derived='rollout.sample_seed', action="store_true",
             help='seed every request (SGLang sampling_seed) from --seed, --rollout-seed and the sample index, and '
                  'start the engines with --enable-deterministic-inference (SGLang ignores sampling_seed without it): '
                  'rollouts then repeat across engine restarts and resumes; the built-in engine on CUDA also runs '
                  "prefill and decode attention by the trainer's flash kernel then (the same attention bits: README)"),
        Flag('--num-rollout', derived='rollout.num_rollout', type=_positive_int, help='training steps'),
        Flag('--rollout-stop', 'rollout.rollout_stop', nargs='+', convert=_tuple, help='stop strings'),
        Flag('--rollout-stop-token-ids', 'rollout.rollout_stop_token_ids', type=int, nargs='+', convert=_tuple),
        Flag('--rollout-max-context-len', 'rollout.rollout_max_context_len', type=_positive_int,
             help='prompt + response cap (max_new_tokens is lowered to fit)'),
        Flag('--over-sampling-batch-size', 'rollout.over_sampling_batch_size', type=_positive_int,
             help='prompts drawn at a time while filling --rollout-batch-size kept groups'),
        Flag('--dynamic-sampling-filter-path', 'rollout.dynamic_sampling_filter_path',
             help="module:function, ours (group) -> bool or slime's (args, samples) -> bool | DynamicFilterOutput; "
                  'DAPO: slime_rl.rollout.filters.check_reward_nonzero_std'),
        Flag('--dynamic-sampling-filter-kwargs', 'rollout.dynamic_sampling_filter_kwargs',
             help='JSON object of keyword arguments for the --dynamic-sampling-filter-path function, e.g. '
                  '\'{"low": 0.01, "high": 0.99}\' for slime_rl.rollout.filters.reward_mean_in_range'),
        Flag('--partial-rollout', 'rollout.partial_rollout', action="store_true",
             help='groups cut at the end of a rollout continue next step instead of being dropped'),
        Flag('--mask-offpolicy-in-partial-rollout', 'rollout.mask_offpolicy_in_partial_rollout', action="store_true"),
        Flag('--rollout-deadline-s', 'rollout.rollout_deadline_s', type=float,
             help='cut a rollout after this many seconds'),
        Flag('--custom-generate-function-path', 'rollout.custom_generate_function_path',
             help="module:function, async; ours (sample, sampling_params, client_pool) -> Sample or slime's "
                  '(args, sample, sampling_params) -> Sample'),
        Flag('--async', 'rollout.async_mode', action="store_true", dest='async_mode',
             help='one-step off-policy: generate step k+1 while training step k'),
        Flag('--update-weights-interval', 'weight_sync.update_weights_interval', default=1, type=_positive_int,
             help='broadcast weights to the engines every N steps'),
        Flag('--rm-type', 'reward.rm_type',
             help=f"built-in reward: {', '.join(REWARD_TYPES)}, remote_rm"),
        Flag('--rm-url', 'reward.rm_url', help='remote reward model (POST prompt/response/label/metadata)'),
        Flag('--reward-key', 'reward.reward_key', default='score', help="the score's key when a reward returns a dict"),
        Flag('--rm-timeout', 'reward.rm_timeout_s', default=30.0, type=float, help='seconds per remote reward call'),
        Flag('--rm-max-retries', 'reward.rm_max_retries', default=3, type=_nonneg_int),
        Flag('--rm-backoff', 'reward.rm_backoff_s', default=0.5, type=float,
             help='first retry delay, doubled each time'),
        Flag('--custom-rm-path', 'reward.custom_rm_path',
             help="module:function or file.py:function; ours (sample), slime's (args, sample) or an EasyR1 "
                  'reward file (REWARD_TYPE, compute_score(reward_inputs))'),
        Flag('--custom-rm-kwargs', 'reward.custom_rm_kwargs',
             help='JSON object of keyword arguments for the --custom-rm-path function (EasyR1\'s '
                  'reward_function_kwargs), e.g. \'{"format_weight": 0.1}\''),
        Flag('--group-rm', 'reward.group_rm', action="store_true",
             help='--custom-rm-path scores a whole group at once: list[Sample] -> list[float | dict]'),
        Flag('--reward-failure-value', 'reward.reward_failure_value', default=0.0, type=float,
             check=(math.isfinite, "must be finite"),
             help='reward of a sample whose reward function raised (counted in rollout/reward_failures, first '
                  "traceback logged); a step where every sample's reward raises stops the run"),
    ),
    *section('evaluation',
        Flag('--eval-interval', 'eval.interval', type=_positive_int, help='evaluate every N steps'),
        Flag('--eval-prompt-data', derived='eval.datasets', nargs='+', metavar='NAME PATH',
             help='pairs: name path [name path ...]'),
        Flag('--n-samples-per-eval-prompt', 'eval.n_samples_per_prompt', default=1, type=_positive_int),
        Flag('--eval-temperature', derived='eval.temperature', type=float, help='default: --rollout-temperature'),
        Flag('--eval-top-p', derived='eval.top_p', type=float, help='default: --rollout-top-p'),
        Flag('--eval-max-response-len', derived='eval.max_response_len', type=_positive_int,
             help='default: --rollout-max-response-len'),
        Flag('--skip-eval-before-train', 'eval.skip_before_train', action="store_true"),
        Flag('--log-eval-generations', 'eval.log_generations', default=0, type=_nonneg_int, metavar='N',
             help="log N eval samples per eval (prompt, response, label, reward; the same prompts each time) to "
                  "<run-dir>/eval_generations.jsonl and, with --use-wandb, a wandb table (EasyR1's "
                  'val_generations_to_log)'),
    ),
    *section('rollout engines',
        Flag('--rollout-backend', 'engine.backend', default='embedded', choices=ROLLOUT_BACKENDS),
        Flag('--rollout-num-gpus', derived='engine.num_gpus', type=_positive_int,
             help='devices for all engines (CPU processes when there is no GPU); default 1, or with --colocate the '
                  "trainer's devices"),
        Flag('--rollout-num-gpus-per-engine', 'engine.num_gpus_per_engine', default=1, type=_positive_int),
        Flag('--colocate', 'engine.colocate', action="store_true",
             help="engines share the trainer's devices: they release their memory while the trainer trains and get "
                  'the weights in place (CUDA IPC / shared memory) instead of by broadcast'),
        Flag('--sglang-server-concurrency', 'rollout.concurrency_per_engine', default=64, type=_positive_int,
             help='most requests in flight per engine (the client queues the rest)'),
        Flag('--use-sglang-router', 'engine.use_router', action="store_true",
             help='put sglang-router (pip install sglang-router) on the head node in front of the engines: '
                  '/generate goes through it, control and weight updates go to every engine; `--router-<name> '
                  'VALUE` passes its flag --<name> through'),
        Flag('--sglang-router-port', 'engine.router_port', type=_positive_int,
             help='port of the router of --use-sglang-router (default: a free one)'),
        Flag('--update-weight-buffer-size', 'weight_sync.update_weight_buffer_size', default=512 * 1024**2,
             type=_positive_int,
             help='bytes per weight-sync bucket'),
        Flag('--use-fault-tolerance', 'fault.use_fault_tolerance', action="store_true",
             help="health-check the engines; a dead or hung engine's requests go to the others, and it is "
                  'restarted in its placement and given the current weights before the next rollout'),
        Flag('--rollout-health-check-interval', 'fault.health_check_interval_s', default=10.0, type=_positive_float,
             help='seconds between /health checks of every engine during a rollout'),
        Flag('--rollout-health-check-timeout', 'fault.health_check_timeout_s', default=5.0, type=_positive_float,
             help='an engine whose /health does not answer 200 within this many seconds is declared dead'),
    ),
    *section('algorithm',
        Flag('--advantage-estimator', 'algo.advantage_estimator', default='grpo', choices=ADVANTAGE_ESTIMATORS),
        Flag('--disable-grpo-std-normalization', 'algo.normalize_group_std', action="store_true", convert=operator.not_,
             help='Dr.GRPO: centre rewards by the group mean without dividing by the std'),
        Flag('--overlong-buffer-len', 'algo.overlong_buffer_len', default=0, type=_nonneg_int,
             help='DAPO overlong shaping: penalty ramps over the last N tokens of --rollout-max-response-len'),
        Flag('--overlong-penalty-factor', 'algo.overlong_penalty_factor', default=1.0, type=_nonneg_float),
        Flag('--eps-clip', 'algo.eps_clip', default=0.2, type=float, check=(lambda v: 0 < v < 1, "must be in (0, 1)")),
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
        Flag('--use-tis', 'algo.use_tis', action="store_true",
             help="truncated importance sampling against the engine's log-probs"),
        Flag('--tis-clip', 'algo.tis_clip', default=2.0, type=float),
        Flag('--tis-clip-low', 'algo.tis_clip_low', default=0.0, type=float),
        Flag('--kl-loss-type', 'algo.kl_loss_type', default='k1', choices=KL_LOSS_TYPES),
        Flag('--separate-old-logprobs', 'algo.separate_old_logprobs', action="store_true",
             help='compute the old log-probs in their own forward pass even when a step is on-policy (one '
                  "optimizer step per rollout on each rank); default then: the training forward's own, "
                  'detached (ratio exactly 1, one forward pass fewer; TRL and verl do the same)'),
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
        Flag('--wandb-mode', 'logging.wandb_mode', default='online', choices=('online', 'offline', 'disabled')),
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
    *section(FROM_SLIME_SECTION,
        # accepted with the one value this trainer has; another value is refused (check), naming why
        Flag('--attention-dropout', default=0.0, type=float, check=(lambda v: v == 0, _NO_DROPOUT),
             help='0 only: ' + _NO_DROPOUT[len('must be 0: '):]),
        Flag('--hidden-dropout', default=0.0, type=float, check=(lambda v: v == 0, _NO_DROPOUT),
             help='0 only: ' + _NO_DROPOUT[len('must be 0: '):]),
        Flag('--attention-softmax-in-fp32', action="store_true",
             help='always on here (accepted): attention softmax in fp32'),
        Flag('--accumulate-allreduce-grads-in-fp32', action="store_true",
             help='always on here (accepted): gradients accumulate and reduce in fp32'),
        Flag('--use-distributed-optimizer', action="store_true",
             help='always on here (accepted): the optimizer state is sharded over the data-parallel ranks'),
        Flag('--no-gradient-accumulation-fusion', action="store_true",
             help="always so here (accepted): the fused weight-gradient kernel is apex / TransformerEngine's, "
                  'not used'),
        Flag('--attention-backend', default='auto', check=(lambda v: v in ('auto', 'flash'), _ATTENTION),
             help='auto or flash: ' + _ATTENTION[len('must be auto or flash: '):]),
        Flag('--transformer-impl', default='local', check=(lambda v: v == 'local', _LOCAL_SPEC),
             help='local only: ' + _LOCAL_SPEC[len('must be local: '):]),
        Flag('--loss-type', default='policy_loss', check=(lambda v: v == 'policy_loss', _POLICY_LOSS),
             help='policy_loss only: ' + _POLICY_LOSS[len('must be policy_loss: '):]),
        Flag('--rollout-function-path', check=(lambda v: v == SLIME_DEFAULT_ROLLOUT, _ROLLOUT_FN),
             help=f'{SLIME_DEFAULT_ROLLOUT} only (slime\'s default, the built-in rollout here): a whole-rollout '
                  'function is not supported; use --custom-generate-function-path (one sample at a time) and '
                  '--dynamic-sampling-filter-path'),
        # refused: given at all, the run stops with the reason (check) before anything starts
        *(Flag(name, action="store_true", check=(operator.not_, why), help=why[len('is refused: '):])
          for name, why in _REFUSED_SWITCHES),
        *(Flag(name, check=(_never, why), help=why[len('is refused: '):]) for name, why in _REFUSED_VALUES),
        *(Flag(name, action="store_true", check=(operator.not_, _SHAPE), help=_SHAPE[len('is refused: '):])
          for name in _SHAPE_SWITCHES),
        *(Flag(name, check=(_never, _SHAPE), help=_SHAPE[len('is refused: '):]) for name in _SHAPE_VALUES),
    ),
)

_BY_NAME: dict[str, Flag] = {f.name: f for f in FLAGS}
assert len(_BY_NAME) == len(FLAGS), "a flag is declared twice"


def flag(name: str) -> Flag:
    """The table entry of `name` ("--rollout-max-response-len")."""
    return _BY_NAME[name]


def default_of(name: str) -> Any:
    """The default a group field takes from its flag (the one place the value is written)."""
    return _BY_NAME[name].field_default


def build_parser() -> argparse.ArgumentParser:
    """All flags of `slime-rl train`, from `FLAGS`. Defaults follow Megatron (optimizer) and slime (RL)."""
    p = argparse.ArgumentParser(
        prog="slime-rl train",
        description="RL post-training: Megatron-core trainer, SGLang (or built-in) rollout engines, Ray.",
        allow_abbrev=False,
    )
    groups: dict[str, argparse._ActionsContainer] = {"options": p}
    for f in FLAGS:
        if f.section not in groups:
            groups[f.section] = p.add_argument_group(f.section)
        kwargs: dict[str, Any] = {"help": f.help}
        if f.dest is not None:
            kwargs["dest"] = f.dest
        if f.action is not None:
            kwargs["action"] = f.action
        else:
            kwargs |= {"default": f.default, "type": f.type, "choices": f.choices, "nargs": f.nargs,
                       "metavar": f.metavar}
            kwargs = {k: v for k, v in kwargs.items() if v is not None or k == "default"}
        groups[f.section].add_argument(f.name, **kwargs)
    return p
