"""The command-line surface of `slime-rl train`.

Megatron's own flag names for everything Megatron owns (parallel sizes, batch sizes, optimizer,
checkpoints) so that users carry their Megatron scripts over unchanged; slime's names for the RL
flags; `--sglang-*` passed through to SGLang's server under its own ServerArgs names.

We mirror Megatron's names instead of calling `megatron.training.arguments.parse_args`: this room
may not import Megatron (ARCHITECTURE.md), and Megatron's parser adds ~800 flags of which the trainer
derives the architecture ones from the HF config anyway.
"""

from __future__ import annotations

import argparse

SGLANG_PREFIX = "--sglang-"
ROUTER_PREFIX = "--router-"
# --sglang-* flags that are ours (slime's names), not SGLang ServerArgs to pass through
OWN_SGLANG_FLAGS = ("--sglang-server-concurrency", "--sglang-router-port")
# SGLang ServerArgs the built-in engine reads too (its CLI takes the same names), so --sglang-<name>
# also works with --rollout-backend embedded
EMBEDDED_SGLANG_ARGS = ("disable_cuda_graph", "cuda_graph_max_bs_decode", "enable_fp32_lm_head",
                        "max_running_requests")

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gspo", "ppo")
KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
ROLLOUT_BACKENDS = ("embedded", "sglang")


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


