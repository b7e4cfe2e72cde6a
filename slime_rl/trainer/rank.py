"""MegatronRank: what every Megatron rank of a trainer group holds, the policy's (worker.TrainerWorker)
and PPO's critic's (critic.CriticWorker): the parallel state, the model built from the HF config and
loaded from the HF weights, DDP, the distributed optimizer, the LR schedule, micro-batching, the MoE
routing hooks and checkpoints. The same code runs on GPUs (nccl) and on CPU (gloo + cpu_compat).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from slime_rl.config.groups import (
    AlgoConfig,
    BatchConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainerConfig,
)
from slime_rl.trainer import checkpoint, hf_io, lora
from slime_rl.trainer.batching import MicroBatch, chunks
from slime_rl.trainer.equal_tokens import equalize_tokens
from slime_rl.trainer.loss_agg import check_mode
from slime_rl.trainer.mcore import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    Float16Module,
    MegatronOptimizerConfig,
    OptimizerParamScheduler,
    finalize_model_grads,
    get_forward_backward_func,
    get_megatron_optimizer,
    on_rank_thread,
)
from slime_rl.trainer.micro import MicroBatching
from slime_rl.trainer.model import MoEOptions, build_from_checkpoint
from slime_rl.trainer.parallel import (
    dp_group,
    expert_tp_ep_group,
    init_parallel,
    pp_group,
    teardown_parallel,
)
from slime_rl.trainer.routing_replay import attach as attach_engine_routing
from slime_rl.trainer.vision import VisionBatching, float_buffers, freeze_vision_tower, restore_buffers


class MegatronRank:
    """What every Megatron rank of a trainer group holds: the parallel state, the model built from
    the HF config and loaded from the HF weights, DDP, the distributed optimizer, the LR schedule,
    micro-batching and checkpoints. Subclasses: TrainerWorker (the policy) and
    critic.CriticWorker (PPO's value model, which swaps the LM output layer in `_prepare_model`).
    The rank gets the run's config groups as they are (config/groups.py); `trainer` (TrainerConfig)
    holds how the work is laid out: packing, token budgets, loss aggregation, sequence parallel,
    recompute and a mixture-of-experts model's options (the expert parallel sizes come with
    `parallel`). A new trainer setting is a TrainerConfig field read here, nothing in between.
    """

    # --lora-rank / --lora-load adapt this group's model (the policy's); PPO's critic trains whole
    takes_lora = True
    # --mtp-num-layers builds the multi-token-prediction layers in this group's model (the policy's; not the critic's)
    builds_mtp = True

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int,
                 parallel: ParallelConfig, batch: BatchConfig, optim: OptimizerConfig, model: ModelConfig,
                 algo: AlgoConfig, train_iters: int, pad_vocab_multiple: int = 1, *,
                 trainer: TrainerConfig | None = None) -> None:
        trainer = trainer or TrainerConfig()
        tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
        cp = parallel.context_parallel_size
        ep, etp = parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size
        moe = MoEOptions(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                         moe_aux_loss_coeff=trainer.moe_aux_loss_coeff,
                         moe_router_load_balancing_type=trainer.moe_router_load_balancing_type,
                         moe_token_dispatcher_type=trainer.moe_token_dispatcher_type,
                         moe_grouped_gemm=trainer.moe_grouped_gemm)
        check_mode(trainer.loss_agg_mode, trainer.loss_agg_max_len)
        self.trainer = trainer
        self.loss_agg_mode, self.loss_agg_max_len = trainer.loss_agg_mode, trainer.loss_agg_max_len
        # the scheduler's warm-up (OptimizerConfig.warmup_steps: --lr-warmup-iters, or Megatron's
        # --lr-warmup-fraction of the decay steps, a float as Megatron passes it)
        warmup = optim.warmup_steps(optim.lr_decay_iters or train_iters)
        if train_iters < 1 or train_iters <= warmup:
            raise ValueError(f"train_iters={train_iters} must be >= 1 and > the warmup steps {warmup} "
                             f"(--lr-warmup-iters / --lr-warmup-fraction)")
        self.batch, self.algo, self.model_cfg = batch, algo, model
        # megatron's distributed optimizer reads .grad of its (non-leaf) shard views in zero_grad,
        # which makes torch warn on every step, GPU or CPU: noise, not a problem of ours
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
        if trainer.deterministic_mode:  # Megatron-LM's --deterministic-mode (slime's initialize.py does the same)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS handle
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
            torch.use_deterministic_algorithms(True)
        self.info = init_parallel(rank, world_size, master_addr, master_port, tp, pp, model.seed, cp_size=cp,
                                  ep_size=ep, etp_size=etp)
        if batch.global_batch_size % self.info.dp_size != 0:
            raise ValueError(f"--global-batch-size {batch.global_batch_size} is not divisible by the "
                             f"data-parallel size {self.info.dp_size}")
        self.arch, self.gpt = build_from_checkpoint(
            model.hf_checkpoint, bf16=model.bf16, tp_size=tp, pp_size=pp,
            pad_vocab_multiple=pad_vocab_multiple, decoder_first=parallel.decoder_first_pipeline_num_layers,
            decoder_last=parallel.decoder_last_pipeline_num_layers, sequence_parallel=trainer.sequence_parallel,
            recompute_granularity=trainer.recompute_granularity, recompute_method=trainer.recompute_method,
            recompute_num_layers=trainer.recompute_num_layers, context_parallel_size=cp,
            deterministic_mode=trainer.deterministic_mode,
            fp32_lm_head=model.fp32_lm_head,
            moe=moe, mtp_num_layers=trainer.mtp_num_layers if self.builds_mtp else None,
            mtp_loss_scaling_factor=trainer.mtp_loss_scaling_factor)
        hf_io.load_hf_weights(self.gpt, model.hf_checkpoint, self.arch)
        # the MTP layers train only under --enable-mtp-training (their loss is the only one that reaches them); else
        # they stay the checkpoint's, frozen
        self.mtp_train = bool(self.arch.mtp_built and trainer.enable_mtp_training)
        if self.arch.mtp_built and not self.mtp_train and hasattr(self.gpt, "mtp"):
            self.gpt.mtp.requires_grad_(False)
        self.lora: list[lora.Adapter] = []
        self.lora_spec = lora_spec(model) if self.takes_lora else None
        if self.lora_spec is not None:
            self.lora = lora.attach(self.gpt, self.arch, hf_io.rank_param_maps(self.arch), self.lora_spec,
                                    model.seed, (self.info.tp_rank, tp), trainer.sequence_parallel)
            if model.lora_load:
                lora.load_peft_state(self.lora, lora.read_peft_folder(model.lora_load)[1],
                                     f"--lora-load {model.lora_load}")
        vision = None
        if self.arch.vision is not None:
            if model.freeze_vision_tower:
                freeze_vision_tower(self.gpt)
            vision = VisionBatching(self.arch, model.hf_checkpoint, with_pixels=self.gpt.pre_process)
        # R2 alone (R3 implies it: the engines' routing is replayed in every forward already): the old-log-prob
        # forward's routing is recorded and replayed in the same step's training forwards (routing_replay.py)
        self.record_routing = bool(trainer.use_routing_replay and not trainer.use_rollout_routing_replay
                                   and self.arch.num_experts)
        # MoE: every router takes the engines' routing when a batch carries it: replayed under
        # --use-rollout-routing-replay, else only compared (train/routing_agreement)
        self.engine_routing = attach_engine_routing(self.gpt, replay=trainer.use_rollout_routing_replay) \
            if self.arch.num_experts else []
        self.gpt.engine_routing = self.engine_routing
        routing, sequence_parallel = None, trainer.sequence_parallel
        if self.arch.num_experts:
            routing = (self.arch.num_layers, self.arch.moe_topk, self.arch.num_experts,
                       tp if sequence_parallel else 1, self.info.tp_rank if sequence_parallel else 0)
        self.micro = MicroBatching(self.info.device, batch.micro_batch_size, trainer.pack_sequences,
                                   trainer.use_dynamic_batch_size, trainer.max_tokens_per_gpu,
                                   pad_multiple=tp if sequence_parallel else 1,
                                   cp_size=cp, cp_rank=self.info.cp_rank, vision=vision, routing=routing,
                                   mtp=self.mtp_train)
        self._prepare_model()
        config = self.gpt.config
        if pp > 1 and self.info.device.type == "cpu":
            config.batch_p2p_comm = False  # gloo has no batched (coalesced) isend/irecv
        # Float16Module keeps bf16 params and returns float32 logits on the last stage
        fp32_buffers = float_buffers(self.gpt.vision_model) if hasattr(self.gpt, "vision_model") else {}
        # a sigmoid router's expert bias (GLM-4.5): the checkpoint's float32 values, which the engines route
        # with (transformers keeps e_score_correction_bias in float32); Float16Module's cast would round them
        router_bias = {n: b.detach().clone() for n, b in hf_io.registry_buffers(self.gpt).items()}
        inner = Float16Module(config, self.gpt) if model.bf16 else self.gpt
        if fp32_buffers:  # the HF vision tower keeps its RoPE frequencies in float32, as the engine does
            restore_buffers(self.gpt.vision_model, fp32_buffers)
        if model.bf16 and router_bias:
            restore_buffers(self.gpt, router_bias)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=True)
        self.model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=inner)
        on_gpu = self.info.device.type == "cuda"
        if optim.cpu_offload and not on_gpu and self.info.rank == 0:
            print("[slime_rl] --optimizer-cpu-offload: the ranks run on the CPU, where the optimizer is already; "
                  "nothing to offload", flush=True)
        self.optimizer = get_megatron_optimizer(megatron_optimizer_config(optim, model.bf16, config.params_dtype,
                                                                          on_gpu), [self.model])
        # Without finalize_model_grads_func the schedule never all-reduces grads over DP.
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        config.no_sync_func = self.model.no_sync
        decay_steps = optim.lr_decay_iters or train_iters
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=optim.lr, min_lr=optim.min_lr,
            lr_warmup_steps=optim.warmup_steps(decay_steps), lr_decay_steps=decay_steps,
            lr_decay_style=optim.lr_decay_style, start_wd=optim.weight_decay, end_wd=optim.weight_decay,
            wd_incr_steps=train_iters, wd_incr_style="constant")

    def _prepare_model(self) -> None:
        """Hook between loading the HF weights and wrapping the model for training."""

    # ---- topology
    @property
    def dp_rank(self) -> int:
        return self.info.dp_rank

    @property
    def dp_size(self) -> int:
        return self.info.dp_size

    @property
    def tp_rank(self) -> int:
        return self.info.tp_rank

    @property
    def pp_rank(self) -> int:
        return self.info.pp_rank

    @property
    def pp_size(self) -> int:
        return self.info.pp_size

    @property
    def pp_group(self) -> dist.ProcessGroup:
        """This rank's pipeline group: one rank per stage, in stage order."""
        return pp_group()

    @property
    def device(self) -> torch.device:
        return self.info.device

    @property
    def is_weight_source(self) -> bool:
        """Whether this rank sends its pipeline stage's weights in weight sync: one rank per stage
        (tp_rank 0, dp_rank 0, cp_rank 0); `iter_hf_weights` still has to run on the stage's other TP ranks."""
        return self.info.tp_rank == 0 and self.info.dp_rank == 0 and self.info.cp_rank == 0

    def _run(self, step_func, mbs: list[MicroBatch], forward_only: bool) -> list:
        # seq_length / micro_batch_size only size PP buffers when shapes are fixed; with PP the
        # config sets variable_seq_lengths, so stages exchange each micro-batch's shape
        if self.gpt.config.moe_token_dispatcher_type == "allgather" and self.arch.num_experts:
            group = expert_tp_ep_group()
            if group is not None:  # equal token counts over the group the dispatcher gathers over
                mbs = equalize_tokens(mbs, group, self.info.device)
        return get_forward_backward_func()(
            forward_step_func=step_func, data_iterator=iter(mbs), model=[self.model],
            num_microbatches=len(mbs), seq_length=max(mb.num_tokens for mb in mbs),
            micro_batch_size=max(mb.tokens.shape[0] for mb in mbs), forward_only=forward_only)

    def _dp_sum(self, values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.info.device)
        dist.all_reduce(t, op=op, group=dp_group())
        return t.tolist()

    @on_rank_thread
    def optimizer_step(self) -> tuple[float, float]:
        """Clip, step, advance the LR schedule; returns (grad norm before clipping, lr used)."""
        lr = float(self.optimizer.param_groups[0]["lr"])
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise FloatingPointError("optimizer step skipped: non-finite gradients")
        if grad_norm is None or self.optimizer.config.clip_grad <= 0:
            grad_norm = self.optimizer.get_grad_norm()
        self.scheduler.step(increment=1)
        return float(grad_norm), lr

    @contextlib.contextmanager
    def _counting_routing(self) -> Iterator[None]:
        """Count train/routing_agreement in the forwards of the block (those under the rollout's weights)."""
        for r in self.engine_routing:
            r.count = True
        try:
            yield
        finally:
            for r in self.engine_routing:
                r.count = False

    def _replaying(self, on: bool) -> None:
        """R2: the routers replay the batch's routing (on) or, unless R3 replays always, only compare it."""
        if self.record_routing:
            for r in self.engine_routing:
                r.replay = on

    def _routing_agreement(self) -> dict[str, float]:
        """train/routing_agreement: the share of engine-routed (token, MoE layer) pairs whose own top-k
        set is the engine's, over every rank (TP chunks, PP stages' layers and DP shards are disjoint:
        a sum over the world); absent when no batch carried the engines' routing. Every rank calls it."""
        if not self.engine_routing:
            return {}
        agree, total = self._world_sum([sum(r.agree for r in self.engine_routing),
                                         sum(r.total for r in self.engine_routing)])
        for r in self.engine_routing:
            r.agree = r.total = 0
        return {"train/routing_agreement": agree / total} if total else {}

    def _world_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.info.device)
        dist.all_reduce(t)
        return t.tolist()

    def _sub(self, batch: dict, ids: list[int]) -> dict:
        return {k: [v[i] for i in ids] for k, v in batch.items()}

    def _minibatches(self, n: int) -> list[list[int]]:
        """This rank's mini-batches (global_batch_size / dp samples each); every DP rank must run
        the same number of optimizer steps."""
        per_rank = self.batch.global_batch_size // self.dp_size
        minis = chunks(list(range(n)), per_rank)
        most, neg_least = self._dp_sum([len(minis), -len(minis)], op=dist.ReduceOp.MAX)
        if most != -neg_least:
            raise ValueError(f"DP ranks disagree on the number of mini-batches (this rank: {n} samples,"
                             f" {len(minis)} mini-batches of {per_rank}); shard the batch evenly")
        return minis

    @on_rank_thread
    def save_checkpoint(self, root: str, step: int, extra: dict) -> str:
        """Megatron torch_dist checkpoint of model, optimizer, scheduler and RNG (+ `extra`), atomic;
        every rank calls it. Returns the folder."""
        if self.lora_spec is not None:  # what the adapters are (alpha is in no tensor): for resume and the converter
            extra = {**extra, lora.CHECKPOINT_KEY: lora.spec_record(self.lora_spec)}
        path = checkpoint.save_checkpoint(root, step, [self.model], self.optimizer, self.scheduler, extra,
                                          hf_dir=self.model_cfg.hf_checkpoint)
        return str(path)

    @on_rank_thread
    def load_latest_checkpoint(self, root: str) -> dict | None:
        """Load the newest complete checkpoint under `root` (incomplete saves are skipped), or `root`
        itself when it is one complete checkpoint folder (--load .../iter_0000002); returns its `extra`,
        or None when there is none yet (a fresh run that will save there)."""
        path = Path(root) if checkpoint.is_complete(root) else checkpoint.latest_checkpoint(root)
        if path is None:
            return None
        return checkpoint.load_checkpoint(path, [self.model], self.optimizer, self.scheduler)

    @on_rank_thread
    def shutdown(self) -> None:
        teardown_parallel()


