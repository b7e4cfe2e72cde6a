"""Coming from slime: where a flag of slime's scripts (or Megatron-LM's) means something else here.

docs/flags.md renders this table (config/reference.py) next to the flags of the section
`flags.FROM_SLIME_SECTION` (accepted only with this trainer's one value, or refused with the reason).
A row of kind "default" states a default of ours that tests compare with the parser, so the table
cannot drift from the flags. Values and meanings of slime's side were read in slime's
slime/utils/arguments.py, slime/rollout/rm_hub/ and Megatron-LM's megatron/training/arguments.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULTS_NOW_SLIMES", "DIFFERENCES", "Difference"]


@dataclass(frozen=True)
class Difference:
    flag: str
    theirs: str  # slime's (or Megatron-LM's) default or meaning
    ours: Any  # kind "default": the parser's default (a test checks it); else a description
    why: str
    kind: str = "default"  # "default": same name, another default; "meaning": another behaviour


DIFFERENCES: tuple[Difference, ...] = (
    Difference("--actor-num-gpus-per-node", "8", 1,
               "the default runs on any machine (one GPU, or one CPU process without GPUs); give 8 for a full node"),
    Difference("--rollout-max-response-len", "None (up to the engine's context)", 1024,
               "a number is needed before the run starts: prompt-length filtering against the context, "
               "Dr.GRPO's horizon (seq-mean-token-sum-norm), DAPO's overlong buffer"),
    Difference("--label-key", "None (no label)", "label", "the rule rewards (--rm-type) need a label column"),
    Difference("--metadata-key", "metadata", None,
               "every column other than the prompt, label, tools and images is kept in the sample's metadata "
               "anyway; a dict column is merged into it only when named"),
    Difference("--tool-key", "tools", None,
               "a column is passed to the chat template as tools only when named"),
    Difference("--reward-key", "None", "score", "the key a reward returning a dict puts its score under"),
    Difference("--sglang-server-concurrency", "512", 64,
               "requests in flight per engine; 64 keeps the CPU tests and small GPUs responsive, raise it on "
               "large GPUs"),
    Difference("--rollout-health-check-interval", "30.0", 10.0,
               "--use-fault-tolerance notices a dead engine sooner"),
    Difference("--rollout-health-check-timeout", "30.0", 5.0,
               "--use-fault-tolerance notices a hung engine sooner"),
    Difference("--wandb-project", "None", "slime_rl", "a project name is needed to log at all"),
    Difference("--wandb-mode", "None (wandb's WANDB_MODE)", "online", "an explicit mode"),
    Difference("--rollout-backend", "(no such flag: always SGLang)", "embedded",
               "the built-in engine runs everywhere (the CPU quickstart and tests); without --rollout-backend, "
               "SGLang's own --sglang-* flags or --rollout-num-gpus-per-engine > 1 choose sglang (a note says so)",
               kind="meaning"),
    Difference("--calculate-per-token-loss", "not given: a mean per sample, then over the global batch "
               "(our seq-mean-token-mean)",
               "not given: --loss-agg-mode token-mean (over all tokens of the global batch)",
               "DAPO's aggregation is the default here; give --loss-agg-mode seq-mean-token-mean for slime's",
               kind="meaning"),
    Difference("--rm-type math", "the last `\\boxed{}` of the whole response (verl's grader); none: 0",
               "the answer after the last `</think>`: the last `\\boxed{}`, else \"answer is X\", else the last "
               "number, compared by math-verify (or sympy)",
               "rewards answers without a box too; --rm-type deepscaler is slime's boxed-only rule",
               kind="meaning"),
    Difference("--rm-type deepscaler", "grader: mathd's normaliser, then sympy",
               "grader: math-verify (or sympy); the rules (after `</think>`, `\\boxed{}` only, 0/1) are slime's",
               "one math grader in this project", kind="meaning"),
    Difference("--ref-load", "the reference; also the policy's initial weights when --load holds no Megatron "
               "checkpoint; required by a KL term",
               "the reference only (default: the initial policy); the policy starts from --hf-checkpoint",
               "the trainer reads HF weights directly, and the engines start from --hf-checkpoint: both sides "
               "start from the same weights without a sync", kind="meaning"),
    Difference("--colocate", "implies --offload-train: the trainer's weights and optimizer state leave the GPU "
               "while the engines generate",
               "the same layouts (any --rollout-num-gpus-per-engine, pipeline parallel; engine e's TP rank i beside "
               "trainer rank e*N+i), but the trainer's memory stays on the GPU during the rollout",
               "nothing offloads the trainer yet: the engines get what is left (--sglang-mem-fraction-static 0.7 "
               "unless given; docs/colocate.md)",
               kind="meaning"),
    Difference("MODEL_ARGS (--num-layers, --swiglu, --num-experts, ...)",
               "build the Megatron model (slime compares a few with config.json: layers, sizes, eps, rope_theta, tied "
               "embeddings)",
               "each flag with a shape meaning compared with --hf-checkpoint's config.json, read as Megatron-LM reads "
               "it (the others accepted without effect); the model is built from config.json",
               "one description of the model, the one the engines read too: a models/*.sh for another model stops the "
               "run before it starts, naming the flag, both values and the config.json key", kind="meaning"),
    Difference("--dynamic-sampling-filter-path",
               "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std: keeps a group whose "
               "rewards have a sample standard deviation above 1e-6",
               "slime's path works as written (slime's module paths resolve here, docs/migration.md), with slime's "
               "rule; slime_rl.rollout.filters.check_reward_nonzero_std keeps a group whose rewards differ at all",
               "this project's filter takes the group alone (`filter(group) -> bool`)",
               kind="meaning"),
)

# defaults changed to slime's / Megatron-LM's (the recipes in configs/ set the old value explicitly)
DEFAULTS_NOW_SLIMES: tuple[tuple[str, Any, Any], ...] = (
    ("--kl-loss-type", "low_var_kl", "k1"),
    ("--weight-decay", 0.0, 0.01),
    ("--lr-decay-style", "constant", "linear"),
)