def build_parser() -> argparse.ArgumentParser:
    """All flags of `slime-rl train`. Defaults follow Megatron (optimizer) and slime (RL)."""
    p = argparse.ArgumentParser(
        prog="slime-rl train",
        description="RL post-training: Megatron-core trainer, SGLang (or built-in) rollout engines, Ray.",
        allow_abbrev=False,
    )
    p.add_argument("--config", default=None, help="YAML file whose keys are these flags' names")
    p.add_argument("--dry-run", action="store_true", help="print the placement plan and engine commands")

    g = p.add_argument_group("parallelism (Megatron names)")
    g.add_argument("--tensor-model-parallel-size", type=_positive_int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=_positive_int, default=1)
    g.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism (needs TP > 1)")
    g.add_argument("--context-parallel-size", type=_positive_int, default=1,
                   help="split every sequence over this many ranks (megatron's load-balanced 2*CP chunks; "
                        "padded and packed micro-batches)")
    g.add_argument("--actor-num-nodes", type=_positive_int, default=1)
    g.add_argument("--actor-num-gpus-per-node", type=_positive_int, default=1,
                   help="trainer ranks per node (CPU processes when there is no GPU)")

    g = p.add_argument_group("batches (Megatron names)")
    g.add_argument("--micro-batch-size", type=_positive_int, default=1)
    g.add_argument("--global-batch-size", type=_positive_int, default=None,
                   help="samples per optimizer step; default: one step per rollout")
    g.add_argument("--use-dynamic-batch-size", action="store_true",
                   help="fill micro-batches up to --max-tokens-per-gpu tokens instead of --micro-batch-size samples")
    g.add_argument("--max-tokens-per-gpu", type=_positive_int, default=None)
    g.add_argument("--no-pack-sequences", dest="pack_sequences", action="store_false",
                   help="right-padded micro-batches instead of packed (THD) sequences")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    g.add_argument("--recompute-num-layers", type=_positive_int, default=None)

    g = p.add_argument_group("optimizer (Megatron names)")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g.add_argument("--lr", type=float, default=1e-6)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="constant")
    g.add_argument("--lr-warmup-iters", type=_nonneg_int, default=0)
    g.add_argument("--lr-decay-iters", type=_positive_int, default=None)
    g.add_argument("--weight-decay", type=_nonneg_float, default=0.0)
    g.add_argument("--clip-grad", type=_nonneg_float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--freeze-vision-tower", action="store_true",
                   help="vision-language checkpoints: the vision tower does not train (EasyR1's freeze_vision_tower); "
                        "weight sync sends it once, then only the language model")

    g = p.add_argument_group("checkpoints (Megatron names)")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=_positive_int, default=None, help="steps between saves (and at the end)")
    g.add_argument("--keep-last", type=_positive_int, default=None, help="keep only the newest N checkpoints")
    g.add_argument("--save-hf", default=None,
                   help="also write an HF folder at every save and at the end; a path template that may contain "
                        "{rollout_id} (e.g. runs/x/hf_{rollout_id})")

    g = p.add_argument_group("model and data")
    g.add_argument("--hf-checkpoint", default=None, help="HF model folder (config, safetensors, tokenizer)")
    g.add_argument("--prompt-data", default=None, help="jsonl file of prompts")
    g.add_argument("--input-key", default="input")
    g.add_argument("--label-key", default="label")
    g.add_argument("--apply-chat-template", action="store_true")
    g.add_argument("--metadata-key", default=None, help="a dict column merged into each sample's metadata")
    g.add_argument("--tool-key", default=None, help="a column of tools passed to the chat template")
    g.add_argument("--apply-chat-template-kwargs", default=None, help='JSON, e.g. \'{"enable_thinking": false}\'')
    g.add_argument("--format-prompt", default=None,
                   help="a jinja2 file rendering each prompt from `content` before the chat template (EasyR1's "
                        "format_prompt), e.g. configs/prompts/think_boxed.jinja")
    g.add_argument("--num-epoch", type=_positive_int, default=None, help="instead of --num-rollout")
    g.add_argument("--rollout-shuffle", action="store_true")
    g.add_argument("--rollout-max-prompt-len", type=_positive_int, default=None)
    g.add_argument("--image-key", default="images",
                   help="column of image paths/bytes (vision-language models); rows without it are text-only")
    g.add_argument("--min-pixels", type=_positive_int, default=None,
                   help="smallest image area after resizing (default: the checkpoint's image processor)")
    g.add_argument("--max-pixels", type=_positive_int, default=None,
                   help="largest image area after resizing (default: the checkpoint's image processor)")

    g = p.add_argument_group("rollout")
    g.add_argument("--rollout-batch-size", type=_positive_int, default=None, help="prompts per step")
    g.add_argument("--n-samples-per-prompt", type=_positive_int, default=1)
    g.add_argument("--rollout-max-response-len", type=_positive_int, default=1024)
    g.add_argument("--rollout-temperature", type=float, default=1.0)
    g.add_argument("--rollout-top-p", type=float, default=1.0)
    g.add_argument("--rollout-top-k", type=int, default=-1)
    g.add_argument("--rollout-seed", type=int, default=42)
    g.add_argument("--deterministic-rollout", action="store_true",
                   help="seed every request (SGLang sampling_seed) from --rollout-seed and the sample index, and "
                        "start the engines with --enable-deterministic-inference (SGLang ignores sampling_seed "
                        "without it): rollouts then repeat across engine restarts and resumes")
    g.add_argument("--num-rollout", type=_positive_int, default=None, help="training steps")
    g.add_argument("--rollout-stop", nargs="+", default=None, help="stop strings")
    g.add_argument("--rollout-stop-token-ids", nargs="+", type=int, default=None)
    g.add_argument("--rollout-max-context-len", type=_positive_int, default=None,
                   help="prompt + response cap (max_new_tokens is lowered to fit)")
    g.add_argument("--over-sampling-batch-size", type=_positive_int, default=None,
                   help="prompts drawn at a time while filling --rollout-batch-size kept groups")
    g.add_argument("--dynamic-sampling-filter-path", default=None,
                   help="module:function(group) -> bool; DAPO: slime_rl.rollout.filters.check_reward_nonzero_std")
    g.add_argument("--partial-rollout", action="store_true",
                   help="groups cut at the end of a rollout continue next step instead of being dropped")
    g.add_argument("--mask-offpolicy-in-partial-rollout", action="store_true")
    g.add_argument("--rollout-deadline-s", type=float, default=None, help="cut a rollout after this many seconds")
    g.add_argument("--custom-generate-function-path", default=None,
                   help="module:function, async (sample, sampling_params, client_pool) -> Sample")
    g.add_argument("--async", dest="async_mode", action="store_true",
                   help="one-step off-policy: generate step k+1 while training step k")
    g.add_argument("--update-weights-interval", type=_positive_int, default=1,
                   help="broadcast weights to the engines every N steps")
    g.add_argument("--rm-type", default=None,
                   help="built-in reward: digit, math, format, dapo, f1, math_format, reasoning_gym, remote_rm")
    g.add_argument("--rm-url", default=None, help="remote reward model (POST prompt/response/label/metadata)")
    g.add_argument("--reward-key", default="score", help="the score's key when a reward returns a dict")
    g.add_argument("--rm-timeout", type=float, default=30.0, help="seconds per remote reward call")
    g.add_argument("--rm-max-retries", type=_nonneg_int, default=3)
    g.add_argument("--rm-backoff", type=float, default=0.5, help="first retry delay, doubled each time")
    g.add_argument("--custom-rm-path", default=None, help="module:function or module.function")
    g.add_argument("--group-rm", action="store_true",
                   help="--custom-rm-path scores a whole group at once: list[Sample] -> list[float | dict]")
    g.add_argument("--reward-failure-value", type=float, default=0.0,
                   help="reward of a sample whose reward function raised (counted in rollout/reward_failures, "
                        "first traceback logged); a step where every sample's reward raises stops the run")

    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-interval", type=_positive_int, default=None, help="evaluate every N steps")
    g.add_argument("--eval-prompt-data", nargs="+", default=None, metavar="NAME PATH",
                   help="pairs: name path [name path ...]")
    g.add_argument("--n-samples-per-eval-prompt", type=_positive_int, default=1)
    g.add_argument("--eval-temperature", type=float, default=None, help="default: --rollout-temperature")
    g.add_argument("--eval-top-p", type=float, default=None, help="default: --rollout-top-p")
    g.add_argument("--eval-max-response-len", type=_positive_int, default=None,
                   help="default: --rollout-max-response-len")
    g.add_argument("--skip-eval-before-train", action="store_true")

    g = p.add_argument_group("rollout engines")
    g.add_argument("--rollout-backend", choices=ROLLOUT_BACKENDS, default="embedded")
    g.add_argument("--rollout-num-gpus", type=_positive_int, default=None,
                   help="devices for all engines (CPU processes when there is no GPU); default 1, or with "
                        "--colocate the trainer's devices")
    g.add_argument("--rollout-num-gpus-per-engine", type=_positive_int, default=1)
    g.add_argument("--colocate", action="store_true",
                   help="engines share the trainer's devices: they release their memory while the trainer trains "
                        "and get the weights in place (CUDA IPC / shared memory) instead of by broadcast")
    g.add_argument("--sglang-server-concurrency", type=_positive_int, default=64,
                   help="most requests in flight per engine (the client queues the rest)")
    g.add_argument("--use-sglang-router", action="store_true",
                   help="put sglang-router (pip install sglang-router) on the head node in front of the engines: "
                        "/generate goes through it, control and weight updates go to every engine; "
                        "`--router-<name> VALUE` passes its flag --<name> through")
    g.add_argument("--sglang-router-port", type=_positive_int, default=None,
                   help="port of the router of --use-sglang-router (default: a free one)")
    g.add_argument("--update-weight-buffer-size", type=_positive_int, default=512 * 1024**2,
                   help="bytes per weight-sync bucket")
    g.add_argument("--use-fault-tolerance", action="store_true",
                   help="health-check the engines; a dead or hung engine's requests go to the others, and it is "
                        "restarted in its placement and given the current weights before the next rollout")
    g.add_argument("--rollout-health-check-interval", type=_positive_float, default=10.0,
                   help="seconds between /health checks of every engine during a rollout")
    g.add_argument("--rollout-health-check-timeout", type=_positive_float, default=5.0,
                   help="an engine whose /health does not answer 200 within this many seconds is declared dead")

    g = p.add_argument_group("algorithm")
    g.add_argument("--advantage-estimator", choices=ADVANTAGE_ESTIMATORS, default="grpo")
    g.add_argument("--disable-grpo-std-normalization", action="store_true",
                   help="Dr.GRPO: centre rewards by the group mean without dividing by the std")
    g.add_argument("--overlong-buffer-len", type=_nonneg_int, default=0,
                   help="DAPO overlong shaping: penalty ramps over the last N tokens of --rollout-max-response-len")
    g.add_argument("--overlong-penalty-factor", type=_nonneg_float, default=1.0)
    g.add_argument("--eps-clip", type=float, default=0.2)
    g.add_argument("--eps-clip-high", type=float, default=None, help="default: --eps-clip")
    g.add_argument("--loss-agg-mode", choices=LOSS_AGG_MODES, default="token-mean",
                   help="token-mean: over all tokens of the global batch (DAPO); seq-mean-*: per sample first")
    g.add_argument("--eps-clip-c", type=float, default=None, help="dual-clip constant c > 1 (for A < 0)")
    g.add_argument("--use-kl-loss", action="store_true", help="KL to the reference model in the loss")
    g.add_argument("--kl-loss-coef", type=_nonneg_float, default=0.0)
    g.add_argument("--kl-coef", type=_nonneg_float, default=0.0,
                   help="KL to the reference folded into token rewards (REINFORCE++)")
    g.add_argument("--gamma", type=float, default=1.0, help="discount of token returns (REINFORCE++, PPO's GAE)")
    g.add_argument("--lambd", type=float, default=1.0, help="GAE lambda (PPO)")
    g.add_argument("--value-clip", type=float, default=0.2, help="PPO value-loss clip around the rollout-time values")
    g.add_argument("--entropy-coef", type=_nonneg_float, default=0.0, help="entropy bonus in the loss")
    g.add_argument("--use-tis", action="store_true",
                   help="truncated importance sampling against the engine's log-probs")
    g.add_argument("--tis-clip", type=float, default=2.0)
    g.add_argument("--tis-clip-low", type=float, default=0.0)
    g.add_argument("--kl-loss-type", choices=KL_LOSS_TYPES, default="low_var_kl")
    g.add_argument("--ref-update-interval", type=_positive_int, default=None,
                   help="replace the frozen reference (KL) with the current policy every N rollouts; "
                        "default: the initial policy for the whole run")

    g = p.add_argument_group("critic (PPO: --advantage-estimator ppo; slime's names)")
    g.add_argument("--critic-num-nodes", type=_positive_int, default=None, help="default: --actor-num-nodes")
    g.add_argument("--critic-num-gpus-per-node", type=_positive_int, default=None,
                   help="critic ranks per node, default: --actor-num-gpus-per-node (CPU processes without GPUs)")
    g.add_argument("--critic-lr", type=float, default=None, help="default: --lr")
    g.add_argument("--critic-lr-warmup-iters", type=_nonneg_int, default=0)
    g.add_argument("--critic-load", default=None,
                   help="checkpoint folder of a critic (--critic-save); default: the --hf-checkpoint backbone "
                        "with a new value head")
    g.add_argument("--critic-save", default=None, help="save the critic here with every --save")
    g.add_argument("--num-critic-only-steps", type=_nonneg_int, default=0,
                   help="first steps train only the critic (the policy is not updated)")

    g = p.add_argument_group("logging")
    g.add_argument("--run-dir", default=None, help="where metrics.jsonl goes; default runs/<time>")
    g.add_argument("--use-wandb", action="store_true")
    g.add_argument("--wandb-project", default="slime_rl")
    g.add_argument("--wandb-group", default=None)
    g.add_argument("--wandb-mode", choices=("online", "offline", "disabled"), default="online")
    g.add_argument("--use-tensorboard", action="store_true", help="scalars to <run-dir>/tensorboard")
    g.add_argument("--use-swanlab", action="store_true")
    g.add_argument("--swanlab-project", default="slime_rl")
    g.add_argument("--swanlab-mode", choices=("online", "offline", "local", "disabled"), default="online",
                   help="offline/local keep the run under <run-dir>/swanlog")
    g.add_argument("--dump-rollouts", action="store_true",
                   help="write each step's prompts, responses and rewards to <run-dir>/rollouts/step_NNNNNN.jsonl")
    return p
