"""RolloutManager: draws prompts, generates scored groups on the engines, turns them into the
trainer's batch (the estimator's rollout-side advantages included) and puts it in the Buffer.

Failures it absorbs: with --use-fault-tolerance, engines that die or hang during a rollout
(`slime_rl.rollout.health`); they stay dead here until the cluster has restarted them with the
current weights (`revive_engine`). A reward function that raises scores --reward-failure-value;
a step where every sample's reward raised stops the run with the traceback."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
import torch
from transformers import AutoTokenizer

from slime_rl.algo import estimator_for, overlong_penalty
from slime_rl.config import AlgoConfig, Config
from slime_rl.config.slime_args import slime_args
from slime_rl.data import PromptDataset, Sample
from slime_rl.data.debug_rollouts import read_debug_rollout
from slime_rl.data.sample import TOKEN_VERSIONS_KEY
from slime_rl.engines.client import AdapterChoice, AsyncEngineClient, AsyncRouterClient, EngineError
from slime_rl.observability.debug_data import save_debug_data
from slime_rl.orchestration.failures import EngineFailure, RolloutStarved
from slime_rl.rewards import eval_reward_fn, opd_teacher_url, reward_fn_from_config, reward_metric_means
from slime_rl.rollout.custom import load_filter, rollout_generate_function
from slime_rl.rollout.dynamic import generate_filtered_groups
from slime_rl.rollout.eval import (
    eval_samples_per_prompt,
    eval_sampling_params,
    generate_eval,
    pick_generations,
    rewards_of,
    summarize,
)
from slime_rl.rollout.health import EngineHealth
from slime_rl.rollout.options import RolloutOptions
from slime_rl.rollout.routing import ClientPool
from slime_rl.rollout.slime_compat import SlimeGenerate
from slime_rl.rollout.stream import GroupStream


def shaped_rewards(groups: list[list[Sample]], algo: AlgoConfig, max_response_len: int) -> torch.Tensor:
    """[G, n] float64 rewards the advantages are computed from: task reward, plus the DAPO
    overlong penalty when --overlong-buffer-len is set."""
    rewards = torch.tensor([[s.reward for s in g] for g in groups], dtype=torch.float64)
    if algo.overlong_buffer_len > 0:
        lengths = torch.tensor([[s.response_length for s in g] for g in groups], dtype=torch.float64)
        penalty = overlong_penalty(lengths.flatten(), max_response_len, algo.overlong_buffer_len,
                                   algo.overlong_penalty_factor)
        rewards = rewards + penalty.view_as(rewards).to(torch.float64)
    return rewards


def group_advantages(rewards: torch.Tensor, algo: AlgoConfig) -> torch.Tensor:
    """[G, n] -> [G, n] scalar advantages (broadcast to tokens by the trainer): the rollout half of
    the estimator (algo.estimators: GRPO/GSPO, RLOO, REINFORCE++-baseline's group mean; the
    token-level ones build theirs in the trainer from the rewards)."""
    return estimator_for(algo).rollout_advantages(rewards, algo)


def samples_to_batch(groups: list[list[Sample]], algo: AlgoConfig | None = None,
                     max_response_len: int = 0) -> dict[str, Any]:
    """Scored groups -> the trainer's batch: lists, one entry per sample, groups contiguous."""
    algo = algo or AlgoConfig()
    rewards = shaped_rewards(groups, algo, max_response_len)
    adv = group_advantages(rewards, algo).flatten().tolist()
    flat = [s for g in groups for s in g]
    batch = {
        "tokens": [s.tokens for s in flat],
        "response_lengths": [s.response_length for s in flat],
        "loss_masks": [s.loss_mask for s in flat],
        "advantages": adv,
        "rollout_logprobs": [s.rollout_logprobs for s in flat],
        "rewards": rewards.flatten().tolist(),
    }
    if algo.use_opd and algo.opd_type == "sglang":  # the teacher server's log-probs (without them: not trained)
        batch["teacher_logprobs"] = [list(s.teacher_logprobs) if s.teacher_logprobs is not None
                                     else [0.0] * s.response_length for s in flat]
        batch["loss_masks"] = [m if s.teacher_logprobs is not None else [0] * len(m)
                               for s, m in zip(flat, batch["loss_masks"], strict=True)]
    if any(s.rollout_routed_experts is not None for s in flat):  # MoE: the engines' routing (routing replay)
        missing = [s.index for s in flat if s.rollout_routed_experts is None and s.response_ids]
        if missing:
            raise RuntimeError(f"samples {missing[:5]} came back without the engines' routed_experts: were the "
                               "engines started with --enable-return-routed-experts?")
        batch["rollout_routed_experts"] = [s.rollout_routed_experts for s in flat]
    if any(s.images for s in flat):  # vision-language: the trainer rebuilds pixels and mRoPE positions
        batch["images"] = [list(s.images) for s in flat]
        batch["image_grid_thw"] = [[list(g) for g in s.image_grid_thw] for s in flat]
    return batch


