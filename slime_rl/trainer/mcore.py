"""The one door to Megatron-core: every trainer module imports Megatron's names from here.

Importing this module first runs the part of the CPU compatibility layer (cpu_compat.py) that
must precede any megatron import: the stub for the one megatron module that imports triton
unconditionally (a no-op when triton is installed or CUDA is available), and on CPU megatron's
`jit_fuser` bound to no compile (`cpu_compat.eager_jit_fuser`). The rest of the layer
changes global torch state and is applied by `parallel.init_parallel` when a rank starts on CPU,
and per thread by `on_rank_thread` below.

Only trainer rank processes should import this module (importing megatron costs seconds of CPU):
the driver reaches the trainer through Ray actors that import `worker` / `critic` inside the
actor (orchestration/trainer_group.py), and the tools' pre-launch steps use the megatron-free
modules (convert/, checkpoint_layout.py, hf_files.py, launch_env.py).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

from slime_rl.trainer import cpu_compat

cpu_compat.apply(only=("paged_stash",))  # before the first megatron import (no-op on GPU / with triton)


@contextlib.contextmanager
def _without(*modules: str) -> Iterator[None]:
    """While megatron.core is first imported, `import` of these modules fails (those not yet imported).

    megatron.core.timers imports wandb and torch.utils.tensorboard, each in a try block, for a timers
    writer that the trainer never passes: 0.5-1 s of every rank's start, and a trainer rank logs nothing
    itself (the driver writes metrics.jsonl and the backends). Afterwards they import as usual."""
    absent = [m for m in modules if m not in sys.modules]
    for m in absent:
        sys.modules[m] = None  # the import system raises ImportError for a None entry
    try:
        yield
    finally:
        for m in absent:
            if m in sys.modules and sys.modules[m] is None:
                del sys.modules[m]


# the imports below must follow the stub above; on CPU megatron's jit_fuser is bound to no compile
# ruff: noqa: E402, I001
with cpu_compat.eager_jit_fuser(), _without("wandb", "torch.utils.tensorboard"):
    import megatron.core.jit  # noqa: F401  (imports megatron.core, timers among it)
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core import parallel_state as mpu
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.multi_token_prediction import (
    MTPLossLoggingHelper,
    MultiTokenPredictionBlockSubmodules,
    get_mtp_layer_spec_for_backend,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.ssm.gated_delta_net import common as gated_delta_net_common
from megatron.core.ssm.gated_delta_net import gdn as gated_delta_net_module
from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint



def _count_routed_tokens(self: TopKRouter, routing_map: Any, padding_mask: Any = None) -> None:
    """TopKRouter._apply_expert_bias (the per-expert token count that moves a sigmoid router's
    expert_bias between steps) with the padding mask broadcast over the experts: megatron-core 0.19.2
    writes `routing_map & ~padding_mask`, [tokens, experts] against [tokens], which raises on every
    batch with padding. The count is the same otherwise (and with moe_router_bias_update_rate 0, as the
    trainer runs, it moves nothing)."""
    import torch

    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(-1, 1)
            self.local_tokens_per_expert += routing_map.sum(dim=0)


TopKRouter._apply_expert_bias = _count_routed_tokens


class DuplicatedLinear(MegatronModule):
    """A linear layer whose whole weight every TP rank holds, applied to this rank's tokens: multi-latent
    attention's down projections (TransformerEngine's parallel_mode "duplicated", which the local spec lacks).

    megatron-core 0.19.2's MLA under the local spec splits the key/value down projection's outputs over TP and
    gathers them (`gather_from_tensor_model_parallel_region`), whose backward keeps this rank's slice of the
    gradient; the rotary key channels feed every head, so each rank's gradient for them is partial, and the
    kept slices are wrong with TP > 1 (kv_a_proj_with_mqa's and the embedding's gradients 5e-4 off on the tiny
    model). Duplicated, MLA takes its other path: the latent stays on this rank's tokens under sequence
    parallelism and the rotary key is gathered over the sequence (`gather_from_sequence_parallel_region`, whose
    backward sums the ranks' gradients). The weight's gradient is then partial per rank (its tokens), summed by
    finalize_model_grads (`sequence_parallel`). Without sequence parallelism every rank would see every token
    and the rotary key's gradient would stay partial: MLA with TP > 1 needs --sequence-parallel, as megatron's
    MoE layers do anyway."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method: Any = None, bias: bool = False,
                 skip_bias_add: bool = False, **_unused: Any) -> None:
        import torch

        super().__init__(config=config)
        if bias:
            raise ValueError("DuplicatedLinear: no bias (multi-latent attention's down projections have none)")
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype, device=device))
        if config.perform_initialization and init_method is not None:
            init_method(self.weight)
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: Any) -> tuple[Any, None]:
        import torch.nn.functional as F

        return F.linear(x, self.weight), None


