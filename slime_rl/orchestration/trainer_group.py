"""The trainer groups: one Ray actor per Megatron rank (RankActor), each in its own placement bundle,
and a handle on all of a group's ranks (RankGroup). The same two classes serve the policy and, for
PPO, the critic (`role`): the critic's ranks are a second group with their own process group,
placement bundles, optimizer and LR.

PPO's per-sample data moves through the step's Buffer entry, not through the driver: each critic
rank adds the values of its DP shard to the batch (`StepBuffer.put_rows`), each policy rank reads the
batch with them, takes its own shard, and adds its shard's GAE returns, which each critic rank then
reads for its own shard (`StepBuffer.get_rows`)."""

from __future__ import annotations

import os
import time
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime_rl.config import Config
from slime_rl.orchestration.engines import free_port
from slime_rl.orchestration.placement import balanced_dp_shard, dp_shard
from slime_rl.trainer.debug_data import TrainDataDump  # plain Python, no megatron: the driver may import it
from slime_rl.weight_sync.adapter import AdapterSender
from slime_rl.weight_sync.broadcast import GROUP_NAME, EngineTarget, WeightBroadcaster, in_stage_order
from slime_rl.weight_sync.colocated import ColocatedUpdater, EngineShare, PipelineStages
from slime_rl.weight_sync.disk import DiskUpdater

POLICY, CRITIC = "policy", "critic"
ROLES = (POLICY, CRITIC)
# how the error names a rank of each group: the policy's ranks are "the trainer ranks" to the user
_RANK_NAME = {POLICY: "trainer", CRITIC: "critic"}
LOAD_WHAT = "checkpoint load of"  # a failed load's message: "... failed during checkpoint load of <folder>"
# how long a graceful stop of the ranks may take (a rank frees its model and process groups)
SHUTDOWN_TIMEOUT_S = 60.0


class TrainerRankError(RuntimeError):
    """A trainer (or critic) rank raised or died: names the rank and what it was doing."""

    def __init__(self, rank: int, what: str, cause: BaseException, role: str = POLICY) -> None:
        self.rank, self.what, self.role = rank, what, role
        # the rank's own exception, not Ray's wrapper of it ("RayTaskError(RuntimeError)" and a traceback)
        inner = cause.cause if isinstance(cause, ray.exceptions.RayTaskError) and cause.cause is not None else cause
        lines = str(inner).strip().splitlines()
        super().__init__(f"{_RANK_NAME[role]} rank {rank} failed during {what}: {type(inner).__name__}: "
                         f"{lines[-1] if lines else ''}")


def gather_ranks(refs: list, what: str, role: str = POLICY) -> list:
    """Every rank's result, in rank order. The first rank to fail raises `TrainerRankError` at
    once: the other ranks may be blocked in a collective waiting for it, so they are not awaited."""
    results: list = [None] * len(refs)
    pending = {ref: r for r, ref in enumerate(refs)}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            rank = pending.pop(ref)
            try:
                results[rank] = ray.get(ref)
            except ray.exceptions.RayError as e:  # a task error, a dead actor, or an error Ray cannot rebuild
                raise TrainerRankError(rank, what, e, role) from e
    return results


def _select(batch: dict[str, Any], indices: list[int]) -> dict[str, Any]:
    return {k: [v[i] for i in indices] for k, v in batch.items()}


def _master_address() -> tuple[str, int]:
    """This node's address and a free port: rank 0 of a Megatron group hosts its rendezvous there."""
    ip = ray.util.get_node_ip_address()
    return ip, free_port(ip)  # the store binds this address alone (trainer.parallel.rendezvous_store)


def _set_cpu_threads(threads: int) -> None:
    """On CPU each rank gets its share of the cores (the ranks share the node's cores)."""
    if not torch.cuda.is_available():
        torch.set_num_threads(threads)


