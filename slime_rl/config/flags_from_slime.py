"""The flag table's last section: flags of slime's scripts and Megatron-LM's that this trainer has
no choice for (docs/flags.md, "Coming from slime"). Each is accepted with the one value it has, or
refused with the reason and what to use instead (its `check`). `flags.FLAGS` takes them last.
slime's MODEL_ARGS (the model's shape in Megatron-LM's flags) are `flags_model.py`'s.
"""

from __future__ import annotations

import operator

from slime_rl.config.flag_spec import (
    Flag,
    section,
)
from slime_rl.config.slime_mis import MIS_FUNCTION

FROM_SLIME_SECTION = "from slime and Megatron-LM: accepted with this trainer's one value, or refused"
SLIME_DEFAULT_ROLLOUT = "slime.rollout.sglang_rollout.generate_rollout"
# slime's examples/fully_async rollout function: --fully-async here (rollout/stream.py)
SLIME_FULLY_ASYNC_ROLLOUT = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"
_NO_DROPOUT = ("must be 0: dropout is off in the trainer, whose log-probs must equal the engine's (Megatron's default "
               "is 0.1; slime's scripts set 0.0)")
_ATTENTION = ("must be auto or flash: the trainer's core attention is torch SDPA (trainer/attention.py), which takes "
              "the flash kernel where it applies; fused, unfused and local are TransformerEngine / Megatron kernels "
              "it does not build")
_LOCAL_SPEC = "must be local: the trainer builds megatron-core's local layer spec, without TransformerEngine"
_POLICY_LOSS = ("must be policy_loss: this is an RL trainer; slime's sft_loss (supervised fine-tuning) and "
                "custom_loss are not supported")
_ROLLOUT_FN = (f"must be {SLIME_DEFAULT_ROLLOUT} (slime's default, the built-in rollout here) or "
               f"{SLIME_FULLY_ASYNC_ROLLOUT} (--fully-async here): another whole-rollout function is not supported; "
               "use --custom-generate-function-path (one sample at a time) and --dynamic-sampling-filter-path")
# slime's built-in TIS functions (slime/backends/megatron_utils/loss.py) -> the --tis-mode that is the same
# weight: vanilla clamps exp(old - rollout) to [--tis-clip-low, --tis-clip], icepop zeroes it outside
SLIME_TIS_FUNCTIONS = {"slime.backends.megatron_utils.loss.vanilla_tis_function": "truncate",
                       "slime.backends.megatron_utils.loss.icepop_function": "mask",
                       MIS_FUNCTION: None}  # the mismatch helper: its --custom-config-path says (slime_mis.py)
_TIS_FN = ("must be slime's vanilla_tis_function or icepop_function (slime.backends.megatron_utils.loss), "
           "--tis-mode truncate and mask here (with --use-tis), or its mismatch helper " + MIS_FUNCTION + " with "
           "the --custom-config-path it reads (mis.yaml); another function has no counterpart, and the corrections "
           "are flags: --tis-level, --tis-mode, --tis-clip / --tis-clip-low, --rollout-rs with "
           "--rollout-rs-threshold, --rollout-rs-veto-threshold, --tis-batch-normalize; docs/off_policy.md")
# slime's on-policy distillation through a teacher server (examples/on_policy_distillation/run-qwen3-8B-opd.sh:
# --opd-type sglang): its reward function posts each sample to the teacher at --rm-url, its post-process keeps
# the teacher's log-probs of the response and scores every sample 0.0; here --opd-type sglang does both
SLIME_OPD_REWARD = "slime.rollout.on_policy_distillation.reward_func"
SLIME_OPD_POST_PROCESS = "slime.rollout.on_policy_distillation.post_process_rewards"
_OPD_POST = (f"must be {SLIME_OPD_POST_PROCESS} (slime's on-policy distillation, --opd-type sglang here): another "
             "post-process of the rewards has no counterpart; advantages come from --advantage-estimator "
             "(--disable-grpo-std-normalization for Dr.GRPO)")
_TRAIN_BACKEND = "must be megatron: the trainer is megatron-core (slime's FSDP backend has no counterpart here)"
_REFUSED_SWITCHES = (
    ('--disable-compute-advantages-and-returns', "is refused: it belongs to slime's SFT scripts (--loss-type "
     "sft_loss); every --advantage-estimator here computes advantages"),
)


