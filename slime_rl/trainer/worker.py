"""TrainerWorker: one Megatron rank (plain Python; the orchestration room wraps it in a Ray actor).

One `train_step` = old log-probs (+ entropy) by a forward-only pass, reference log-probs when a
KL loss is used (reference weights swapped in from a frozen CPU copy, as slime does), then one
optimizer step per mini-batch of global_batch_size / dp_size samples of this rank, each run
through megatron's forward-backward schedule in micro-batches. The same code runs on GPUs
(nccl) and on CPU (gloo + cpu_compat).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist

from slime_rl.config.groups import AlgoConfig, BatchConfig, ModelConfig, OptimizerConfig, ParallelConfig
from slime_rl.trainer import cpu_compat, hf_io
from slime_rl.trainer.batching import MicroBatch, build_micro_batch, chunks, unpad, validate_batch
from slime_rl.trainer.model import build_from_checkpoint
from slime_rl.trainer.parallel import dp_group, init_parallel, teardown_parallel
from slime_rl.trainer.steps import STAT_KEYS, LossScale, forward_only_step, policy_loss_step


class TrainerWorker:
    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int,
                 parallel: ParallelConfig, batch: BatchConfig, optim: OptimizerConfig, model: ModelConfig,
                 algo: AlgoConfig, train_iters: int, pad_vocab_multiple: int = 1) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.transformer.module import Float16Module

        tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
        if pp != 1:
            raise NotImplementedError("--pipeline-model-parallel-size > 1 is not supported by the "
                                      "trainer yet (HF weight I/O and log-prob collection are PP=1)")
        if train_iters < 1 or train_iters <= optim.lr_warmup_iters:
            raise ValueError(f"train_iters={train_iters} must be >= 1 and > --lr-warmup-iters "
                             f"{optim.lr_warmup_iters}")
        self.batch, self.algo, self.model_cfg = batch, algo, model
        # megatron's distributed optimizer reads .grad of its (non-leaf) shard views in zero_grad,
        # which makes torch warn on every step, GPU or CPU: noise, not a problem of ours
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
        self.info = init_parallel(rank, world_size, master_addr, master_port, tp, pp, model.seed)
        if batch.global_batch_size % self.info.dp_size != 0:
            raise ValueError(f"--global-batch-size {batch.global_batch_size} is not divisible by the "
                             f"data-parallel size {self.info.dp_size}")
        self.arch, self.gpt = build_from_checkpoint(model.hf_checkpoint, bf16=model.bf16, tp_size=tp,
                                                    pp_size=pp, pad_vocab_multiple=pad_vocab_multiple)
        hf_io.load_hf_weights(self.gpt, model.hf_checkpoint, self.arch)
        config = self.gpt.config
        # Float16Module keeps bf16 params and returns float32 logits on the last stage
        inner = Float16Module(config, self.gpt) if model.bf16 else self.gpt
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=True)
        self.model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=inner)
        from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig

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
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=optim.lr, min_lr=optim.min_lr,
            lr_warmup_steps=optim.lr_warmup_iters, lr_decay_steps=optim.lr_decay_iters or train_iters,
            lr_decay_style=optim.lr_decay_style, start_wd=optim.weight_decay, end_wd=optim.weight_decay,
            wd_incr_steps=train_iters, wd_incr_style="constant")
        self._ref: dict[str, torch.Tensor] | None = None
        if algo.use_reference:
            self._ref = {n: p.detach().to("cpu", copy=True) for n, p in self.gpt.named_parameters()}

    def _compat(self) -> None:
        # the CPU layer's device mode is per thread; a host may call us from a different thread
        # than the constructor's (no-op on GPU and when already active here)
        if self.info.device.type == "cpu":
            cpu_compat.apply()

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

    # ---- forward-only passes
    def _micro_batches(self, batch: dict, ids: list[int], per_token: dict | None = None) -> list[MicroBatch]:
        return [build_micro_batch(batch, c, self.info.device, per_token)
                for c in chunks(ids, self.batch.micro_batch_size)]

    def _run(self, step_func, mbs: list[MicroBatch], forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()(
            forward_step_func=step_func, data_iterator=iter(mbs), model=[self.model],
            num_microbatches=len(mbs), seq_length=max(mb.tokens.shape[1] for mb in mbs),
            micro_batch_size=self.batch.micro_batch_size, forward_only=forward_only)

    @torch.no_grad()
    def _forward_logprobs(self, batch: dict, with_entropy: bool) -> tuple[list, list | None]:
        n = len(batch["tokens"])
        step = forward_only_step(self.algo.temperature, self.arch.vocab_size, with_entropy)
        store = self._run(step, self._micro_batches(batch, list(range(n))), forward_only=True)
        logp: list = [None] * n
        ent: list | None = [None] * n if with_entropy else None
        for out in store:
            mb = out["mb"]
            for i, row in zip(mb.sample_ids, unpad(out["logp"], mb), strict=True):
                logp[i] = row
            if ent is not None:
                for i, row in zip(mb.sample_ids, unpad(out["entropy"], mb), strict=True):
                    ent[i] = row
        return logp, ent

    def compute_logprobs(self, batch: dict) -> list[list[float]]:
        """Log-probs (of logits / algo.temperature) of each sample's response tokens; forward only.
        `batch` needs `tokens` and `response_lengths`."""
        self._compat()
        if validate_batch(batch, ("tokens", "response_lengths")) == 0:
            return []
        return self._forward_logprobs(batch, with_entropy=False)[0]

    @contextlib.contextmanager
    def reference_weights(self) -> Iterator[None]:
        """Swap the frozen initial weights in for the block, then the current ones back (exactly)."""
        assert self._ref is not None, "no reference copy: algo.kl_loss_coef is 0"
        self._compat()
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
    def _dp_sum(self, values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.info.device)
        dist.all_reduce(t, op=op, group=dp_group())
        return t.tolist()

    def forward_backward(self, batch: dict, old_logprobs: list, ref_logprobs: list | None = None) -> dict:
        """Zero the grads, run one mini-batch (this rank's samples) through the schedule; the
        DP-reduced gradient is left in each param's `main_grad`. Returns the DP-summed STAT_KEYS."""
        self._compat()
        per_token = {"old_logp": old_logprobs}
        if ref_logprobs is not None:
            per_token["ref_logp"] = ref_logprobs
        mbs = self._micro_batches(batch, list(range(len(batch["tokens"]))), per_token)
        local_tokens = float(sum(mb.loss_mask.sum().item() for mb in mbs))
        (global_tokens,) = self._dp_sum([local_tokens])
        scale = LossScale(num_microbatches=len(mbs), dp_size=self.dp_size, global_tokens=global_tokens)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        store = self._run(policy_loss_step(self.algo, self.arch.vocab_size, scale), mbs, forward_only=False)
        sums = torch.stack([out["sums"] for out in store]).sum(dim=0).tolist()
        return dict(zip(STAT_KEYS, self._dp_sum(sums), strict=True))

    def optimizer_step(self) -> tuple[float, float]:
        """Clip, step, advance the LR schedule; returns (grad norm before clipping, lr used)."""
        self._compat()
        lr = float(self.optimizer.param_groups[0]["lr"])
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise FloatingPointError("optimizer step skipped: non-finite gradients")
        if grad_norm is None or self.optimizer.config.clip_grad <= 0:
            grad_norm = self.optimizer.get_grad_norm()
        self.scheduler.step(increment=1)
        return float(grad_norm), lr

    def _sub(self, batch: dict, ids: list[int]) -> dict:
        return {k: [v[i] for i in ids] for k, v in batch.items()}

    def train_step(self, batch: dict) -> dict[str, float]:
        """One RL update on this DP rank's shard (see module docstring). Metrics, equal on every rank:
        train/loss, train/pg_loss (DAPO token means, averaged over the mini-batches);
        train/kl: with a reference model the token mean of algo.kl_loss_type(logp, ref_logp)
          averaged over mini-batches; without, mean(old_logp - logp) of the LAST mini-batch (a k1
          estimate of KL(old || new) after the earlier mini-batches' updates; 0 with one mini-batch);
        train/entropy, train/rollout_logprob_abs_diff: token means over loss-masked tokens, from the
          old-log-prob pass; train/pg_clipfrac: clipped fraction of all trained tokens;
        train/grad_norm: mean over the optimizer steps; train/lr: lr of the last step.
        """
        self._compat()
        n = validate_batch(batch)
        if n == 0:
            raise ValueError("train_step got an empty batch on this DP rank")
        old, entropy = self._forward_logprobs(batch, with_entropy=True)
        ref = None
        if self._ref is not None:
            with self.reference_weights():
                ref = self._forward_logprobs(batch, with_entropy=False)[0]
        ent_sum = diff_sum = tokens = 0.0
        for i in range(n):
            m = torch.tensor(batch["loss_masks"][i], dtype=torch.float64)
            ent_sum += float((torch.tensor(entropy[i], dtype=torch.float64) * m).sum())
            diff = torch.tensor(old[i], dtype=torch.float64) - torch.tensor(batch["rollout_logprobs"][i],
                                                                             dtype=torch.float64)
            diff_sum += float((diff.abs() * m).sum())
            tokens += float(m.sum())
        ent_sum, diff_sum, tokens = self._dp_sum([ent_sum, diff_sum, tokens])

        per_rank = self.batch.global_batch_size // self.dp_size
        minis = chunks(list(range(n)), per_rank)
        most, neg_least = self._dp_sum([len(minis), -len(minis)], op=dist.ReduceOp.MAX)
        if most != -neg_least:  # every rank must run the same number of optimizer steps
            raise ValueError(f"DP ranks disagree on the number of mini-batches (this rank: {n} samples,"
                             f" {len(minis)} mini-batches of {per_rank}); shard the batch evenly")
        stats, norms, lr = [], [], 0.0
        for ids in minis:
            s = self.forward_backward(self._sub(batch, ids), [old[i] for i in ids],
                                      None if ref is None else [ref[i] for i in ids])
            grad_norm, lr = self.optimizer_step()
            stats.append(s)
            norms.append(grad_norm)
        coef = self.algo.kl_loss_coef if ref is not None else 0.0
        per_mini = [(s["pg"] / max(s["tokens"], 1.0), s["kl"] / max(s["tokens"], 1.0)) for s in stats]
        last = stats[-1]
        return {
            "train/loss": sum(pg + coef * kl for pg, kl in per_mini) / len(per_mini),
            "train/pg_loss": sum(pg for pg, _ in per_mini) / len(per_mini),
            "train/kl": (sum(kl for _, kl in per_mini) / len(per_mini) if ref is not None
                         else last["k1_old_new"] / max(last["tokens"], 1.0)),
            "train/entropy": ent_sum / max(tokens, 1.0),
            "train/grad_norm": sum(norms) / len(norms),
            "train/rollout_logprob_abs_diff": diff_sum / max(tokens, 1.0),
            "train/pg_clipfrac": sum(s["clipped"] for s in stats) / max(sum(s["tokens"] for s in stats), 1.0),
            "train/lr": lr,
        }

    # ---- weights out
    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, full tensor) for weight sync; every rank must consume it to the end. A tensor
        may share storage with a parameter (e.g. norms, TP=1): copy it to keep it past an update."""
        self._compat()
        yield from hf_io.iter_hf_weights(self.gpt, self.arch)

    def hf_weight_metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return hf_io.hf_weight_metadata(self.gpt, self.arch)

    def shutdown(self) -> None:
        self._compat()
        teardown_parallel()
