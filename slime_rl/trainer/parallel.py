"""torch.distributed + Megatron parallel state for one trainer rank, and its teardown.

The same code runs on GPUs (nccl, one device per local rank) and on a CPU-only machine (gloo, with
the CPU compatibility layer applied before megatron sees a tensor).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from slime_rl.engines.dist_group import tcp_store
from slime_rl.trainer import cpu_compat
from slime_rl.trainer.mcore import mpu, tensor_parallel


@dataclass(frozen=True)
class ParallelInfo:
    """Where this rank sits in the TP x CP x DP x PP grid."""

    device: torch.device
    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int  # data shards (CP ranks of one shard hold the same samples)
    cp_rank: int = 0
    cp_size: int = 1
    # mixture of experts: the experts are spread over EP ranks and each split over ETP ranks; the
    # EP x ETP x expert-DP grid covers the same ranks as TP x CP x DP (megatron's expert grid)
    ep_rank: int = 0
    ep_size: int = 1
    etp_size: int = 1


def _pick_device(rank: int) -> tuple[torch.device, str]:
    if torch.cuda.is_available():
        # LOCAL_RANK when a launcher (torchrun, Ray with one GPU per actor) sets it; otherwise
        # assume ranks fill a node's GPUs in order.
        local_rank = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    cpu_compat.apply()
    return torch.device("cpu"), "gloo"


def rendezvous_store(rank: int, world_size: int, master_addr: str, master_port: int,
                     timeout: timedelta) -> dist.TCPStore:
    """The rendezvous store of a process group, its server on rank 0 listening on `master_addr` alone
    (engines/dist_group.tcp_store). torch's `tcp://` init (and a TCPStore given only a port) listens on
    every interface of the node. Under torchrun the elastic agent already serves the store at
    MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE): every rank is a client of it, as in torch's
    own env:// rendezvous."""
    is_master = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    return tcp_store(master_addr, master_port, world_size, is_master, timeout)


def check_layout(world_size: int, tp_size: int = 1, pp_size: int = 1, cp_size: int = 1, ep_size: int = 1,
                 etp_size: int | None = None) -> None:
    """Raise ValueError, naming the flags, when megatron cannot lay the ranks out this way."""
    if world_size % (tp_size * cp_size * pp_size) != 0:
        raise ValueError(f"world size {world_size} is not divisible by --tensor-model-parallel-size "
                         f"{tp_size} x --context-parallel-size {cp_size} x --pipeline-model-parallel-size "
                         f"{pp_size}")
    etp = tp_size if etp_size is None else etp_size
    if (world_size // pp_size) % (ep_size * etp) != 0:
        raise ValueError(f"world size {world_size} / --pipeline-model-parallel-size {pp_size} is not divisible by "
                         f"--expert-model-parallel-size {ep_size} x --expert-tensor-parallel-size {etp}")


def init_parallel(rank: int, world_size: int, master_addr: str, master_port: int, tp_size: int = 1,
                  pp_size: int = 1, seed: int = 1234, timeout_minutes: int = 30, cp_size: int = 1,
                  ep_size: int = 1, etp_size: int | None = None) -> ParallelInfo:
    """Create the default process group and Megatron's TP/CP/PP/DP (and expert EP/ETP) groups;
    seed the RNG tracker. `etp_size` None: the TP size, as Megatron's default.

    Raises ValueError when the world cannot be laid out so (check_layout).
    """
    check_layout(world_size, tp_size, pp_size, cp_size, ep_size, etp_size)
    device, backend = _pick_device(rank)
    if not dist.is_initialized():
        timeout = timedelta(minutes=timeout_minutes)
        dist.init_process_group(backend=backend, store=rendezvous_store(rank, world_size, master_addr, master_port,
                                                                        timeout),
                                rank=rank, world_size=world_size, timeout=timeout)
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp_size,
                                  pipeline_model_parallel_size=pp_size,
                                  context_parallel_size=cp_size,
                                  expert_model_parallel_size=ep_size,
                                  expert_tensor_parallel_size=etp_size,
                                  distributed_timeout_minutes=timeout_minutes)
    # Megatron offsets the seed per TP rank for dropout inside TP regions and per PP stage for
    # the default generator; with the CPU layer both live in the CPU generator.
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ParallelInfo(
        device=device, rank=rank, world_size=world_size,
        tp_rank=mpu.get_tensor_model_parallel_rank(), tp_size=tp_size,
        pp_rank=mpu.get_pipeline_model_parallel_rank(), pp_size=pp_size,
        dp_rank=mpu.get_data_parallel_rank(), dp_size=mpu.get_data_parallel_world_size(),
        cp_rank=mpu.get_context_parallel_rank(), cp_size=cp_size,
        ep_rank=mpu.get_expert_model_parallel_rank(), ep_size=ep_size,
        etp_size=mpu.get_expert_tensor_parallel_world_size(),
    )


def tp_group() -> dist.ProcessGroup:
    return mpu.get_tensor_model_parallel_group()


def dp_group() -> dist.ProcessGroup:
    return mpu.get_data_parallel_group()


def cp_group() -> dist.ProcessGroup:
    return mpu.get_context_parallel_group()


def teardown_parallel() -> None:
    """Destroy Megatron's groups and the default group (safe to call twice)."""
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def pp_group() -> dist.ProcessGroup:
    return mpu.get_pipeline_model_parallel_group()


def pp_last_rank() -> int:
    """Global rank of the last pipeline stage in this rank's PP group (it computes the loss)."""
    return mpu.get_pipeline_model_parallel_last_rank()


def broadcast_from_last_stage(t: torch.Tensor) -> torch.Tensor:
    """Every stage of the PP group gets the last stage's `t` (same shape on all; in place).
    Only the last stage runs the loss function, so per-token results and metrics start there."""
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(t, src=pp_last_rank(), group=pp_group())
    return t


def expert_tp_ep_group() -> dist.ProcessGroup | None:
    """The expert-TP x EP group (megatron's tp_ep: the group megatron's allgather token dispatcher
    gathers every MoE layer's tokens over); None when it is one rank."""
    if mpu.get_expert_tensor_and_model_parallel_world_size() == 1:
        return None
    return mpu.get_expert_tensor_and_model_parallel_group()