def lora_spec(model: ModelConfig) -> lora.LoRASpec | None:
    """The run's adapters: --lora-rank and friends, or --lora-load's adapter_config.json (its r, lora_alpha and
    dropout; the modules its tensors adapt); None without LoRA. The flags' agreement with the folder is
    checked before launch (preflight)."""
    if model.lora_load:
        return lora.spec_of_folder(model.lora_load)
    if not model.lora_rank:
        return None
    return lora.LoRASpec(rank=model.lora_rank, alpha=model.lora_alpha or 8.0, dropout=model.lora_dropout,
                         targets=model.lora_target_modules)


def moe_metrics(stats: list[dict[str, float]]) -> dict[str, float]:
    """An MoE model's load-balancing losses (megatron's, unscaled by the coefficient), mean over mini-batches."""
    return {f"train/moe_{key[len('moe/'):]}": sum(st[key] for st in stats) / len(stats)
            for key in stats[0] if key.startswith("moe/")}


def mtp_metrics(stats: list[dict[str, float]]) -> dict[str, float]:
    """The multi-token-prediction losses (train/mtp_loss: their sum over the MTP layers, train/mtp_<k>_loss each, as
    slime logs them; unscaled by --mtp-loss-scaling-factor), mean over mini-batches; {} without MTP training."""
    return {f"train/{key[len('mtp/'):]}": sum(st[key] for st in stats) / len(stats)
            for key in stats[0] if key.startswith("mtp/")}