from megatron.core.transformer.multi_latent_attention import MLASelfAttention  # noqa: E402


class LocalMLASelfAttention(MLASelfAttention):
    """megatron's MLASelfAttention building the modules its spec names, as given.

    megatron-core 0.19.2's QKNormConfigResolver, with qk_layernorm on (the latent norms) and q_lora_rank
    null (one query projection: Moonlight), asks the backend for a fused norm+linear query projection,
    which the local spec does not have (it raises). The trainer's spec names every module explicitly
    (model._layer_spec: no query norm without q_lora_rank, our RMSNorm for the latents), so nothing is left
    to resolve."""

    def _resolve_qk_norm_config(self, submodules: Any) -> dict[str, Any]:
        return {"linear_q_proj": submodules.linear_q_proj, "linear_q_up_proj": submodules.linear_q_up_proj,
                "linear_kv_up_proj": submodules.linear_kv_up_proj, "q_layernorm": submodules.q_layernorm,
                "kv_layernorm": submodules.kv_layernorm}


def _install_duplicated_linear() -> None:
    """MLASelfAttention takes a down projection of a class it knows; without TransformerEngine its name for
    the plain linear (modelopt's `Linear`) is None, and DuplicatedLinear takes that place."""
    from megatron.core.transformer import multi_latent_attention as mla

    if getattr(mla, "Linear", None) is None:
        mla.Linear = DuplicatedLinear


_install_duplicated_linear()

__all__ = [
    "DistributedDataParallel", "DistributedDataParallelConfig", "Float16Module", "GPTModel",
    "MegatronModule", "MegatronOptimizerConfig", "OptimizerParamScheduler", "PackedSeqParams",
    "ProcessGroupCollection", "ShardedObject", "ShardedTensor", "ShardedTensorFactory",
    "SelfAttention", "TransformerBlockSubmodules", "TransformerConfig", "TransformerLayer", "MLATransformerConfig",
    "dist_checkpointing",
    "finalize_model_grads",
    "gather_from_sequence_parallel_region", "get_forward_backward_func", "get_gpt_layer_local_spec",
    "get_megatron_optimizer", "get_moe_metrics_tracker", "mpu", "on_rank_thread", "rope_utils", "tensor_parallel",
    "vocab_parallel_cross_entropy", "RouterReplay", "RouterReplayAction", "TopKRouter", "SequentialMLP",
    "DuplicatedLinear", "IdentityOp", "LocalMLASelfAttention", "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region", "reduce_scatter_to_sequence_parallel_region",
    "set_tensor_model_parallel_attributes", "make_sharded_tensors_for_checkpoint",
    "ModuleSpec", "ColumnParallelLinear", "RowParallelLinear", "GatedDeltaNet", "GatedDeltaNetSubmodules",
    "gated_delta_net_common", "gated_delta_net_module", "torch_chunk_gated_delta_rule",
    "LocalSpecProvider", "MTPLossLoggingHelper", "MultiTokenPredictionBlockSubmodules",
    "get_mtp_layer_spec_for_backend",
]

def on_rank_thread[F: Callable[..., Any]](method: F) -> F:
    """Decorator for a rank's entry points (the methods a host calls): on CPU, make sure the
    calling thread has the CPU layer's device mode (cpu_compat.CudaToCpuMode) before the body runs.

    The mode is a TorchFunctionMode, and those are per thread: the constructor's thread got it in
    `init_parallel`, but a host may call a method from another thread (a thread pool, a threaded
    actor). Ray's default actors run `__init__` and every method on one thread, so there this is a
    cheap no-op; it is a no-op on GPU too (`cpu_compat.apply` returns at once with CUDA).
    A generator method (or the generator under a @contextmanager) gets the mode when it starts
    running, i.e. on the thread that consumes it, as a call in its body would.
    """
    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def gen(*args: Any, **kwargs: Any) -> Any:
            cpu_compat.apply()
            return (yield from method(*args, **kwargs))

        return gen  # type: ignore[return-value]

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        cpu_compat.apply()
        return method(*args, **kwargs)

    return call  # type: ignore[return-value]