FROM_SLIME_FLAGS: tuple[Flag, ...] = (
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
        Flag('--no-check-for-nan-in-loss-and-grad', action="store_true",
             help="accepted, the check stays on: Megatron-LM's per-step NaN check, which slime's large scripts "
                  "turn off to save its all-reduce; the trainer always stops on a non-finite gradient (the "
                  "optimizer step reports it and the run fails naming the rank), and a finite run is the same"),
        Flag('--moe-enable-deepep', action="store_true",
             help="accepted, no effect here: slime's DeepEP kernels for the flex token dispatcher (GPU kernels not "
                  "built here); tokens go to the experts by all-to-all (see --moe-token-dispatcher-type)"),
        Flag('--no-offload-train', action="store_true",
             help="always so here (accepted): slime's switch that keeps the trainer's weights and optimizer state "
                  "on the GPU during the rollout; nothing offloads them here"),
        Flag('--no-offload-rollout', action="store_true",
             help="always so here (accepted): slime's switch that keeps the engines' weights on the GPU while "
                  "the trainer trains; without --colocate they never leave it here (with --colocate they are "
                  "released, docs/colocate.md)"),
        Flag('--data-pad-size-multiplier', type=int, metavar='N',
             help="accepted, no effect here: slime pads each packed micro-batch to a multiple of N tokens for "
                  "TransformerEngine's kernels; the trainer pads packed sequences to what its own attention and "
                  "TP / CP split need"),
        Flag('--model-name', metavar='NAME',
             help="accepted, no effect here: slime's choice of HF <-> Megatron weight-name converter; here the "
                  "converter follows config.json's model_type"),
        Flag('--train-backend', default='megatron', check=(lambda v: v == 'megatron', _TRAIN_BACKEND),
             help='megatron only: ' + _TRAIN_BACKEND[len('must be megatron: '):]),
        Flag('--log-probs-chunk-size', type=int, metavar='N',
             help="accepted, no effect here: slime's log-prob computation in chunks of N tokens, to bound the "
                  "memory of the logits; the trainer bounds it by micro-batch (--micro-batch-size, "
                  "--max-tokens-per-gpu)"),
        Flag('--allgather-cp', action="store_true",
             help="accepted, no effect here: slime's choice of all-gather context parallelism; the trainer has one "
                  "context-parallel implementation (--context-parallel-size)"),
        Flag('--attention-backend', default='auto', check=(lambda v: v in ('auto', 'flash'), _ATTENTION),
             help='auto or flash: ' + _ATTENTION[len('must be auto or flash: '):]),
        Flag('--transformer-impl', default='local', check=(lambda v: v == 'local', _LOCAL_SPEC),
             help='local only: ' + _LOCAL_SPEC[len('must be local: '):]),
        Flag('--loss-type', default='policy_loss', check=(lambda v: v == 'policy_loss', _POLICY_LOSS),
             help='policy_loss only: ' + _POLICY_LOSS[len('must be policy_loss: '):]),
        Flag('--rollout-function-path', check=(lambda v: v in (SLIME_DEFAULT_ROLLOUT, SLIME_FULLY_ASYNC_ROLLOUT),
                                               _ROLLOUT_FN),
             help="slime's two rollout functions only: " + _ROLLOUT_FN.split(": ", 1)[1]),
        Flag('--custom-config-path', metavar='FILE',
             help="slime's YAML of settings set over the command line: the mismatch helper's keys (use_tis, "
                  "tis_mode, use_rs, ... with --custom-tis-function-path " + MIS_FUNCTION + ") become the "
                  "off-policy flags (config/slime_mis.py says how); any other key is a flag under its own name"),
        Flag('--custom-tis-function-path', check=(lambda v: v in SLIME_TIS_FUNCTIONS, _TIS_FN),
             help=_TIS_FN[len("must be "):]),
        Flag('--custom-reward-post-process-path', check=(lambda v: v == SLIME_OPD_POST_PROCESS, _OPD_POST),
             help=f"{SLIME_OPD_POST_PROCESS} only, with --opd-type sglang (the teacher's log-probs kept, every "
                  "reward 0.0, as slime's on-policy distillation example): " + _OPD_POST.split(": ", 1)[1]),
        # refused: given at all, the run stops with the reason (check) before anything starts
        *(Flag(name, action="store_true", check=(operator.not_, why), help=why[len('is refused: '):])
          for name, why in _REFUSED_SWITCHES),
    ),
)
