"""Where every process goes. Pure functions over the config and the cluster's size: no Ray here,
so the plan is tested without a cluster and printed by `--dry-run`.

Layout (disaggregated): bundles 0 .. W-1 hold the W trainer ranks (rank r in bundle r), then PPO's
C critic ranks (bundles W .. W+C-1; none for the other estimators), then one bundle per engine holding
its `rollout_num_gpus_per_engine` (N) GPUs: SGLang runs `--tp-size N --base-gpu-id g` in one process
tree and needs N devices visible to it, so the engine actor asks Ray for all N GPUs of that bundle
(Ray sets its CUDA_VISIBLE_DEVICES to them; the server then starts at base GPU 0 of what it sees). In
the weight-update group the trainer's source is rank 0 and engine e holds ranks
1 + e*N .. (e+1)*N. On a machine without GPUs a bundle is one CPU slot instead.

Colocated (`--colocate`): engine e of N GPUs (`--rollout-num-gpus-per-engine`) occupies the N
consecutive trainer bundles e*N .. e*N+N-1 (the engines take the first `--rollout-num-gpus` trainer
bundles), and its TP rank i runs on the GPU of trainer rank e*N+i: each GPU holds one trainer rank
and one engine TP rank, as in slime. The engine's actor sits in its first bundle, which therefore
offers two CPU slots, and each actor of that bundle asks for half of its GPU (`actor_gpu`): Ray hands
both the same device. With N > 1 the engine's process must see all N GPUs: the cluster starts it
with the GPUs of those N trainer ranks visible, in rank order (orchestration/cluster.py), so SGLang's
TP rank i gets trainer rank e*N+i's GPU as its device i.

An engine of more GPUs than a node has (N > G, G the GPUs per node, N a multiple of G) spans K = N/G
nodes, as slime runs DeepSeek-R1, Kimi-K2 or Qwen3-235B: SGLang runs one process tree per node
(`--nnodes K --node-rank k --dist-init-addr` of node 0), node 0 serving HTTP. Disaggregated, the engine
holds K bundles of G GPUs (one per node); colocated, its N trainer bundles, G per node. Either way its
node part k is `EngineSlot.part(k)`, with an actor in the part's first bundle. Only SGLang spans nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from slime_rl.config import EngineConfig, ParallelConfig


class PlacementError(ValueError):
    """The cluster cannot hold the requested layout; the message names the flags."""


@dataclass(frozen=True)
class EngineSlot:
    engine_id: int
    # the one bundle that holds the engine's devices; colocated: the N trainer bundles of its N devices
    # (its TP rank i on bundle i's GPU), its actor in the first
    bundles: tuple[int, ...]
    # rank of the engine's first device in the weight-update group; the trainer's source is rank 0
    rank_offset: int
    num_gpus: int = 1  # devices of the engine: its TP size, and its ranks in the weight-update group
    nodes: int = 1  # nodes the engine spans (SGLang --nnodes), num_gpus / nodes GPUs on each

    @property
    def gpus_per_node(self) -> int:
        return self.num_gpus // self.nodes

    def part(self, k: int) -> tuple[int, ...]:
        """The bundles of the engine's node part k (its --node-rank k): its bundle k, or colocated, the
        k-th run of gpus_per_node trainer bundles; the part's actor sits in the first."""
        if len(self.bundles) == self.nodes:
            return (self.bundles[k],)
        n = self.gpus_per_node
        return self.bundles[k * n:(k + 1) * n]


