"""Brings the run's actors up on Ray and down again: placement group, engines, trainer group (and
PPO's critic group), RolloutManager and Buffer. The driver (train.py) sees only generate / train / sync_weights.
Train-only (--load-debug-rollout-data): the plan holds no engine, so none is started, and each rollout
is read back from its file by the RolloutManager."""

from __future__ import annotations

import os
import time
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime_rl.config import Config
from slime_rl.engines.client import EngineClient
from slime_rl.engines.payloads import lora_adapter_name
from slime_rl.orchestration.buffer import Buffer
from slime_rl.orchestration.engines import EngineActor, engine_command, engine_env, engines_back_up_weights
from slime_rl.orchestration.failures import root_cause
from slime_rl.orchestration.nodes import join_cluster, ray_init
from slime_rl.orchestration.placement import PlacementPlan
from slime_rl.orchestration.rollout_manager import RolloutManager
from slime_rl.orchestration.trainer_group import CRITIC, RankGroup, TrainerRankError
from slime_rl.rollout.health import NoLiveEngineError
from slime_rl.trainer.checkpoint_layout import keep_last
from slime_rl.weight_sync.broadcast import EngineTarget
from slime_rl.weight_sync.colocated import MEMORY_TAGS, RESUME_AFTER_SYNC, RESUME_BEFORE_SYNC


def init_ray(plan: PlacementPlan) -> None:
    """Join the cluster of RAY_ADDRESS (the launch scripts' `ray start`), or start a local one sized for the plan."""
    if os.environ.get("RAY_ADDRESS"):
        join_cluster(os.environ["RAY_ADDRESS"])
        return
    # Ray's CPU slots are logical: a 2-core laptop still gets one slot per bundle.
    cpus = int(sum(b.get("CPU", 1.0) for b in plan.bundles))  # colocated bundles hold two actors
    ray_init(num_cpus=max(cpus + 1, os.cpu_count() or 1), include_dashboard=False, log_to_driver=True)


def colocated_visible_devices(plan: PlacementPlan, ranks: list[tuple[str, str | None]]) -> dict[tuple[int, int], str]:
    """--colocate on GPUs, engines of more than one GPU per node part: CUDA_VISIBLE_DEVICES of each such part
    (keyed by engine id and node part), the GPUs of the trainer ranks it runs beside (`ranks[r]`: rank r's
    node and visible GPUs) in its TP order, so its TP rank i runs on the GPU of the rank in its bundle i.
    Raises when one part's ranks are on several nodes."""
    out = {}
    for slot in plan.engines:
        if slot.gpus_per_node == 1:
            continue
        for k in range(slot.nodes):
            mine = [ranks[plan.trainer_bundles.index(b)] for b in slot.part(k)]
            nodes = sorted({node for node, _ in mine})
            if len(nodes) > 1:
                raise RuntimeError(f"--colocate: engine {slot.engine_id} runs beside trainer ranks on nodes "
                                   f"{', '.join(nodes)}; its --rollout-num-gpus-per-engine {slot.num_gpus} GPUs must "
                                   "be on one node (give a number that divides --actor-num-gpus-per-node)"
                                   if slot.nodes == 1 else
                                   f"--colocate: node part {k} of engine {slot.engine_id} runs beside trainer ranks on "
                                   f"nodes {', '.join(nodes)}; each part's {slot.gpus_per_node} GPUs must be on one "
                                   "node")
            if any(not gpus or "," in gpus for _, gpus in mine):
                raise RuntimeError(f"--colocate: the trainer ranks beside engine {slot.engine_id} do not each see one "
                                   f"GPU (CUDA_VISIBLE_DEVICES {[g for _, g in mine]})")
            out[slot.engine_id, k] = ",".join(gpus for _, gpus in mine)
    return out


# --use-fault-tolerance: a rollout whose every engine died is generated again after the restart (this
# many times per step), and a weight sync that failed with an engine dead is retried after the restart
MAX_ROLLOUT_RESTARTS = 3
MAX_SYNC_RETRIES = 2
ACTOR_EXIT_GRACE_S = 10.0  # Cluster.shutdown: how long an actor may take to exit before it is killed