def megatron_optimizer_config(optim: OptimizerConfig, bf16: bool, params_dtype: torch.dtype,
                              on_gpu: bool) -> MegatronOptimizerConfig:
    """megatron-core's optimizer settings for a rank: the distributed optimizer (fp32 main params and Adam
    states sharded over the data-parallel ranks); with --optimizer-cpu-offload on a GPU, megatron-core's
    HybridDeviceOptimizer keeps --optimizer-offload-fraction of the shard in pinned host memory and steps it
    with torch's AdamW on the CPU. Megatron-LM turns --use-precision-aware-optimizer on with it (the hybrid
    optimizer takes the decoupled-grad path of that flag); alone that flag needs TransformerEngine's
    FusedAdam, and with fp32 states it changes nothing, so it is not passed on."""
    offload = optim.cpu_offload and on_gpu
    return MegatronOptimizerConfig(
        optimizer=optim.optimizer, lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
        clip_grad=optim.clip_grad, adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps, bf16=bf16, params_dtype=params_dtype, use_distributed_optimizer=True,
        optimizer_cpu_offload=offload, use_precision_aware_optimizer=offload,
        optimizer_offload_fraction=optim.offload_fraction if offload else 0.0,
        overlap_cpu_optimizer_d2h_h2d=offload and optim.overlap_cpu_d2h_h2d)
