"""TrainerWorker: one Megatron rank (plain Python; the orchestration room wraps it in a Ray actor).

One `train_step` = old log-probs (+ entropy) by a forward-only pass, reference log-probs when a
KL loss or reward KL is used (reference weights swapped in from a frozen CPU copy, as slime does),
per-token advantages for the token-level estimators (objective.py), then one
optimizer step per mini-batch of global_batch_size / dp_size samples of this rank, each run
through megatron's forward-backward schedule in micro-batches (packed THD rows by default, grouped
by count or by token budget: micro.py). With PP the schedule is 1F1B; the last stage computes
log-probs and the loss, and broadcasts them over its PP group, so every rank returns the same
values. The same code runs on GPUs (nccl) and on CPU (gloo + cpu_compat).
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Iterator

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
from slime_rl.observability.debug_data import save_debug_data
from slime_rl.trainer import checkpoint, hf_export, hf_io
from slime_rl.trainer.batching import MicroBatch, chunks, validate_batch
from slime_rl.trainer.debug_data import FUSED, SEPARATE, TrainDataDump, train_data, writes_train_data
from slime_rl.trainer.equal_tokens import equalize_tokens
from slime_rl.trainer.loss_agg import GlobalCounts, check_mode, local_counts, token_weights
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
from slime_rl.trainer.micro import MicroBatching, collect_per_sample, rows_by_sample
from slime_rl.trainer.model import MoEOptions, build_from_checkpoint, moe_aux_losses
from slime_rl.trainer.objective import (
    StepInputs,
    combine_stats,
    dp_reduce_stats,
    fused_step_sums,
    step_metrics,
    step_sums,
    token_advantages,
    train_metrics,
)
from slime_rl.trainer.parallel import (
    broadcast_from_last_stage,
    dp_group,
    expert_tp_ep_group,
    init_parallel,
    teardown_parallel,
    tp_group,
)
from slime_rl.trainer.routing_replay import BATCH_KEY as ROUTING_KEY
from slime_rl.trainer.routing_replay import attach as attach_engine_routing
from slime_rl.trainer.routing_replay import sample_routing
from slime_rl.trainer.steps import STAT_KEYS, LossScale, forward_only_step, policy_loss_step
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
        self.info = init_parallel(rank, world_size, master_addr, master_port, tp, pp, model.seed, cp_size=cp,
                                  ep_size=ep, etp_size=etp)
        if batch.global_batch_size % self.info.dp_size != 0:
            raise ValueError(f"--global-batch-size {batch.global_batch_size} is not divisible by the "
                             f"data-parallel size {self.info.dp_size}")
        self.arch, self.gpt = build_from_checkpoint(
            model.hf_checkpoint, bf16=model.bf16, tp_size=tp, pp_size=pp,
            pad_vocab_multiple=pad_vocab_multiple, sequence_parallel=trainer.sequence_parallel,
            recompute_granularity=trainer.recompute_granularity, recompute_method=trainer.recompute_method,
            recompute_num_layers=trainer.recompute_num_layers, context_parallel_size=cp,
            fp32_lm_head=model.fp32_lm_head,
            moe=moe)
        hf_io.load_hf_weights(self.gpt, model.hf_checkpoint, self.arch)
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
                                   cp_size=cp, cp_rank=self.info.cp_rank, vision=vision, routing=routing)
        self._prepare_model()
        config = self.gpt.config
        if pp > 1 and self.info.device.type == "cpu":
            config.batch_p2p_comm = False  # gloo has no batched (coalesced) isend/irecv
        # Float16Module keeps bf16 params and returns float32 logits on the last stage
        fp32_buffers = float_buffers(self.gpt.vision_model) if hasattr(self.gpt, "vision_model") else {}
        inner = Float16Module(config, self.gpt) if model.bf16 else self.gpt
        if fp32_buffers:  # the HF vision tower keeps its RoPE frequencies in float32, as the engine does
            restore_buffers(self.gpt.vision_model, fp32_buffers)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=True)
        self.model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=inner)
        self.optimizer = get_megatron_optimizer(MegatronOptimizerConfig(
            optimizer=optim.optimizer, lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
            clip_grad=optim.clip_grad, adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2,
            adam_eps=optim.adam_eps, bf16=model.bf16, params_dtype=config.params_dtype,
            use_distributed_optimizer=True,
        ), [self.model])
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
        path = checkpoint.save_checkpoint(root, step, [self.model], self.optimizer, self.scheduler, extra,
                                          hf_dir=self.model_cfg.hf_checkpoint)
        return str(path)

    @on_rank_thread
    def load_latest_checkpoint(self, root: str) -> dict | None:
        """Load the newest complete checkpoint under `root` (incomplete saves are skipped); returns its
        `extra`, or None when there is none yet (a fresh run that will save there)."""
        path = checkpoint.latest_checkpoint(root)
        if path is None:
            return None
        return checkpoint.load_checkpoint(path, [self.model], self.optimizer, self.scheduler)

    @on_rank_thread
    def shutdown(self) -> None:
        teardown_parallel()


def moe_metrics(stats: list[dict[str, float]]) -> dict[str, float]:
    """An MoE model's load-balancing losses (megatron's, unscaled by the coefficient), mean over mini-batches."""
    return {f"train/moe_{key[len('moe/'):]}": sum(st[key] for st in stats) / len(stats)
            for key in stats[0] if key.startswith("moe/")}


class TrainerWorker(MegatronRank):
    """The policy's rank: log-probs, the reference copy, the RL train step, weights out."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._ref: dict[str, torch.Tensor] | None = None
        self._updates = 0  # rollouts trained (policy updates), for --ref-update-interval
        if self.algo.use_reference:
            if self.model_cfg.ref_load:
                self._load_reference(self.model_cfg.ref_load)
            else:
                self._refresh_reference()

    def _refresh_reference(self) -> None:
        """The reference (KL) weights := the current policy, as a CPU copy (swapped in only for the
        reference forward, so it costs host memory, not device memory)."""
        self._ref = {n: p.detach().to("cpu", copy=True) for n, p in self.gpt.named_parameters()}

    def _load_reference(self, path: str) -> None:
        """The reference (KL) weights := those of `path` (--ref-load): a Megatron checkpoint (a root
        or one checkpoint folder; ours, the HF converter's, or Megatron-LM's torch_dist) or an HF
        folder of the same architecture. Loaded through the policy's own model (so TP/PP sharding
        and the name maps are the policy's), copied to the CPU, then the policy's weights are put
        back exactly. Every rank calls it (the checkpoint load is collective)."""
        params = dict(self.gpt.named_parameters())
        backup = {n: p.detach().to("cpu", copy=True) for n, p in params.items()}
        try:
            if checkpoint.is_megatron_checkpoint(path):
                checkpoint.load_checkpoint(path, [self.model], load_optim=False, load_rng=False)
            elif os.path.isfile(os.path.join(path, "config.json")):
                hf_io.load_hf_weights(self.gpt, path, self.arch)
            else:
                raise ValueError("neither a Megatron checkpoint (latest_checkpointed_iteration.txt, iter_*/ or "
                                 "metadata.json) nor an HF folder (config.json + safetensors)")
            self._ref = {n: p.detach().to("cpu", copy=True) for n, p in params.items()}
        except (ValueError, FileNotFoundError, AssertionError, KeyError) as e:
            raise ValueError(f"--ref-load {path}: {e}") from e
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(backup[n])

    def load_latest_checkpoint(self, root: str) -> dict | None:
        """As MegatronRank's; with --ref-update-interval the reference restarts from the loaded
        weights, which is exact when the run resumes at a multiple of the interval (with --ref-load,
        a resume before the first refresh keeps the --ref-load weights)."""
        extra = super().load_latest_checkpoint(root)
        if extra is not None and self.algo.ref_update_interval and self._ref is not None:
            self._updates = int(extra.get("rollout_id", -1)) + 1
            if not self.model_cfg.ref_load or self._updates >= self.algo.ref_update_interval:
                self._refresh_reference()
        return extra

    # ---- forward-only passes
    @torch.no_grad()
    def _forward_logprobs(self, batch: dict, with_entropy: bool,
                          groups: list[list[int]] | None = None) -> tuple[list, list | None]:
        n = len(batch["tokens"])
        step = forward_only_step(self.algo.temperature, self.arch.vocab_size, with_entropy)
        mbs = self.micro.micro_batches(batch, groups or self.micro.groups(batch, list(range(n))))
        store = self._run(step, mbs, forward_only=True)
        lens = [int(r) for r in batch["response_lengths"]]
        logp = collect_per_sample(store, "logp", n, lens, self.info.device)
        ent = collect_per_sample(store, "entropy", n, lens, self.info.device) if with_entropy else None
        return logp, ent

    def _recorded_routing(self, batch: dict) -> tuple[list, list | None, list]:
        """R2: the old-log-prob forward (_forward_logprobs with entropy) with every router recording the
        top-k it chooses on its own (engine routing in the batch is compared, not replayed); returns
        (log-probs, entropy, per-sample routing in routing_replay.BATCH_KEY's form)."""
        layers, topk, experts, sp, _ = self.micro.routing
        for r in self.engine_routing:
            r.recording, r.replay = [], False
        try:
            n = len(batch["tokens"])
            groups = self.micro.groups(batch, list(range(n)))
            logp, ent = self._forward_logprobs(batch, with_entropy=True, groups=groups)
            recorded = {r.layer: r.recording for r in self.engine_routing}
        finally:
            for r in self.engine_routing:
                r.recording, r.replay = None, False
        if sp > 1:  # sequence parallel: each TP rank's router saw its contiguous chunk of the row
            recorded = {layer: [self._tp_gather(c) for c in calls] for layer, calls in recorded.items()}
        routing: list = [None] * n
        for layer, calls in recorded.items():
            if len(calls) != len(groups):
                raise RuntimeError(f"routing replay, layer {layer}: {len(calls)} router calls recorded for "
                                   f"{len(groups)} micro-batches")
        for k, ids in enumerate(groups):
            mb = self.micro.build(batch, ids)  # the geometry the forward ran
            starts = mb.packed_seq_params.cu_seqlens_q[:len(ids)].tolist() if mb.packed_seq_params is not None \
                else None
            rows = sample_routing({layer: calls[k] for layer, calls in recorded.items()},
                                  [len(batch["tokens"][i]) for i in ids], layers, topk, experts, mb.num_tokens, starts)
            for i, row in zip(ids, rows, strict=True):
                routing[i] = row
        return logp, ent, routing

    def _tp_gather(self, t: torch.Tensor) -> torch.Tensor:
        """The TP ranks' chunks of a [tokens, k] tensor concatenated in TP rank order (on the CPU)."""
        t = t.to(self.info.device)
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(tp_group()))]
        dist.all_gather(parts, t, group=tp_group())
        return torch.cat(parts).cpu()

    @on_rank_thread
    def compute_logprobs(self, batch: dict) -> list[list[float]]:
        """Log-probs (of logits / algo.temperature) of each sample's response tokens; forward only.
        `batch` needs `tokens` and `response_lengths`."""
        if validate_batch(batch, ("tokens", "response_lengths")) == 0:
            return []
        return self._forward_logprobs(batch, with_entropy=False)[0]

    @contextlib.contextmanager
    @on_rank_thread
    def reference_weights(self) -> Iterator[None]:
        """Swap the reference weights (the initial policy, or the last refresh under
        --ref-update-interval) in for the block, then the current ones back (exactly)."""
        assert self._ref is not None, "no reference copy: the worker was built with algo.use_reference false"
        params = dict(self.gpt.named_parameters())
        backup = {n: p.detach().to("cpu", copy=True) for n, p in params.items()}
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(self._ref[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(backup[n])

    # ---- training
    @on_rank_thread
    def forward_backward(self, batch: dict, old_logprobs: list | None, ref_logprobs: list | None = None,
                         advantages: list | None = None, fused_old_out: list | None = None) -> dict:
        """Zero the grads, run one mini-batch (this rank's samples) through the schedule; the
        DP-reduced gradient is left in the grad buffers (`main_grad`; the distributed optimizer
        reduce-scatters, so each DP rank holds the reduced values of its own shard). `advantages`:
        per-token lists (token-level estimators) replacing the batch's scalar ones. Returns the
        DP-summed STAT_KEYS (identical on every rank; "loss" is the mini-batch loss L of loss_agg.py;
        MAX_STAT_KEYS are maxima instead).
        old_logprobs None: the fused path (objective.policy_objective), the old log-probs are this
        forward's own; only when the mini-batch is the whole step on every rank (train_step).
        fused_old_out (fused path, last pipeline stage; --save-debug-train-data): a list that gets those
        old log-probs, one list per sample of `batch`; nothing is kept when it is None."""
        tokens, samples = self._dp_sum(list(local_counts(batch["loss_masks"])))
        counts = GlobalCounts(tokens=tokens, samples=samples, max_len=self.loss_agg_max_len)
        per_token = {"loss_weight": token_weights(batch["loss_masks"], self.loss_agg_mode, counts)}
        if old_logprobs is not None:
            per_token["old_logp"] = old_logprobs
        if ref_logprobs is not None:
            per_token["ref_logp"] = ref_logprobs
        if advantages is not None:
            per_token["advantages"] = advantages  # overrides the scalar broadcast
        groups = self.micro.equalized_groups(batch, list(range(len(batch["tokens"]))), dp_group(),
                                             self.info.device)
        mbs = self.micro.micro_batches(batch, groups, per_token)
        scale = LossScale(num_microbatches=len(mbs), dp_size=self.dp_size)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        keep = fused_old_out is not None and old_logprobs is None
        store = self._run(policy_loss_step(self.algo, self.arch.vocab_size, scale, fused_old=old_logprobs is None,
                                           keep_logp=keep), mbs, forward_only=False)
        if keep and store:  # the last pipeline stage: every micro-batch's detached log-probs, back per sample
            fused_old_out.extend(rows_by_sample(store, "logp", batch["response_lengths"]))
        sums = torch.zeros(len(STAT_KEYS), dtype=torch.float32, device=self.info.device)
        if store:  # the last pipeline stage
            sums.copy_(combine_stats(torch.stack([out["sums"] for out in store])))
        broadcast_from_last_stage(sums)
        out = dp_reduce_stats(sums.tolist(), self._dp_sum)
        # an MoE model's load-balancing losses (megatron's tracker: mean over layers and
        # micro-batches, averaged over DP; identical on every rank)
        out.update(moe_aux_losses(self.gpt.config, len(mbs)))
        return out

    def _reference_logprobs(self, batch: dict) -> list | None:
        """The reference model's log-probs of the batch (a forward under the reference weights) when
        the algorithm uses one (algo.use_reference), else None."""
        if not self.algo.use_reference:
            return None
        if self._ref is None:
            raise ValueError("the algorithm needs a reference model but the worker was built without "
                             "one (construct it with an AlgoConfig whose use_reference is true)")
        with self.reference_weights():
            return self._forward_logprobs(batch, with_entropy=False)[0]

    @on_rank_thread
    def step_inputs(self, batch: dict, values: list | None = None) -> StepInputs:
        """Everything a train step computes once before its mini-batches: old log-probs and
        entropy (forward only), reference log-probs (algo.use_reference), per-token advantages
        (algo.token_level_advantages; whitened over the DP group; ppo: GAE on the critic's
        `values`, which also gives the returns) and the DP-summed step sums."""
        routing = None
        with self._counting_routing():
            if self.record_routing:
                old, entropy, routing = self._recorded_routing(batch)
            else:
                old, entropy = self._forward_logprobs(batch, with_entropy=True)
        ref = self._reference_logprobs(batch)
        adv = returns = None
        if self.algo.token_level_advantages:
            adv, returns = token_advantages(self.algo, batch, old, ref, self.info.device, dp_group(), values)
        inputs = StepInputs(old=old, entropy=entropy, ref=ref, advantages=adv, sums={}, returns=returns,
                            routing=routing)
        inputs.sums = step_sums(batch, inputs, self.info.device, dp_group())
        return inputs

    @on_rank_thread
    def train_step(self, batch: dict, inputs: StepInputs | None = None, update: bool = True,
                   dump: TrainDataDump | None = None) -> dict[str, float]:
        """One RL update on this DP rank's shard (see module docstring); the metrics, identical on
        every rank, are objective.train_metrics'. `inputs`: step_inputs(batch) when the caller
        computed them already (ppo: it needs their returns for the critic). update=False (PPO's
        critic-only steps) changes nothing and returns objective.step_metrics. `dump`
        (--save-debug-train-data): after the step, the rank that writes for this DP rank
        (debug_data.writes_train_data) saves the shard with its old log-probs there."""
        n = validate_batch(batch)
        if n == 0:
            raise ValueError("train_step got an empty batch on this DP rank")
        minis = self._minibatches(n) if update else []
        if inputs is None and self._on_policy(minis):
            return self._fused_train_step(batch, dump)
        t0 = time.perf_counter()
        if inputs is None:
            inputs = self.step_inputs(batch)
        if not update:
            self._save_train_data(dump, batch, inputs.old, inputs.advantages, SEPARATE)
            return step_metrics(inputs.sums)

        def pick(rows: list | None, ids: list[int]) -> list | None:
            return None if rows is None else [rows[i] for i in ids]

        t1 = time.perf_counter()
        stats, norms, lr, opt_s = [], [], 0.0, 0.0
        for ids in minis:
            sub = self._sub(batch, ids)
            if inputs.routing is not None:  # R2: the old-log-prob forward's routing, replayed
                sub[ROUTING_KEY] = pick(inputs.routing, ids)
            self._replaying(inputs.routing is not None)
            try:
                s = self.forward_backward(sub, pick(inputs.old, ids), pick(inputs.ref, ids),
                                          pick(inputs.advantages, ids))
            finally:
                self._replaying(False)
            t = time.perf_counter()
            grad_norm, lr = self.optimizer_step()
            opt_s += time.perf_counter() - t
            stats.append(s)
            norms.append(grad_norm)
        t2 = time.perf_counter()
        self._updates += 1
        if self.algo.ref_update_interval and self._updates % self.algo.ref_update_interval == 0:
            self._refresh_reference()
        self.last_timings = {"perf/train_inputs_s": t1 - t0, "perf/train_fwd_bwd_s": t2 - t1 - opt_s,
                             "perf/train_optimizer_s": opt_s}
        self._save_train_data(dump, batch, inputs.old, inputs.advantages, SEPARATE)
        return (train_metrics(self.algo, inputs.sums, stats, norms, lr, have_ref=inputs.ref is not None)
                | moe_metrics(stats) | self._routing_agreement())

    @property
    def writes_train_data(self) -> bool:
        """Whether this rank writes its DP rank's --save-debug-train-data file (debug_data.writes_train_data)."""
        return writes_train_data(self.info.tp_rank, self.info.cp_rank, self.info.pp_rank, self.info.pp_size)

    def _save_train_data(self, dump: TrainDataDump | None, batch: dict, old: list | None,
                         advantages: list | None, source: str) -> None:
        if dump is None or not self.writes_train_data:
            return
        assert old is not None, "the old log-probs of the step are needed for --save-debug-train-data"
        save_debug_data(dump.path, train_data(dump.rollout_id, self.dp_rank, self.dp_size, batch, old, advantages,
                                              source))

    # wall seconds of the last train_step's phases on this rank (the RankActor adds them to the step's
    # metrics; the phases end in host syncs: DP-summed stats, the grad norm): old/ref log-probs and
    # advantages, forward+backward of the mini-batches, optimizer steps
    last_timings: dict[str, float] = {}

    def _on_policy(self, minis: list[list[int]]) -> bool:
        """Whether this step may take its old log-probs from the training forward: one mini-batch
        (one optimizer step) per rank, so nothing has changed the weights since the rollout's
        sync; estimators whose advantages need the old log-probs first (token-level) and
        --separate-old-logprobs keep the separate pass. Every DP rank decides alike (`minis`, from
        _minibatches, has the same length on every DP rank)."""
        if self.algo.separate_old_logprobs or self.algo.token_level_advantages:
            return False
        return len(minis) == 1

    def _fused_train_step(self, batch: dict, dump: TrainDataDump | None = None) -> dict[str, float]:
        """train_step with old log-probs and the old policy's entropy from the one training forward
        (objective.policy_objective, fused path); the reference log-probs (KL) still take their own
        forward under the reference weights. Same metrics as the two-pass step. `dump`: the
        training forward's detached log-probs are kept (writing rank only) and saved after the step."""
        t0 = time.perf_counter()
        ref = self._reference_logprobs(batch)
        batch_sums = step_sums(batch, None, self.info.device, dp_group())
        t1 = time.perf_counter()
        old: list | None = [] if dump is not None and self.writes_train_data else None
        with self._counting_routing():
            stats = self.forward_backward(batch, None, ref, None, fused_old_out=old)  # DP-summed floats: synchronized
        t2 = time.perf_counter()
        grad_norm, lr = self.optimizer_step()
        t3 = time.perf_counter()
        self._updates += 1
        if self.algo.ref_update_interval and self._updates % self.algo.ref_update_interval == 0:
            self._refresh_reference()
        self.last_timings = {"perf/train_inputs_s": t1 - t0, "perf/train_fwd_bwd_s": t2 - t1,
                             "perf/train_optimizer_s": t3 - t2}
        self._save_train_data(dump, batch, old, None, FUSED)
        return (train_metrics(self.algo, fused_step_sums(batch_sums, stats), [stats], [grad_norm], lr,
                              have_ref=ref is not None) | moe_metrics([stats]) | self._routing_agreement())

    # ---- weights out
    @on_rank_thread
    def iter_hf_weights(self, skip_frozen: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, full tensor) of this pipeline stage's parameters (global HF names; a tied
        embedding only from stage 0) for weight sync; every rank must consume it to the end (TP
        all-gathers). A tensor may share storage with a parameter (e.g. norms, TP=1): copy it to
        keep it past an update. With PP, the union over stages is the whole HF state dict.
        `skip_frozen`: without parameters that never train (--freeze-vision-tower)."""
        yield from hf_io.iter_hf_weights(self.gpt, self.arch, skip_frozen=skip_frozen)

    @on_rank_thread
    def iter_hf_sources(self, skip_frozen: bool = False) -> Iterator[hf_io.HFSource]:
        """What weight sync sends: (hf_name, source, hf_shape), see `hf_io.iter_hf_sources` (at TP=1
        cached views of the parameters, so a sync builds nothing)."""
        yield from hf_io.iter_hf_sources(self.gpt, self.arch, skip_frozen=skip_frozen)

    def hf_weight_metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return hf_io.hf_weight_metadata(self.gpt, self.arch)

    @on_rank_thread
    def save_hf(self, path: str) -> str:
        """The model as an HF folder at `path` (atomic; config, tokenizer, generation config copied
        from --hf-checkpoint; vocab padding removed), through the weight-sync gather path; every
        rank calls it, global rank 0 writes."""
        return str(hf_export.save_hf_folder(self.gpt, self.arch, path, self.model_cfg.hf_checkpoint))