class Cluster:
    def __init__(self, cfg: Config, plan: PlacementPlan, api_key: str | None) -> None:
        self.cfg, self.plan, self.api_key = cfg, plan, api_key
        self.pg = None
        self.engines: list = []  # each engine's actor (of its node part 0, which serves HTTP)
        self.engine_parts: list[list] = []  # each engine's actors of its node parts 1.. (an engine over nodes)
        self.engine_urls: list[str] = []
        self.bootstrap_ports: dict[int, int] = {}  # prefill engine id -> its bootstrap port
        self._released = False  # --colocate: the engines' memory is released since the last sync
        self.router = None  # --use-sglang-router: the RouterActor, and router_url its address
        self.router_url: str | None = None
        self.trainers: RankGroup | None = None
        self.critics: RankGroup | None = None  # PPO
        self.rollout_manager = None
        self.buffer = None
        self.targets: list[EngineTarget] = []
        self._revived: dict[int, str] = {}  # restarted engines, handed to the rollout side after a sync
        self._rollout_steps: dict = {}  # generate_async's refs -> their step (to run one again)
        self.weight_version = "0"  # of the last sync: what a restarted engine gets again
        # --load-debug-rollout-data: rollouts are read from files; no engine, router or weight sync
        self.train_only = cfg.debug.train_only

    def start(self, train_iters: int) -> None:
        init_ray(self.plan)
        self.pg = placement_group(list(self.plan.bundles), strategy="PACK")
        ray.get(self.pg.ready())
        visible: dict[tuple[int, int], str] = {}
        if self.plan.colocated and self.plan.use_gpu and any(s.gpus_per_node > 1 for s in self.plan.engines):
            # the ranks' actors first (their build starts below): an engine's process sees their GPUs
            self.trainers = self._trainer_group()
            visible = colocated_visible_devices(self.plan, self.trainers.nodes_and_gpus())
        urls, targets, started = [], [], []
        embedded = self.cfg.engine.backend == "embedded"  # listens on the port its actor holds for it
        for slot in self.plan.engines:
            # one actor per node part (one unless the engine spans nodes), each in its part's first bundle, with
            # all of its part's GPUs (SGLang --tp-size N over them); 0.5 when colocated: shared with a trainer
            # rank (a part of several GPUs then sees the GPUs of the ranks it runs beside, not only its bundle's)
            parts = [EngineActor.options(
                num_cpus=1, num_gpus=self.plan.engine_actor_gpu(slot),
                runtime_env={"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
                if (slot.engine_id, k) in visible else None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, slot.part(k)[0]),
            ).remote(slot.engine_id) for k in range(slot.nodes)]
            host, port = ray.get([parts[0].node_ip.remote(), parts[0].pick_port.remote(hold=embedded)])
            self.engines.append(parts[0])
            self.engine_parts.append(parts[1:])
            urls.append(f"http://{host}:{port}")
            targets.append(EngineTarget(urls[-1], slot.rank_offset, self.api_key, pullers=tuple(parts)))
            env = engine_env(self.cfg, self.api_key)
            # an engine over several nodes: its TP ranks meet at a port of node part 0; parts 1.. serve no HTTP
            dist_init = f"{host}:{ray.get(parts[0].spare_port.remote())}" if slot.nodes > 1 else None
            # a prefill engine (--prefill-num-servers, --sglang-config): its decode partners fetch the KV cache
            # through a bootstrap server on its first node
            bootstrap = None
            if self.cfg.engine.role(slot.engine_id)[0] == "prefill":
                bootstrap = self.bootstrap_ports[slot.engine_id] = ray.get(parts[0].spare_port.remote())
            for k, actor in enumerate(parts):
                part_env = env | ({"CUDA_VISIBLE_DEVICES": visible[slot.engine_id, k]}
                                  if (slot.engine_id, k) in visible else {})
                if k == 0:
                    cmd = engine_command(self.cfg, slot, host, port, self.api_key, self.plan.use_gpu,
                                         dist_init_addr=dist_init, bootstrap_port=bootstrap)
                    started.append(actor.start.remote(cmd, urls[-1], env=part_env))
                else:
                    part_host, part_port = ray.get([actor.node_ip.remote(), actor.spare_port.remote()])
                    cmd = engine_command(self.cfg, slot, part_host, part_port, self.api_key, self.plan.use_gpu,
                                         node_rank=k, dist_init_addr=dist_init, bootstrap_port=bootstrap)
                    started.append(actor.start_part.remote(cmd, env=part_env))
        # the rollout side (its imports, tokenizer, prompt data, reward function) and the trainer ranks
        # (Megatron) build while the engines load; the router, started once they are healthy, is
        # handed to the RolloutManager then
        self.buffer = Buffer.remote()
        self.rollout_manager = RolloutManager.remote(self.cfg, urls, self.api_key)
        if self.trainers is None:
            self.trainers = self._trainer_group()
        critic_world = self.cfg.critic.world_size if self.cfg.critic else 0
        threads = max(1, (os.cpu_count() or 1) // (self.cfg.parallel.world_size + critic_world))
        if self.cfg.critic is not None:  # PPO: the critic builds at the same time
            self.critics = RankGroup(self.cfg, self.pg, self.plan.critic_bundles, self.plan.use_gpu, role=CRITIC)
            critic_ready = self.critics.init_async(train_iters, threads)
        self.trainers.init(train_iters, threads)
        if self.critics is not None:
            self.critics.wait_init(critic_ready)
        ray.get(started)
        self.engine_urls = urls
        if self.cfg.engine.use_router and not self.train_only:
            from slime_rl.orchestration.router import start_router

            self.router, self.router_url = start_router(self.cfg, urls, self.api_key,
                                                        bootstrap_ports=self.bootstrap_ports)
            ray.get(self.rollout_manager.use_router.remote(self.router_url))
        self.targets = targets
        if self.train_only:  # --load-debug-rollout-data: the plan holds no engine, the trainer sends no weights
            assert not self.plan.engines, "a train-only plan holds no engine"
            return
        if self.plan.colocated:  # engine e's TP rank i shares the device of the trainer rank in its bundle i
            self.trainers.connect_colocated(targets, [[self.plan.trainer_bundles.index(b) for b in slot.bundles]
                                                      for slot in self.plan.engines])
        else:
            self.trainers.connect_engines(targets, self.plan.weight_update_world_size)

    def _trainer_group(self) -> RankGroup:
        return RankGroup(self.cfg, self.pg, self.plan.trainer_bundles, self.plan.use_gpu, num_gpus=self.plan.actor_gpu)

    def generate(self, step: int) -> dict[str, float]:
        return self.wait(self.generate_async(step))

    def generate_async(self, step: int):
        """Start rollout `step` (train-only: read it from --load-debug-rollout-data's file); the batch
        lands in the buffer, the metrics in the returned ref."""
        rollout = self.rollout_manager.replay if self.train_only else self.rollout_manager.generate
        ref = rollout.remote(step, self.buffer)
        self._rollout_steps[ref] = step
        return ref

    def wait(self, ref) -> dict[str, float]:
        """The metrics of a rollout started by `generate_async`. --use-fault-tolerance: when every
        engine died during it (NoLiveEngineError; with one engine, that one), the rollout side goes
        back to where the step began, the dead engines are restarted with the current weights, and
        the step is generated again, at most MAX_ROLLOUT_RESTARTS times: same prompts, same sample
        numbers, none lost and none twice."""
        step = self._rollout_steps.pop(ref, None)
        restarts = 0
        while True:
            try:
                metrics = ray.get(ref)
                return metrics | {"fault/rollout_restarts": float(restarts)} if restarts else metrics
            except ray.exceptions.RayTaskError as exc:
                if (not isinstance(root_cause(exc), NoLiveEngineError) or step is None
                        or not self.cfg.fault.use_fault_tolerance or restarts >= MAX_ROLLOUT_RESTARTS):
                    raise
                restarts += 1
                print(f"[slime_rl] rollout of step {step}: every engine died ({root_cause(exc)}); restarting them "
                      f"with the current weights and generating the step again ({restarts}/{MAX_ROLLOUT_RESTARTS})",
                      flush=True)
            ray.get(self.rollout_manager.rewind.remote(step))
            self.heal_engines()
            self.sync_weights(version=self.weight_version)
            ref = self.rollout_manager.generate.remote(step, self.buffer)

    def wait_done(self, ref) -> None:
        ray.wait([ref], num_returns=1, timeout=None, fetch_local=False)

    def save(self, step: int) -> None:
        """After `step`: --save's checkpoint (trainer state on every rank + the rollout side's
        position) and --save-hf's HF folder (the weights, gathered from every stage)."""
        ckpt = self.cfg.checkpoint
        if ckpt.save:
            rollout_state = ray.get(self.rollout_manager.state_before.remote(step + 1))
            self.trainers.save_checkpoint(ckpt.save, step, {"rollout_id": step, "rollout": rollout_state})
            if self.critics is not None and self.cfg.critic.save:
                self.critics.save_checkpoint(self.cfg.critic.save, step, {"rollout_id": step})
            if ckpt.keep_last is not None:
                keep_last(ckpt.save, ckpt.keep_last)
        if ckpt.save_hf:
            self.trainers.save_hf(ckpt.hf_path(step))

    def resume(self) -> int:
        """--load: restore the newest complete checkpoint and push its weights to the engines.
        Returns the first step to run (0 when there is nothing to resume). A fresh start with --lora-load
        pushes the loaded adapters (the engines loaded the base alone)."""
        step = self._resume()
        if step == 0 and self.cfg.model.lora_load and not self.train_only:
            self.sync_weights(version=self.weight_version)
        return step

    def _resume(self) -> int:
        if not self.cfg.checkpoint.load:
            return 0
        from slime_rl.trainer.checkpoint_layout import choose_checkpoint

        # preflight checked the choice; made again here, the folder is what the ranks load
        folder = choose_checkpoint(self.cfg.checkpoint.load, self.cfg.checkpoint.ckpt_step)
        if folder is None:
            print(f"[slime_rl] --load {self.cfg.checkpoint.load}: no checkpoint there yet, starting fresh")
            return 0
        extra = self.trainers.load_latest_checkpoint(str(folder))
        if extra is None:  # a Megatron-LM folder: weights only, counted from step 0
            print(f"[slime_rl] --load {folder}: model weights only (no slime_rl state); starting at step 0")
            return 0
        ray.get(self.rollout_manager.load_state_dict.remote(extra["rollout"]))
        step = int(extra["rollout_id"]) + 1
        if self.critics is not None:
            self._resume_critic(step - 1)
        if not self.train_only:  # the engines get the checkpoint's weights
            self.sync_weights(version=str(step))
        print(f"[slime_rl] resumed from step {step - 1} ({folder})")
        return step

    def _resume_critic(self, step: int) -> None:
        """The critic must resume from the same step as the policy (--critic-save holds it)."""
        root = self.cfg.critic.save
        if root:  # the critic's checkpoint of the policy's step, also when later ones follow it
            from slime_rl.trainer.checkpoint_layout import is_complete, iter_dir

            root = str(iter_dir(root, step)) if is_complete(iter_dir(root, step)) else root
        extra = self.critics.load_latest_checkpoint(root) if root else None
        if extra is None or int(extra["rollout_id"]) != step:
            raise ValueError(f"--load resumes the policy at step {step} but --critic-save {root} holds no critic "
                             f"checkpoint of that step (found: {None if extra is None else extra['rollout_id']})")

    def evaluate(self) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """The eval metrics, and the --log-eval-generations samples (dataset, prompt, response, label, reward)."""
        return ray.get(self.rollout_manager.evaluate.remote())

    def train(self, step: int) -> dict[str, float]:
        start = time.time()
        if self.critics is None:
            metrics = self.trainers.train(step, self.buffer)
        else:  # PPO: critic values -> GAE and the policy update -> the critic update on the returns,
            # through the step's buffer entry, read once by each policy rank and twice by each critic rank
            readers = self.cfg.parallel.world_size + 2 * self.cfg.critic.world_size
            self.critics.compute_values(step, self.buffer, readers)
            update = step >= self.cfg.critic.num_critic_only_steps
            metrics = self.trainers.train_ppo(step, self.buffer, readers, update)
            metrics |= self.critics.train_critic(step, self.buffer, readers)
        return metrics | {"time/train_start": start, "time/train_end": time.time()}

    def release_engines(self) -> None:
        """--colocate, after the rollout: every engine frees its weights, KV cache and CUDA graphs for
        training (SGLang drops released weights: the next sync must send all of them)."""
        self._on_engines("release_memory_occupation", MEMORY_TAGS)
        self._released = True

    def _on_engines(self, endpoint: str, tags: list[str]) -> None:
        for url in self.engine_urls:
            with EngineClient(url, api_key=self.api_key) as client:
                getattr(client, endpoint)(tags)

    def sync_weights(self, version: str) -> dict[str, float]:
        """Broadcast the trainer's weights as `version`. --use-fault-tolerance: when the sync fails and
        an engine is dead (killed during the broadcast), the dead engines are restarted, the group is
        re-created and the sync runs again, at most MAX_SYNC_RETRIES times."""
        retries = 0
        while True:
            try:
                metrics = self._sync_weights(version)
                self.weight_version = version
                return metrics | {"fault/weight_sync_retries": float(retries)} if retries else metrics
            except TrainerRankError as exc:
                if not self.cfg.fault.use_fault_tolerance or retries >= MAX_SYNC_RETRIES:
                    raise
                timeout = self.cfg.fault.health_check_timeout_s
                alive = ray.get([e.alive.remote(timeout) for e in self.engines])
                if all(alive):
                    raise  # no engine died: the trainer's own failure
                retries += 1
                dead = [k for k, ok in enumerate(alive) if not ok]
                print(f"[slime_rl] weight sync {version} failed with engine(s) {dead} dead ({exc}); restarting them "
                      f"and syncing again ({retries}/{MAX_SYNC_RETRIES})", flush=True)
                self.heal_engines()

    def _sync_weights(self, version: str) -> dict[str, float]:
        start = time.time()
        # colocated: only what was released is resumed (SGLang refuses to resume a tag it holds);
        # the weights first, then the sync refills them, then the KV cache and CUDA graphs
        released, self._released = self._released, False
        resumed: dict[str, float] = {}
        if released:
            t = time.perf_counter()
            self._on_engines("resume_memory_occupation", RESUME_BEFORE_SYNC)
            resumed["perf/resume_weights_s"] = time.perf_counter() - t
        # a release drops the engines' weights unless they keep a host copy, which the resume puts back
        dropped = released and not engines_back_up_weights(self.cfg)
        metrics = self.trainers.sync_weights(version, weights_dropped=dropped)
        if self.cfg.model.adapter_sync:
            # the rollout's requests name the adapters just loaded (the version before unloads at the next sync)
            ray.get(self.rollout_manager.use_adapter.remote(lora_adapter_name(version)))
        if released:
            t = time.perf_counter()
            self._on_engines("resume_memory_occupation", RESUME_AFTER_SYNC)
            resumed["perf/resume_kv_cache_s"] = time.perf_counter() - t
        metrics |= resumed
        # restarted engines hold the current weights now: only now may they get requests
        ray.get([self.rollout_manager.revive_engine.remote(k, url) for k, url in self._revived.items()])
        self._revived.clear()
        return metrics | {"time/sync_start": start, "time/sync_end": time.time()}

    def heal_engines(self) -> int:
        """--use-fault-tolerance, between rollouts: restart every engine that a rollout declared dead
        or that fails its health check now, in its own actor (same placement bundle), on a new port;
        then re-create the weight-update group with every engine. Returns how many were restarted;
        the caller must `sync_weights` before the next rollout (the restarted engines get requests
        only after that)."""
        timeout = self.cfg.fault.health_check_timeout_s
        dead = dict(ray.get(self.rollout_manager.dead_engines.remote()))
        alive = ray.get([e.alive.remote(timeout) for e in self.engines])
        dead = {k: "failed its health check between rollouts" for k, ok in enumerate(alive) if not ok} | dead
        if not dead:
            return 0
        restarts = []
        embedded = self.cfg.engine.backend == "embedded"
        for k in sorted(dead):
            slot, actor = self.plan.engines[k], self.engines[k]
            host, port = ray.get([actor.node_ip.remote(), actor.pick_port.remote(hold=embedded)])
            url = f"http://{host}:{port}"
            print(f"[slime_rl] restarting engine {k} ({dead[k]}) at {url}", flush=True)
            cmd = engine_command(self.cfg, slot, host, port, self.api_key, self.plan.use_gpu)
            restarts.append(actor.restart.remote(cmd, url))
            self.targets[k] = EngineTarget(url, slot.rank_offset, self.api_key,
                                           pullers=(actor, *self.engine_parts[k]))
            self.engine_urls[k] = url
            self._revived[k] = url
        ray.get(restarts)
        # a new group per re-join: the old one has a dead member, and a collective cannot shrink
        self.trainers.connect_engines(self.targets, self.plan.weight_update_world_size)
        return len(dead)

    def shutdown(self, failed: bool = False) -> None:
        """`failed`: a trainer or critic rank failed, so the ranks are killed rather than asked to stop
        (the others may wait in a collective for the failed one). Every part is stopped even when
        another part's stop fails (a dead actor, an engine gone)."""
        def attempt(what: str, fn) -> None:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001  (the rest must still be stopped)
                print(f"[slime_rl] {what}: {exc}", flush=True)

        for group, name in ((self.trainers, "trainer"), (self.critics, "critic")):
            if group is not None:
                attempt(f"{name} {'kill' if failed else 'shutdown'}", group.kill if failed else group.shutdown)
        if self.router is not None:  # before the engines: it would mark them dead and log errors
            attempt("router stop", lambda: ray.get(self.router.stop.remote()))
        for k, engine in enumerate(self.engines):
            attempt(f"engine {k} stop", lambda e=engine: ray.get(e.stop.remote()))
        for k, parts in enumerate(self.engine_parts):
            for n, part in enumerate(parts, start=1):
                attempt(f"engine {k} node part {n} stop", lambda e=part: ray.get(e.stop.remote()))
        # every actor's process ends here, not at Ray's shutdown: Ray ends the job's workers with SIGTERM,
        # whose handler raises SystemExit in whatever Python code runs at that moment (a weakref callback
        # prints "Exception ignored ... Traceback" into the driver's log). Each actor is asked to exit as an
        # actor does (__ray_terminate__: after the calls queued before it; its atexit handlers run, so what
        # they flush is written); one still there after ACTOR_EXIT_GRACE_S (a call that does not return) is
        # killed (ray.kill: at once, silently)
        actors = [a for group in (self.trainers, self.critics) if group is not None for a in group.actors]
        actors += [a for a in (self.router, *self.engines, *(p for parts in self.engine_parts for p in parts),
                               self.rollout_manager, self.buffer)
                   if a is not None]
        exits = []
        for actor in actors:
            attempt("actor exit", lambda a=actor: exits.append((a, a.__ray_terminate__.remote())))
        if exits:
            _, pending = ray.wait([ref for _, ref in exits], num_returns=len(exits), timeout=ACTOR_EXIT_GRACE_S)
            for actor, ref in exits:
                if ref in pending:
                    attempt("actor kill", lambda a=actor: ray.kill(a))
        if self.pg is not None:
            attempt("placement group removal", lambda: remove_placement_group(self.pg))