def _pull_on_hosts(target: EngineTarget, args: tuple) -> list[str]:
    """--update-weight-transport disk: each host of the engine `target` pulls the version (EngineActor.pull_weights,
    weight_sync/disk.pull), all at once; the folders they hold it in."""
    return ray.get([p.pull_weights.remote(*args) for p in target.pullers])


@ray.remote
class RankActor:
    """One Megatron rank of a trainer group: the policy's (trainer.worker.TrainerWorker, plus its part
    of the weight sync) or, for PPO, the critic's (trainer.critic.CriticWorker). The trainer modules
    are imported inside `init`, in the rank's own process: the driver, which imports this module,
    never builds a rank and so never pays for the megatron import."""

    def __init__(self, rank: int, world_size: int, role: str = POLICY) -> None:
        assert role in ROLES, role
        self.rank, self.world_size, self.role = rank, world_size, role
        self.worker = None
        self.broadcaster: WeightBroadcaster | ColocatedUpdater | None = None
        self.rejoins = 0  # groups re-created after an engine restart (--use-fault-tolerance)
        self._synced_once = False  # a frozen vision tower is sent by the first sync only
        self.adapters: AdapterSender | None = None  # --lora-sync adapter, on global rank 0
        self._critic_step: tuple[int, list[int], dict[str, Any], list] | None = None  # compute_values -> train_critic
        # Ray gives each actor its own GPU as cuda:0; on CPU one thread per rank avoids oversubscription
        os.environ["LOCAL_RANK"] = "0"

    def master_address(self) -> tuple[str, int]:
        return _master_address()

    def node_and_gpus(self) -> tuple[str, str | None]:
        """This rank's node address and the GPUs Ray made visible to it (CUDA_VISIBLE_DEVICES)."""
        return ray.util.get_node_ip_address(), os.environ.get("CUDA_VISIBLE_DEVICES")

    def init(self, cfg: Config, master_addr: str, master_port: int, train_iters: int, threads: int) -> None:
        _set_cpu_threads(threads)
        self.cfg = cfg
        if self.role == POLICY:
            from slime_rl.trainer.worker import TrainerWorker

            self.worker = TrainerWorker(self.rank, self.world_size, master_addr, master_port, cfg.parallel,
                                        cfg.batch, cfg.optimizer, cfg.model, cfg.algo, train_iters, trainer=cfg.trainer)
            return
        from slime_rl.trainer.critic import CriticWorker

        critic = cfg.critic
        self.worker = CriticWorker(self.rank, self.world_size, master_addr, master_port,
                                   critic.parallel(cfg.parallel), cfg.batch, critic.optimizer(cfg.optimizer),
                                   cfg.model, cfg.algo, train_iters, trainer=cfg.trainer)
        if critic.load and self.worker.load_latest_checkpoint(critic.load) is None:
            raise ValueError(f"--critic-load {critic.load}: no complete checkpoint there")

    def _shard(self, batch: dict[str, Any]) -> list[int]:
        """This rank's DP shard of a batch (indices in batch order): contiguous slices, or with
        --balance-data equal counts of balanced token counts."""
        gbs, rank, size = self.cfg.batch.global_batch_size, self.worker.dp_rank, self.worker.dp_size
        if self.cfg.batch.balance_data:
            return balanced_dp_shard([len(t) for t in batch["tokens"]], gbs, rank, size)
        return dp_shard(len(batch["tokens"]), gbs, rank, size)

    # ---- policy: training
    def train(self, step: int, buffer, readers: int | None = None) -> dict[str, float]:
        start = time.perf_counter()
        batch = ray.get(buffer.get.remote(step, readers=readers or self.world_size))
        fetched = time.perf_counter() - start
        metrics = self.worker.train_step(_select(batch, self._shard(batch)), dump=self._train_data_dump(step))
        return metrics | self.worker.last_timings | {"perf/train_fetch_s": fetched}

    def _train_data_dump(self, step: int) -> TrainDataDump | None:
        """--save-debug-train-data: where this rank's DP rank saves step `step`'s train data (None: off)."""
        debug = self.cfg.debug
        if debug.save_train_data is None:
            return None
        return TrainDataDump(debug.train_data_path(step, self.worker.dp_rank), step)

    def train_ppo(self, step: int, buffer, readers: int, update: bool) -> dict[str, float]:
        """PPO: GAE on the critic's values (put into the step's batch by `compute_values`), then the
        policy update unless `update` is false (--num-critic-only-steps); this DP shard's returns
        go into the buffer for the critic (`train_critic`). Returns the metrics."""
        batch = ray.get(buffer.get.remote(step, readers=readers))
        values = batch.pop("values")
        batch.pop("returns", None)  # the shards of the policy ranks that have already trained
        idx = self._shard(batch)
        shard = _select(batch, idx)
        inputs = self.worker.step_inputs(shard, [values[i] for i in idx])
        metrics = self.worker.train_step(shard, inputs, update, dump=self._train_data_dump(step))
        ray.get(buffer.put_rows.remote(step, "returns", idx, inputs.returns))
        return metrics

    # ---- critic
    def compute_values(self, step: int, buffer, readers: int) -> int:
        """The values of this DP shard's samples into the step's batch (the buffer's "values" rows);
        the shard and its values are kept for `train_critic`. Returns how many samples."""
        batch = ray.get(buffer.get.remote(step, readers=readers))
        idx = self._shard(batch)
        shard = _select(batch, idx)
        values = self.worker.compute_values(shard)
        self._critic_step = (step, idx, shard, values)
        ray.get(buffer.put_rows.remote(step, "values", idx, values))
        return len(idx)

    def train_critic(self, step: int, buffer, readers: int) -> dict[str, float]:
        """One critic update on the shard of `compute_values`, against the returns the policy ranks
        put into the buffer."""
        assert self._critic_step is not None and self._critic_step[0] == step, "compute_values of this step first"
        _, idx, shard, values = self._critic_step
        self._critic_step = None
        returns = ray.get(buffer.get_rows.remote(step, "returns", idx, readers=readers))
        return self.worker.train_step(shard, values, returns)

    # ---- policy: weights out
    def connect_engines(self, targets: list[EngineTarget], master_addr: str, master_port: int,
                        world_size: int) -> None:
        """Every rank: each PP stage's source joins the engines into its own group, one stage after
        another (an engine serves one group init at a time and blocks in it: see in_stage_order)."""
        in_stage_order(self.worker.pp_rank, self.worker.pp_size, dist.barrier,
                       lambda: self._connect_engines(targets, master_addr, master_port, world_size))

    def _connect_engines(self, targets: list[EngineTarget], master_addr: str, master_port: int,
                         world_size: int) -> None:
        if self.cfg.weight_sync.update_weight_transport == "disk":  # files, no group (weight_sync/disk.py)
            if isinstance(self.broadcaster, DiskUpdater):  # after an engine restart: the same versions go on
                self.broadcaster.set_engines(targets)
            else:
                self.broadcaster = DiskUpdater(targets, self.cfg.weight_sync, self.worker.is_weight_source,
                                               self.rank == 0, self.worker.pp_rank, self.worker.pp_size,
                                               self.cfg.model.hf_checkpoint)
            self._connect_adapters(targets)
            return
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        name = f"{GROUP_NAME}_pp{self.worker.pp_rank}"
        if self.broadcaster is not None:  # re-join after an engine restart: a fresh group, a fresh name
            self.broadcaster.destroy()
            self.rejoins += 1
            name += f"_r{self.rejoins}"
        self.broadcaster = WeightBroadcaster(targets, self.cfg.weight_sync, self.worker.is_weight_source,
                                             master_addr, master_port, world_size, backend, group_name=name)
        self.broadcaster.connect()
        self._connect_adapters(targets)

    def _connect_adapters(self, targets: list[EngineTarget]) -> None:
        """--lora-sync adapter: global rank 0 sends the adapters to every engine (weight_sync/adapter.py)."""
        if self.rank == 0 and self.cfg.model.adapter_sync:
            if self.adapters is not None:
                self.adapters.close()
            self.adapters = AdapterSender(targets, self.cfg.engine.num_gpus_per_engine)

    def connect_colocated(self, targets: list[EngineTarget], spans: list[list[int]]) -> None:
        """--colocate: engine e runs beside trainer ranks spans[e] (its TP rank i on spans[e][i]'s GPU);
        every rank joins the gather group of each engine of several devices (collective)."""
        share = EngineShare.create(self.rank, spans)
        self.broadcaster = ColocatedUpdater(targets, [e for e, ranks in enumerate(spans) if self.rank in ranks],
                                            self.cfg.weight_sync, share)
        self._connect_adapters(targets)

    def sync_weights(self, version: str, weights_dropped: bool = False) -> dict[str, float]:
        """All ranks. --lora-sync adapter: the base by the first sync (and after a release that dropped the
        engines' weights), adapters off; then the adapters alone, from global rank 0 (`AdapterSender`,
        without pausing the engines). Otherwise every weight, merged with its adapter in a LoRA run."""
        if not self.cfg.model.adapter_sync:
            return self._sync_weights(version, weights_dropped)
        metrics: dict[str, float] = {}
        if not self._synced_once or weights_dropped:
            self.worker.set_adapters_enabled(False)
            try:
                metrics = self._sync_weights(version, weights_dropped)
            finally:
                self.worker.set_adapters_enabled(True)
        state = self.worker.peft_adapter_state()
        if state is None:  # only global rank 0 holds the whole adapters
            return metrics
        sent = self.adapters.send(*state, version)
        for k in ("weight_sync/bytes", "weight_sync/seconds"):  # with the base's, when it went too
            sent[k] += metrics.get(k, 0.0)
        return metrics | sent

    def _sync_weights(self, version: str, weights_dropped: bool = False) -> dict[str, float]:
        """All ranks: rank 0 pauses the engines and opens their weight-update session (SGLang
        0.5.23 refuses updates outside one); the stages' sources send their layers one stage after
        another (in_stage_order: stages sending at once deadlock two engines); rank 0 closes the
        session and continues the engines. `weights_dropped`: the engines released their weights
        since the last sync (colocated), so they hold nothing and everything must be sent."""
        assert self.broadcaster is not None, "connect_engines first"
        if self.rank == 0:
            self.broadcaster.pause_engines()
            self.broadcaster.begin_update()
        dist.barrier()
        failed = True
        try:
            # a frozen vision tower is sent by the first sync of this trainer process (the engines may
            # have started from another checkpoint than a resumed trainer) and after every release
            # that dropped the engines' weights; otherwise never again: it cannot change
            skip = self._synced_once and not weights_dropped
            self._synced_once = True
            if isinstance(self.broadcaster, ColocatedUpdater):  # each engine from its own ranks: no cross-engine wait
                stages = None
                if self.worker.pp_size > 1:  # every rank needs every stage's tensors
                    stages = PipelineStages.exchange(self.worker.pp_group, self.worker.pp_rank,
                                                     self.worker.hf_weight_metadata(skip), self.worker.device)
                metrics = self.broadcaster.sync(self.worker.iter_hf_sources(skip_frozen=skip), version,
                                                own_session=False, stages=stages)
            else:
                metrics = in_stage_order(self.worker.pp_rank, self.worker.pp_size, dist.barrier,
                                         lambda: self.broadcaster.sync(self.worker.iter_hf_sources(skip_frozen=skip),
                                                                       version, own_session=False))
                if isinstance(self.broadcaster, DiskUpdater) and self.rank == 0:  # every stage has written
                    metrics = (metrics or {}) | self.broadcaster.publish(version, _pull_on_hosts)
            failed = False
            return metrics or {}
        finally:
            dist.barrier()
            if self.rank == 0:
                self.broadcaster.end_update(quiet=failed)
                self.broadcaster.continue_engines()

    def save_hf(self, path: str) -> str:
        return self.worker.save_hf(path)

    def hf_weights(self) -> dict[str, Any]:
        """Every HF-named tensor as numpy (all ranks must call: the gathers are collective)."""
        return {name: t.detach().float().cpu().numpy() for name, t in self.worker.iter_hf_weights()}

    # ---- both
    def save_checkpoint(self, root: str, step: int, extra: dict) -> str:
        return self.worker.save_checkpoint(root, step, extra)

    def load_latest_checkpoint(self, root: str) -> dict | None:
        return self.worker.load_latest_checkpoint(root)

    def shutdown(self) -> None:
        if self.adapters is not None:
            self.adapters.close()
        if self.broadcaster is not None:
            self.broadcaster.close()
        if self.worker is not None:
            self.worker.shutdown()


