"""The flag table's rows of the rollout side: model and data, rollout (generation, steps, rewards),
evaluation and the rollout engines (backend, devices, router, weight-sync bucket, fault tolerance).
`flags.FLAGS` takes them after `flags_trainer.TRAINER_FLAGS`, in this order.
"""

from __future__ import annotations

import math

from slime_rl.config.flag_spec import (
    REWARD_TYPES,
    ROLLOUT_BACKENDS,
    Flag,
    _nonneg_int,
    _positive_float,
    _positive_int,
    _tuple,
    section,
)

ROLLOUT_FLAGS: tuple[Flag, ...] = (
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
        Flag('--multimodal-keys', derived='data.image_key', metavar='JSON',
             help='slime\'s map from media type to column, as \'{"image": "images"}\': its image column is '
                  '--image-key\'s (images are the only media read here)'),
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
        Flag('--rollout-top-k', 'rollout.top_k', derived='eval.top_k', default=-1, type=int,
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
                  "(args, sample, sampling_params) -> Sample, or an agent (client: openai.AsyncOpenAI, sample) -> "
                  'reward or None, which talks to the model through an OpenAI endpoint (docs/agents.md)'),
        Flag('--agent-env', 'rollout.agent_env',
             help='each sample plays one episode of an environment through the OpenAI endpoint (docs/agents.md): '
                  'textarena:GAME (a TextArena single-player game, e.g. textarena:GuessTheNumber-v0) or '
                  'module:factory, factory(sample) -> env with reset() -> str and step(text) -> (observation, '
                  'reward, done), the reward the sum of the step rewards; or verifiers:TASKSET_ID[:CONFIG_JSON], '
                  "a verifiers 0.4.0 environment run unchanged (TASKSET_ID an installed taskset or a taskset "
                  "module's .py file; its harness, its rubric's reward; CONFIG_JSON: "
                  "verifiers' [env] block, e.g. verifiers:my_taskset:"
                  '{"agent":{"harness":{"id":"null"}}})'),
        Flag('--agent-max-turns', 'rollout.agent_max_turns', default=16, type=_positive_int,
             help="--agent-env: the most model answers per episode (a verifiers environment: its roles' max_turns)"),
        Flag('--agent-turn-max-tokens', 'rollout.agent_turn_max_tokens', type=_positive_int,
             help='--agent-env: the most tokens of one answer (default: what is left of --rollout-max-response-len, '
                  'which covers the whole episode)'),
        Flag('--agent-timeout-s', 'rollout.agent_timeout_s', type=_positive_float,
             help='an agent run (an --agent-env episode, or an agent function of --custom-generate-function-path) '
                  'longer than this fails its own sample: cancelled with the request it waits on (aborted on its '
                  'engine), loss mask 0, counted in rollout/agent_timeout_frac; default: no limit'),
        Flag('--agent-host', 'rollout.agent_host', default="127.0.0.1",
             help="the address the agents' OpenAI endpoint listens on: 127.0.0.1 (agents on the rollout's own "
                  "node), 0.0.0.0 (every interface: each trajectory's base URL names this node's address, so a "
                  "harness on another node or in a sandbox reaches it), or one address of this node; a "
                  "trajectory's URL holds its own random key, the only way to its sample"),
        Flag('--async', 'rollout.async_mode', action="store_true", dest='async_mode',
             help='one-step off-policy: generate step k+1 while training step k'),
        Flag('--fully-async', 'rollout.fully_async', action="store_true",
             help='generation never stops: groups stay in flight across steps and weight updates (a group an '
                  "update interrupts continues under the new weights, each token tagged with its version); each "
                  'step trains on the groups finished first (docs/off_policy.md)'),
        Flag('--max-staleness', 'rollout.max_staleness', type=_nonneg_int,
             help='--fully-async: a group whose oldest token is more than K weight versions behind the trainer is '
                  'not trained (dropped, counted in rollout/stale_groups_dropped); default: no bound'),
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
        Flag('--reward-timeout-s', 'reward.reward_timeout_s', default=300.0, type=_positive_float,
             help='seconds one reward call (a sample, or a group with --group-rm) may take; past it the sample '
                  'scores --reward-failure-value, counted in rollout/reward_timeouts and rollout/reward_failures '
                  '(a sync reward that never returns costs a thread, not the run)'),
        Flag('--reward-failure-value', 'reward.reward_failure_value', default=0.0, type=float,
             check=(math.isfinite, "must be finite"),
             help='reward of a sample whose reward function raised (counted in rollout/reward_failures, first '
                  "traceback logged); a step where every sample's reward raises stops the run"),
    ),
    *section('evaluation',
        Flag('--eval-interval', 'eval.interval', type=_positive_int, help='evaluate every N steps'),
        Flag('--eval-prompt-data', derived='eval.datasets', nargs='+', metavar='NAME PATH',
             help='pairs: name path [name path ...]'),
        Flag('--eval-config', derived=('eval.datasets', 'eval.settings'), metavar='YAML',
             help="slime's eval YAML: `datasets` (name, path and each set's own n_samples_per_eval_prompt, "
                  "temperature, top_p, top_k, max_response_len, rm_type, custom_rm_path, input_key, label_key, "
                  "apply_chat_template, stop, stop_token_ids) and `defaults` for all sets; a set's value wins "
                  "over `defaults`, which win over the --eval-* flags; replaces --eval-prompt-data"),
        Flag('--n-samples-per-eval-prompt', 'eval.n_samples_per_prompt', default=1, type=_positive_int),
        Flag('--eval-temperature', derived='eval.temperature', type=float, help='default: --rollout-temperature'),
        Flag('--eval-top-p', derived='eval.top_p', type=float, help='default: --rollout-top-p'),
        Flag('--eval-top-k', derived='eval.top_k', type=int,
             check=(lambda v: v == -1 or 1 <= v <= 1 << 30, "must be -1 (whole vocabulary) or in [1, 2^30]"),
             help='default: --rollout-top-k'),
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
        Flag('--prefill-num-servers', 'engine.prefill_num_servers', type=_positive_int,
             help="slime's prefill/decode disaggregation (SGLang engines): the first N engines prefill, the others "
                  "decode; sglang-router runs in its PD mode in front of them and each request's KV cache moves "
                  'from its prefill engine to its decode engine (--sglang-disaggregation-transfer-backend)'),
        Flag('--sglang-config', 'engine.sglang_config',
             help="slime's YAML of server groups (sglang: [{name, server_groups: [{worker_type: regular | prefill | "
                  "decode, num_gpus, num_gpus_per_engine, overrides: {ServerArgs field: value}}]}]): the engines' "
                  'roles and per-group SGLang settings; one model, the trained one (docs/migration.md)'),
        Flag('--update-weight-buffer-size', 'weight_sync.update_weight_buffer_size', default=512 * 1024**2,
             type=_positive_int,
             help='bytes per weight-sync bucket'),
        Flag('--update-weight-transport', 'weight_sync.update_weight_transport', default='nccl',
             choices=('nccl', 'disk'),
             help='how weights reach the engines after an update: nccl, a torch.distributed broadcast (NCCL on '
                  'GPUs, gloo on CPU; CUDA IPC with --colocate); disk, files in --update-weight-disk-dir that '
                  "every engine loads through SGLang's /update_weights_from_disk (engines that share a "
                  "filesystem with the trainer but no collective; slime's disk transport)"),
        Flag('--update-weight-mode', 'weight_sync.update_weight_mode', default='full', choices=('full', 'delta'),
             help="full: every weight every sync; delta (disk transport only): only the bytes changed since the "
                  "last sync, zstd-compressed, applied by each engine host to its copy in "
                  '--update-weight-local-checkpoint-dir (docs/weight_sync.md)'),
        Flag('--update-weight-disk-dir', 'weight_sync.update_weight_disk_dir',
             help='folder for --update-weight-transport disk, on a filesystem the trainer and every engine host '
                  'share: one folder per sync, v<N> (those of an earlier run are removed when the run starts)'),
        Flag('--update-weight-local-checkpoint-dir', 'weight_sync.update_weight_local_checkpoint_dir',
             help="a folder on each engine host (the same path on each) holding the engine's full checkpoint: "
                  'with --update-weight-mode delta the versions are applied to it (required); in full mode each '
                  'version is copied there before the engine loads it'),
        Flag('--update-weight-delta-encoding', 'weight_sync.update_weight_delta_encoding', default='xor',
             choices=('xor', 'overwrite'),
             help="xor: new bytes XOR old ones (smallest; applied exactly once); overwrite: the changed bytes' "
                  'positions and values (larger; applying it again changes nothing)'),
        Flag('--update-weight-delta-checksum', 'weight_sync.update_weight_delta_checksum', default='xxh3-128',
             choices=('xxh3-128', 'blake3', 'adler32'),
             help="each changed tensor's checksum, checked after the engine host applied its delta"),
        Flag('--update-weight-disk-keep-files', 'weight_sync.update_weight_disk_keep_files', action='store_true',
             help="full mode: keep every sync's folder (by default a folder goes once every engine has the next)"),
        Flag('--use-fault-tolerance', 'fault.use_fault_tolerance', action="store_true",
             help="health-check the engines; a dead or hung engine's requests go to the others, and it is "
                  'restarted in its placement and given the current weights before the next rollout'),
        Flag('--rollout-health-check-interval', 'fault.health_check_interval_s', default=10.0, type=_positive_float,
             help='seconds between /health checks of every engine during a rollout'),
        Flag('--rollout-health-check-timeout', 'fault.health_check_timeout_s', default=5.0, type=_positive_float,
             help='an engine whose /health does not answer 200 within this many seconds is declared dead'),
    ),
)