def _jsonable(sample: dict[str, Any]) -> dict[str, Any]:
    """A Sample's fields for the checkpoint's JSON: the engines' routing (a numpy array) as lists
    (the trainer and the rollout take either)."""
    routed = sample.get("rollout_routed_experts")
    if routed is not None and hasattr(routed, "tolist"):
        sample["rollout_routed_experts"] = routed.tolist()
    return sample


def dump_rollouts(path: Path, groups: list[list[Sample]]) -> None:
    """One JSON object per sample: what was asked, what came back, how it scored."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for g in groups:
            for s in g:
                f.write(json.dumps({"group": s.group_index, "index": s.index, "prompt": s.prompt,
                                    "response": s.response, "label": s.label, "reward": s.reward,
                                    "finish_reason": s.finish_reason, "response_length": s.response_length,
                                    "reward_metrics": s.reward_metrics,
                                    # the weight version that sampled each response token (None: environment)
                                    "token_versions": s.metadata.get(TOKEN_VERSIONS_KEY, [])},
                                   default=str) + "\n")


def debug_rollout_data(rollout_id: int, groups: list[list[Sample]]) -> dict[str, Any]:
    """--save-debug-rollout-data's file: {"rollout_id", "samples"}, one dict per sample in batch order
    (groups contiguous, as the trainer's batch): every Sample field (index, group_index, prompt,
    prompt_ids, label, metadata, response, response_ids, rollout_logprobs: the engine's log-prob of
    each response token, loss_mask, finish_reason, reward, reward_metrics, weight_version, images,
    image_grid_thw, rollout_routed_experts as lists), plus tokens (prompt + response ids) and
    response_length."""
    samples = [_jsonable(dataclasses.asdict(s)) | {"tokens": s.tokens, "response_length": s.response_length}
               for g in groups for s in g]
    return {"rollout_id": rollout_id, "samples": samples}


def rollout_metrics(groups: list[list[Sample]]) -> dict[str, float]:
    flat = [s for g in groups for s in g]
    rewards = torch.tensor([s.reward for s in flat], dtype=torch.float64)
    lengths = torch.tensor([s.response_length for s in flat], dtype=torch.float64)
    group_std = torch.tensor([[s.reward for s in g] for g in groups], dtype=torch.float64).std(dim=1)
    return {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/reward_std": rewards.std().item() if len(flat) > 1 else 0.0,
        "rollout/response_len_mean": lengths.mean().item(),
        "rollout/truncated_frac": sum(s.finish_reason == "length" for s in flat) / len(flat),
        "rollout/zero_std_group_frac": (group_std == 0).double().mean().item(),
    } | reward_metric_means(flat) | agent_metrics(flat)


def agent_metrics(flat: list[Sample]) -> dict[str, float]:
    """Agent trajectories (`rollout.agent`): turns and tool calls per trajectory, the fractions that failed
    (the agent raised) and branched (the harness edited its history); nothing when no sample is one."""
    runs = [s for s in flat if "agent_turns" in s.metadata or "agent_error" in s.metadata]
    if not runs:
        return {}
    n = len(runs)
    return {"rollout/agent_turns_mean": sum(s.metadata.get("agent_turns", 0) for s in runs) / n,
            "rollout/agent_tool_calls_mean": sum(s.metadata.get("agent_tool_calls", 0) for s in runs) / n,
            "rollout/agent_failed_frac": sum("agent_error" in s.metadata for s in runs) / n,
            "rollout/agent_branched_frac": sum(bool(s.metadata.get("agent_branched")) for s in runs) / n,
            "rollout/agent_timeout_frac": sum(bool(s.metadata.get("agent_timed_out")) for s in runs) / n}


# one rollout may draw the data this many times over before its filter is called hopeless
MAX_EPOCHS_PER_ROLLOUT = 3


@ray.remote(num_cpus=0)
class RolloutManager:
    def __init__(self, cfg: Config, engine_urls: list[str], api_key: str | None = None) -> None:
        self.cfg = cfg
        self.engine_urls = engine_urls
        self.router_url: str | None = None  # --use-sglang-router: /generate goes through it (use_router)
        self.adapter = AdapterChoice()  # --lora-sync adapter: what /generate names (use_adapter); None: the base
        self.api_key = api_key
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_checkpoint)
        self.dataset = PromptDataset(cfg.data, self.tokenizer)
        self.slime_args = slime_args(cfg)  # what slime-style extension functions get as `args`
        self.reward_fn = reward_fn_from_config(
            cfg.reward, failure_value=cfg.reward.reward_failure_value, args=self.slime_args,
            generate_sets_reward=cfg.rollout.generate_sets_reward, opd_teacher_url=opd_teacher_url(cfg),
            opd_temperature=cfg.rollout.temperature)
        self.dead: dict[int, str] = {}  # engine -> why it was declared dead; until it is revived
        self.options = RolloutOptions.from_config(
            cfg.rollout, return_routed_experts=cfg.trainer.use_rollout_routing_replay or None)
        ev = cfg.eval
        self.eval_sets = {name: PromptDataset(replace(
            cfg.data, prompt_data=path, rollout_shuffle=False, input_key=ev.of(name, "input_key", cfg.data.input_key),
            label_key=ev.of(name, "label_key", cfg.data.label_key),
            apply_chat_template=ev.of(name, "apply_chat_template", cfg.data.apply_chat_template)),
            self.tokenizer).rows for name, path in ev.datasets}
        # --eval-config: a set with its own rm_type / custom_rm_path scores with its own function
        self.eval_rewards = {name: eval_reward_fn(cfg, name, self.slime_args) for name, _ in ev.datasets
                             if {"rm_type", "custom_rm_path"} & set(ev.settings.get(name, {}))}
        self._state_before: dict[int, dict[str, Any]] = {}
        self.leftover: list[list[Sample]] = []  # partial rollout: groups cut last step, continued first
        self.stream: GroupStream | None = None  # --fully-async: the never-stopping rollout, from the first step
        self.next_index = 0
        self.next_group = 0

    def use_router(self, router_url: str) -> None:
        """--use-sglang-router: from now on /generate goes through the router at `router_url` (the
        Cluster starts it once the engines are healthy, after this actor was built)."""
        self.router_url = router_url

    def _clients(self, live_only: bool = False) -> list[AsyncEngineClient]:
        urls = [url for k, url in enumerate(self.engine_urls) if not (live_only and k in self.dead)]
        if self.router_url is not None:  # /generate through the router, control calls to every engine
            clients = [AsyncRouterClient(self.router_url, urls, api_key=self.api_key)]
        else:
            clients = [AsyncEngineClient(url, api_key=self.api_key) for url in urls]
        for c in clients:
            c.adapter = self.adapter
        return clients

    def use_adapter(self, name: str) -> None:
        """--lora-sync adapter: from now on every /generate names the adapters loaded as `name` (also the
        requests of a rollout already running: its clients share this choice)."""
        self.adapter.name = name

    async def generate(self, step: int, buffer) -> dict[str, float]:
        """Fill the step's groups (filter, over-sampling and partial rollout per the flags), put the
        batch in the buffer, return the rollout metrics. An async actor: Ray runs its methods on one
        event loop, so the HTTP fan-out is awaited here."""
        if self.cfg.rollout.fully_async:
            return await self._take_from_stream(step, buffer)
        start = time.time()
        # a checkpoint taken after step - 1 must hold the rollout side as it was before this rollout
        self._state_before = {step: self.state_dict()}
        clients = self._clients()
        reward_mark = self.reward_fn.failures.mark()
        health = self._health()
        try:
            async with contextlib.AsyncExitStack() as stack:
                if health is not None:
                    await stack.enter_async_context(health.watching(clients))
                result = await generate_filtered_groups(
                    clients, self._draw_guard(step), self.options, self.reward_fn, self.tokenizer,
                    resume=self.leftover if self.options.partial_rollout else (), first_index=self.next_index,
                    first_group=self.next_group, progress=True, health=health, slime_args=self.slime_args,
                    progress_desc=f"rollout {step + 1}/{self.cfg.rollout.num_rollout}")  # as the step line counts
        except EngineError as exc:  # as an error Ray can carry to the driver, which names the engine
            raise EngineFailure.of(exc) from None
        finally:
            if health is not None:
                self.dead = dict(health.reasons)
            for c in clients:
                await c.aclose()
        failed = self.reward_fn.failures.check_step(reward_mark, step)  # raises when every sample failed
        groups = result.groups
        if not groups:
            raise RolloutStarved(f"the rollout of step {step} kept no group before --rollout-deadline-s "
                                 f"{self.cfg.rollout.rollout_deadline_s}; nothing to train on")
        self.leftover = result.leftover
        self.next_index, self.next_group = result.next_index, result.next_group
        await self._put(step, groups, buffer)
        timeouts = self.reward_fn.failures.timeouts_since(reward_mark)
        return (rollout_metrics(groups) | result.metrics | {"rollout/reward_failures": float(failed),
                                                             "rollout/reward_timeouts": float(timeouts)}
                | {"time/rollout_start": start, "time/rollout_end": time.time()})

    async def _take_from_stream(self, step: int, buffer) -> dict[str, float]:
        """--fully-async: the step's groups from the never-stopping rollout (rollout/stream.py), started by the
        first step; the trainer is at weight version `step` (one update per step before it)."""
        start = time.time()
        roll = self.cfg.rollout
        if self.stream is None:
            pool = ClientPool(self._clients(), self.tokenizer, self.options.concurrency_per_engine,
                              self.options.rollout_max_context_len, sample_seed=self.options.sample_seed,
                              return_routed_experts=self.options.return_routed_experts)
            self.stream = GroupStream(
                pool, self.dataset.next_batch, self.options, self.reward_fn,
                rollout_generate_function(self.options, self.slime_args),
                load_filter(self.options.dynamic_sampling_filter_path, self.slime_args,
                            self.options.dynamic_sampling_filter_kwargs),
                resume=self.leftover, first_index=self.next_index, first_group=self.next_group)
            self.leftover = []
            self.stream.start()
        reward_mark = self.reward_fn.failures.mark()
        try:
            groups, metrics = await self.stream.take(roll.rollout_batch_size, version=step,
                                                     max_staleness=roll.max_staleness,
                                                     deadline_s=roll.rollout_deadline_s)
        except EngineError as exc:
            raise EngineFailure.of(exc) from None
        failed = self.reward_fn.failures.check_step(reward_mark, step)
        if not groups:
            raise RolloutStarved(f"the rollout of step {step} has no finished group to train on (--fully-async: the "
                                 "prompts ran out, or --rollout-deadline-s passed, or --max-staleness dropped every "
                                 "group)")
        if step + 1 >= roll.num_rollout:  # the last step: nothing more will be taken
            await self.stream.close()
        await self._put(step, groups, buffer)
        return (rollout_metrics(groups) | metrics | {"rollout/reward_failures": float(failed)}
                | {"time/rollout_start": start, "time/rollout_end": time.time()})

    async def replay(self, step: int, buffer) -> dict[str, float]:
        """--load-debug-rollout-data: the step's groups read from its file (as --save-debug-rollout-data
        wrote them: rewards, engine log-probs and loss masks as saved, nothing generated or scored again)
        and put in the buffer as `generate` puts a generated rollout; returns the rollout metrics."""
        start = time.time()
        self._state_before = {step: self.state_dict()}  # nothing is drawn: a checkpoint keeps the position
        roll = self.cfg.rollout
        groups = read_debug_rollout(self.cfg.debug.load_rollout_path(step), step, roll.rollout_batch_size,
                                    roll.n_samples_per_prompt, self.cfg.trainer.use_rollout_routing_replay,
                                    self.cfg.reward.reward_key)
        await self._put(step, groups, buffer)
        return rollout_metrics(groups) | {"time/rollout_start": start, "time/rollout_end": time.time()}

    async def _put(self, step: int, groups: list[list[Sample]], buffer) -> None:
        """The step's groups: the dumps the flags ask for, then the trainer's batch into the buffer."""
        if self.cfg.logging.dump_rollouts:
            dump_rollouts(Path(self.cfg.logging.run_dir) / "rollouts" / f"step_{step:06d}.jsonl", groups)
        if self.cfg.debug.save_rollout_data is not None:
            save_debug_data(self.cfg.debug.rollout_data_path(step), debug_rollout_data(step, groups))
        await buffer.put.remote(step, samples_to_batch(groups, self.cfg.algo, self.cfg.rollout.max_response_len))

    def _draw_guard(self, step: int):
        """The dataset's next_batch, stopping the run once one rollout has drawn every prompt
        MAX_EPOCHS_PER_ROLLOUT times without filling its batch (the filter keeps next to nothing:
        the data is exhausted for it) instead of drawing forever."""
        cap = MAX_EPOCHS_PER_ROLLOUT * len(self.dataset)
        drawn = 0

        def next_rows(n: int) -> list:
            nonlocal drawn
            if drawn and drawn + n > cap:
                raise RolloutStarved(
                    f"the rollout of step {step} drew {drawn} prompts ({MAX_EPOCHS_PER_ROLLOUT} passes over the "
                    f"{len(self.dataset)} prompts of --prompt-data) and --dynamic-sampling-filter-path "
                    f"{self.cfg.rollout.dynamic_sampling_filter_path} kept fewer than --rollout-batch-size "
                    f"{self.cfg.rollout.rollout_batch_size} groups: the data is exhausted for this filter")
            drawn += n
            return self.dataset.next_batch(n)
        return next_rows

    def _health(self) -> EngineHealth | None:
        f = self.cfg.fault
        if not f.use_fault_tolerance:
            return None
        health = EngineHealth(len(self.engine_urls), interval_s=f.health_check_interval_s,
                              timeout_s=f.health_check_timeout_s)
        health.reasons.update(self.dead)
        return health

    def rewind(self, step: int) -> None:
        """Rollout `step` failed (every engine died): back to the state before it, so that running it
        again draws the same prompts and numbers the samples the same."""
        self.load_state_dict(self._state_before[step])

    def dead_engines(self) -> dict[int, str]:
        """Engines declared dead by a rollout and not yet revived, with the reason."""
        return dict(self.dead)

    def revive_engine(self, engine_id: int, url: str) -> None:
        """The cluster restarted this engine (new URL) and gave it the current weights."""
        self.engine_urls[engine_id] = url
        self.dead.pop(engine_id, None)

    async def evaluate(self) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """eval/<name>/reward_mean and pass@k on every --eval-prompt-data set, and the
        --log-eval-generations samples to show (`rollout.eval.pick_generations`)."""
        ev = self.cfg.eval
        out: dict[str, float] = {}
        groups_by_set = {}
        clients = self._clients(live_only=True)  # eval has no failover: it just skips dead engines
        # eval samples come from the run's generate function, as slime's eval does (a slime function with an
        # `evaluation` parameter gets True): a custom or agent rollout that scores its samples scores these too
        generate_fn = rollout_generate_function(self.options, self.slime_args)
        if isinstance(generate_fn, SlimeGenerate):
            generate_fn = generate_fn.for_eval()
        try:
            for name, rows in self.eval_sets.items():
                reward = self.eval_rewards.get(name, self.reward_fn)
                groups = await generate_eval(clients, rows, eval_samples_per_prompt(ev, name),
                                             eval_sampling_params(ev, name), reward, self.tokenizer,
                                             generate_fn=generate_fn,
                                             concurrency_per_engine=self.options.concurrency_per_engine,
                                             sample_seed=self.options.sample_seed, progress=True,
                                             progress_desc=f"eval {name}")
                groups_by_set[name] = groups
                out |= {f"eval/{name}/{k}": v for k, v in summarize(rewards_of(groups)).items()}
        finally:
            for c in clients:
                await c.aclose()
        return out, pick_generations(groups_by_set, ev.log_generations)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able: data position, sample/group counters, and the partial groups to continue (--fully-async:
        the stream's queued and in-flight groups as far as they got, continued first after a resume)."""
        leftover, next_index, next_group = self.leftover, self.next_index, self.next_group
        if self.stream is not None:
            leftover, next_index, next_group = self.stream.snapshot()
        return {"data": self.dataset.state_dict(), "next_index": next_index, "next_group": next_group,
                "leftover": [[_jsonable(dataclasses.asdict(s)) for s in g] for g in leftover]}

    def state_before(self, step: int) -> dict[str, Any]:
        """The state as it was before rollout `step` started (now, if it has not started)."""
        return self._state_before.get(step) or self.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state["data"])
        self.next_index, self.next_group = int(state["next_index"]), int(state["next_group"])
        self.leftover = [[Sample(**s) for s in g] for g in state.get("leftover", [])]