class RankGroup:
    """Handles to every rank of one group (the policy's or the critic's); methods call all ranks,
    fail fast naming the first rank that fails (`gather_ranks`), and return rank 0's answer."""

    def __init__(self, cfg: Config, placement_group, bundles: tuple[int, ...], use_gpu: bool,
                 num_gpus: float | None = None, role: str = POLICY) -> None:
        self.cfg, self.role = cfg, role
        world = cfg.parallel.world_size if role == POLICY else cfg.critic.world_size
        assert len(bundles) >= world, (role, bundles, world)
        self.actors = [
            RankActor.options(
                num_cpus=1, num_gpus=(1 if use_gpu else 0) if num_gpus is None else num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group, bundles[r]),
            ).remote(r, world, role)
            for r in range(world)
        ]

    def _all(self, calls: list, what: str) -> list:
        return gather_ranks(calls, what, self.role)

    def init_async(self, train_iters: int, threads: int) -> list:
        """Start building the ranks; returns the refs for `wait_init`."""
        addr, port = ray.get(self.actors[0].master_address.remote())
        return [a.init.remote(self.cfg, addr, port, train_iters, threads) for a in self.actors]

    def wait_init(self, refs: list) -> None:
        self._all(refs, "init")

    def init(self, train_iters: int, threads: int) -> None:
        self.wait_init(self.init_async(train_iters, threads))

    # ---- policy
    def connect_engines(self, targets: list[EngineTarget], world_size: int) -> None:
        # each PP stage's source hosts its own group's rendezvous; the stages join in turns (actor side)
        addrs = self._all([a.master_address.remote() for a in self.actors], "weight-update rendezvous")
        self._all([a.connect_engines.remote(targets, addr, port, world_size)
                   for a, (addr, port) in zip(self.actors, addrs, strict=True)], "weight-update group init")

    def connect_colocated(self, targets: list[EngineTarget], spans: list[list[int]]) -> None:
        self._all([a.connect_colocated.remote(targets, spans) for a in self.actors],
                  "colocated weight hand-over set-up")

    def nodes_and_gpus(self) -> list[tuple[str, str | None]]:
        """Each rank's node address and visible GPUs, in rank order (no `init` needed)."""
        return self._all([a.node_and_gpus.remote() for a in self.actors], "placement")

    def train(self, step: int, buffer, readers: int | None = None) -> dict[str, float]:
        return self._all([a.train.remote(step, buffer, readers) for a in self.actors], f"train step {step}")[0]

    def train_ppo(self, step: int, buffer, readers: int, update: bool) -> dict[str, float]:
        """The metrics of rank 0; every sample's returns are in the buffer afterwards."""
        return self._all([a.train_ppo.remote(step, buffer, readers, update) for a in self.actors],
                         f"train step {step}")[0]

    def sync_weights(self, version: str, weights_dropped: bool = False) -> dict[str, float]:
        """Bandwidth = bytes of every stage / the sum of the stages' times (they send one after another)."""
        results = [r for r in self._all([a.sync_weights.remote(version, weights_dropped) for a in self.actors],
                                        f"weight sync {version}") if r]
        total = sum(r["weight_sync/bytes"] for r in results)
        seconds = sum(r["weight_sync/seconds"] for r in results)
        # where the send's time goes, from the slowest sending rank (colocated ranks send at once):
        # building buckets (gathers, renames), filling the buffers, waiting for the engines' answers
        slowest = max(results, key=lambda r: r["weight_sync/seconds"])
        phases = {f"perf/weight_sync_{k[len('weight_sync/'):-len('_seconds')]}_s": slowest[k]
                  for k in ("weight_sync/build_seconds", "weight_sync/fill_seconds", "weight_sync/http_wait_seconds",
                            "weight_sync/device_wait_seconds") if k in slowest}
        # --lora-sync adapter (global rank 0): the adapters' tensor bytes and the seconds their loads took
        adapter = {k: r[k] for r in results for k in ("weight_sync/adapter_bytes", "perf/weight_sync_adapter_s")
                   if k in r}
        # --update-weight-transport disk (global rank 0): the engine hosts' pulls and the engines' loads, after the
        # stages wrote their parts (the send)
        disk = {f"perf/weight_sync_{k[len('weight_sync/'):-len('_seconds')]}_s": r[k] for r in results
                for k in ("weight_sync/pull_seconds", "weight_sync/load_seconds") if k in r}
        return {"weight_sync/bytes": total, "perf/weight_sync_GBps": total / seconds / 1e9,
                "perf/weight_sync_send_s": slowest["weight_sync/seconds"], **phases, **adapter, **disk}

    def save_hf(self, path: str) -> str:
        """--save-hf: every rank takes part (gathers), rank 0 writes the folder."""
        return self._all([a.save_hf.remote(path) for a in self.actors], f"HF save to {path}")[0]

    def hf_weights(self) -> dict[str, Any]:
        """The union over ranks: with PP each stage holds only its own layers."""
        merged: dict[str, Any] = {}
        for part in self._all([a.hf_weights.remote() for a in self.actors], "weight gather"):
            merged |= part
        return merged

    # ---- critic
    def compute_values(self, step: int, buffer, readers: int) -> None:
        """Every sample's values into the step's batch in the buffer (`readers` counts every read of
        the step: see Cluster.train)."""
        self._all([a.compute_values.remote(step, buffer, readers) for a in self.actors],
                  f"critic values of step {step}")

    def train_critic(self, step: int, buffer, readers: int) -> dict[str, float]:
        return self._all([a.train_critic.remote(step, buffer, readers) for a in self.actors],
                         f"critic train step {step}")[0]

    # ---- both
    def save_checkpoint(self, root: str, step: int, extra: dict) -> str:
        return self._all([a.save_checkpoint.remote(root, step, extra) for a in self.actors],
                         f"checkpoint save of step {step}")[0]

    def load_latest_checkpoint(self, root: str) -> dict | None:
        return self._all([a.load_latest_checkpoint.remote(root) for a in self.actors], f"{LOAD_WHAT} {root}")[0]

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Ask every rank to stop; ranks that have not stopped within `timeout_s` (one waiting in a
        collective for a peer that will not come) are killed, so that a run's end never hangs."""
        refs = [a.shutdown.remote() for a in self.actors]
        done, waiting = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if waiting:
            print(f"[slime_rl] {len(waiting)} {_RANK_NAME[self.role]} rank(s) did not stop within {timeout_s:g} s: "
                  "killed", flush=True)
            self.kill()
        ray.get(done)

    def kill(self) -> None:
        """After a rank failed: the others may wait in a collective forever, so no graceful exit."""
        for a in self.actors:
            ray.kill(a)