@dataclass(frozen=True)
class PlacementPlan:
    use_gpu: bool
    bundles: tuple[dict[str, float], ...]
    trainer_bundles: tuple[int, ...]
    engines: tuple[EngineSlot, ...]
    notes: list[str] = field(default_factory=list)
    critic_bundles: tuple[int, ...] = ()
    colocated: bool = False
    # (nodes, GPUs per node) of the cluster planned for, when known (GPU plans)
    shape: tuple[int, int] | None = None

    @property
    def actor_gpu(self) -> float:
        """GPUs each trainer/engine actor asks for (0 on CPU; half a bundle's GPU when colocated)."""
        return 0.0 if not self.use_gpu else 0.5 if self.colocated else 1.0

    def engine_actor_gpu(self, slot: EngineSlot) -> float:
        """GPUs each actor of engine `slot` asks for: all of its bundle's, one node part's (0 on CPU,
        half when colocated)."""
        return 0.0 if not self.use_gpu else 0.5 if self.colocated else float(slot.gpus_per_node)

    @property
    def weight_update_world_size(self) -> int:
        """One trainer source rank plus every engine device."""
        return 1 + sum(e.num_gpus for e in self.engines)

    def describe(self) -> str:
        kind = "GPU" if self.use_gpu else "CPU"
        lines = [f"placement ({kind} bundles: {len(self.bundles)})"]
        lines.append(f"  trainer ranks 0..{len(self.trainer_bundles) - 1} -> bundles {list(self.trainer_bundles)}")
        if self.critic_bundles:
            lines.append(f"  critic ranks 0..{len(self.critic_bundles) - 1} -> bundles {list(self.critic_bundles)}")
        for e in self.engines:
            sync = "shared with the trainer" if self.colocated else f"weight-update rank_offset {e.rank_offset}"
            devices = f" ({e.num_gpus} devices: TP {e.num_gpus})" if e.num_gpus > 1 else ""
            if self.colocated and e.num_gpus > 1:
                devices = f" (TP {e.num_gpus}: TP rank i beside trainer rank {e.bundles[0]}+i)"
            if e.nodes > 1:
                devices = devices[:-1] + f", over {e.nodes} nodes of {e.gpus_per_node} GPUs)"
            lines.append(f"  engine {e.engine_id} -> bundles {list(e.bundles)}{devices}, {sync}")
        if not self.engines:
            lines.append("  no engines")
        elif self.colocated:
            lines.append("  colocated: engines share the trainer's bundles (one engine TP rank beside each trainer "
                         "rank); weights handed over in place")
        else:
            lines.append(f"  weight-update group world size {self.weight_update_world_size}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def engine_nodes(engine: EngineConfig, gpus_per_node: int | None) -> int:
    """How many nodes one engine spans: 1, or N / G for an engine of N = --rollout-num-gpus-per-engine GPUs
    on nodes of G (`gpus_per_node`; None: unknown, one node). PlacementError for an N that is not a
    multiple of G, or for the built-in engine (one process on one node)."""
    per = engine.num_gpus_per_engine
    if not gpus_per_node or per <= gpus_per_node:
        return 1
    g = gpus_per_node
    if per % g:
        raise PlacementError(f"--rollout-num-gpus-per-engine {per} is more than a node's {g} GPUs and not a multiple "
                             f"of them: an engine over several nodes takes whole nodes (give {per // g * g} or "
                             f"{(per // g + 1) * g}, or at most {g})")
    if engine.backend != "sglang":
        raise PlacementError(f"--rollout-num-gpus-per-engine {per} spans {per // g} nodes of {g} GPUs: only SGLang "
                             f"runs one engine over several nodes (--rollout-backend sglang); the built-in engine "
                             "runs on one node")
    return per // gpus_per_node


def plan_placement(parallel: ParallelConfig, engine: EngineConfig, cluster_gpus: int,
                   cluster_cpus: int | None = None, critic_world: int = 0,
                   gpus_per_node: int | None = None) -> PlacementPlan:
    """The bundle layout for the trainer ranks and engines, checked against the cluster.

    cluster_gpus == 0 means a CPU-only cluster: each bundle asks for one CPU slot. Ray's CPU
    slots are logical, so a 2-core laptop can host 3 bundles; the note says when it oversubscribes.
    critic_world: PPO's critic ranks (--critic-num-nodes x --critic-num-gpus-per-node), 0 without one.
    gpus_per_node: the GPUs of each node (None: not known; every engine then on one node): an engine of
    more GPUs spans several nodes (`engine_nodes`).
    """
    trainer_n = parallel.world_size
    engine_n = engine.num_gpus
    per = engine.num_gpus_per_engine
    nodes_per_engine = engine_nodes(engine, gpus_per_node) if cluster_gpus > 0 else 1
    if engine.colocate and engine_n > trainer_n:
        raise PlacementError(f"--colocate: --rollout-num-gpus ({engine_n}) exceeds the trainer's {trainer_n} devices")
    if engine_n % per:
        raise PlacementError(f"--rollout-num-gpus-per-engine ({per}) must divide --rollout-num-gpus ({engine_n})")
    total_gpus = trainer_n + critic_world + (0 if engine.colocate else engine_n)
    use_gpu = cluster_gpus > 0
    notes: list[str] = []
    if use_gpu and total_gpus > cluster_gpus:
        raise PlacementError(
            f"need {total_gpus} GPUs (--actor-num-nodes x --actor-num-gpus-per-node = {trainer_n} for the trainer + "
            + (f"--critic-num-nodes x --critic-num-gpus-per-node = {critic_world} for the critic + " if critic_world
               else "")
            + f"--rollout-num-gpus = {engine_n} for the engines), the cluster has {cluster_gpus}")
    n_engines = 0 if engine.colocate else engine.num_engines
    total = trainer_n + critic_world + n_engines * nodes_per_engine
    if not use_gpu and cluster_cpus is not None and total > cluster_cpus:
        notes.append(f"{total} CPU bundles on {cluster_cpus} cores: processes share cores")
    bundle = {"GPU": 1.0, "CPU": 1.0} if use_gpu else {"CPU": 1.0}
    shared = dict(bundle, CPU=2.0)  # colocated: a trainer rank and an engine's actor
    engine_bundle = {"GPU": float(per // nodes_per_engine), "CPU": 1.0} if use_gpu else {"CPU": 1.0}
    engines = []
    for e in range(engine.num_engines):
        if engine.colocate:  # the GPUs of trainer ranks e*N .. e*N+N-1, the actor(s) in the first (of each node)
            slot_bundles = tuple(range(e * per, (e + 1) * per))
        else:  # one bundle per node the engine spans
            first = trainer_n + critic_world + e * nodes_per_engine
            slot_bundles = tuple(range(first, first + nodes_per_engine))
        engines.append(EngineSlot(e, slot_bundles, rank_offset=1 + e * per, num_gpus=per, nodes=nodes_per_engine))
    actors = {e.part(k)[0] for e in engines for k in range(e.nodes)} if engine.colocate else set()
    bundles = tuple(dict(shared if i in actors else bundle) for i in range(trainer_n + critic_world))
    bundles += tuple(dict(engine_bundle) for _ in range(n_engines * nodes_per_engine))
    shape = (cluster_gpus // gpus_per_node, gpus_per_node) if use_gpu and gpus_per_node else None
    return PlacementPlan(use_gpu, bundles, tuple(range(trainer_n)), tuple(engines), notes,
                         tuple(range(trainer_n, trainer_n + critic_world)), colocated=engine.colocate, shape=shape)


@dataclass(frozen=True)
class Device:
    """Where one bundle lands: its node and the GPU ids on that node (CPU bundles: no GPUs)."""

    node: int
    gpus: tuple[int, ...]

    def __str__(self) -> str:
        ids = ",".join(map(str, self.gpus))
        return f"node {self.node} GPU {ids}" if self.gpus else f"node {self.node} (CPU)"


def assign_devices(plan: PlacementPlan, nodes: int, gpus_per_node: int) -> tuple[Device, ...]:
    """The node and GPU ids of every bundle of `plan` on `nodes` nodes of `gpus_per_node` GPUs.

    Bundles are placed in order, each on the first node with enough free GPUs, lowest ids first:
    the trainer ranks fill the first nodes, then the critic, then the engines. That is where Ray's
    PACK strategy puts them up to the naming of the nodes (which physical node is "node 0" is Ray's
    choice); each node part of an engine is on one node, its parts on as many different nodes.
    """
    free = [list(range(gpus_per_node)) for _ in range(nodes)]
    out = []
    for b, bundle in enumerate(plan.bundles):
        need = int(bundle.get("GPU", 0))
        engine = next((e for e in plan.engines if b in e.bundles and not plan.colocated), None)
        # a node part of an engine goes to a node that holds no other part of that engine
        taken = {out[o].node for o in engine.bundles if o < b} if engine is not None else set()
        node = next((n for n in range(nodes) if len(free[n]) >= need and n not in taken), None)
        if node is None:
            what = (f"engine {engine.engine_id} needs {need} GPUs of one node (--rollout-num-gpus-per-engine)"
                    if engine is not None and engine.nodes == 1 else
                    f"engine {engine.engine_id} needs {engine.nodes} nodes of {need} GPUs each "
                    "(--rollout-num-gpus-per-engine)" if engine is not None else f"bundle {b} needs {need} GPU")
            raise PlacementError(f"--cluster {nodes}x{gpus_per_node}: {what}, and no node has that many free "
                                 f"after the bundles before it")
        out.append(Device(node, tuple(free[node][:need])))
        del free[node][:need]
    for e in plan.engines if plan.colocated else ():
        parts = [sorted({out[b].node for b in e.part(k)}) for k in range(e.nodes)]
        split = next((k for k, p in enumerate(parts) if len(p) > 1), None)
        if split is not None:
            part = e.part(split)
            over = f"--rollout-num-gpus-per-engine {e.num_gpus} GPUs must be on one node (give a number that divides " \
                "--actor-num-gpus-per-node)" if e.nodes == 1 else \
                f"each of its {e.nodes} node parts of {e.gpus_per_node} GPUs must be on one node"
            raise PlacementError(
                f"--cluster {nodes}x{gpus_per_node}: colocated engine {e.engine_id} runs beside trainer ranks "
                f"{part[0]}..{part[-1]}, which span nodes {' and '.join(map(str, parts[split]))}; an engine's {over}")
    return tuple(out)


def engine_devices(plan: PlacementPlan, devices: Sequence[Device], slot: EngineSlot) -> tuple[Device, ...]:
    """The node and GPU ids of each node part of engine `slot` (its TP ranks in order over the GPUs listed):
    its bundles', or colocated, those of the trainer bundles it spans (`assign_devices` checks that each part
    is on one node)."""
    return tuple(Device(devices[slot.part(k)[0]].node, tuple(g for b in slot.part(k) for g in devices[b].gpus))
                 for k in range(slot.nodes))


def engine_device(plan: PlacementPlan, devices: Sequence[Device], slot: EngineSlot) -> Device:
    """The node and GPU ids of engine `slot`'s first node part (all of an engine on one node)."""
    return engine_devices(plan, devices, slot)[0]


# Megatron's default rank order (megatron.core.parallel_state.initialize_model_parallel): TP varies
# fastest, then CP, then DP, then PP
RANK_ORDER = ("tp", "cp", "dp", "pp")


def rank_coords(rank: int, parallel: ParallelConfig) -> dict[str, int]:
    """The (tp, cp, dp, pp) coordinates of trainer rank `rank` in Megatron's order "tp-cp-ep-dp-pp"."""
    sizes = {"tp": parallel.tensor_model_parallel_size, "cp": parallel.context_parallel_size,
             "dp": parallel.data_parallel_size, "pp": parallel.pipeline_model_parallel_size}
    out = {}
    for axis in RANK_ORDER:
        rank, out[axis] = divmod(rank, sizes[axis])
    return out


def balanced_dp_shard(lengths: Sequence[int], global_batch_size: int, dp_rank: int, dp_size: int) -> list[int]:
    """--balance-data (slime's): indices of the samples DP rank `dp_rank` trains on, in order, with
    the rollout's samples split over the DP ranks in equal counts and balanced token counts
    (`lengths`: prompt + response tokens of each sample) instead of contiguous slices.

    Greedy with equal counts: the longest sample first, each to the rank with the fewest tokens that
    still has room, ties to the lower rank (deterministic: every rank computes the same split; slime
    uses Karmarkar-Karp for the same partition problem). The trainer cuts each rank's part into
    its mini-batches in order, so optimizer step k gets the k-th gbs/dp samples of every rank; a
    group's samples may land in different steps (as in slime)."""
    n = len(lengths)
    if n % global_batch_size or global_batch_size % dp_size:
        raise ValueError(f"{n} samples, global batch {global_batch_size}, dp {dp_size}: not divisible")
    room = n // dp_size
    parts: list[list[int]] = [[] for _ in range(dp_size)]
    loads = [0] * dp_size
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        r = min((r for r in range(dp_size) if len(parts[r]) < room), key=lambda r: (loads[r], r))
        parts[r].append(i)
        loads[r] += lengths[i]
    return sorted(parts[dp_rank])


def dp_shard(n_samples: int, global_batch_size: int, dp_rank: int, dp_size: int) -> list[int]:
    """Indices of the samples DP rank `dp_rank` trains on, in order.

    Optimizer step k uses samples [k*gbs, (k+1)*gbs); rank r takes the r-th contiguous slice of
    gbs/dp of each, so the ranks' k-th local mini-batches together are exactly global mini-batch k.
    """
    if n_samples % global_batch_size or global_batch_size % dp_size:
        raise ValueError(f"{n_samples} samples, global batch {global_batch_size}, dp {dp_size}: not divisible")
    per_rank = global_batch_size // dp_size
    out: list[int] = []
    for start in range(0, n_samples, global_batch_size):
        first = start + dp_rank * per_rank
        out.extend(range(first, first + per_rank))
    return out
