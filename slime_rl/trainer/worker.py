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
from collections.abc import Iterator

import torch
import torch.distributed as dist

from slime_rl.observability.debug_data import save_debug_data
from slime_rl.trainer import checkpoint, hf_export, hf_io, lora
from slime_rl.trainer.batching import validate_batch
from slime_rl.trainer.debug_data import FUSED, SEPARATE, TrainDataDump, train_data, writes_train_data
from slime_rl.trainer.loss_agg import GlobalCounts, local_counts, token_weights
from slime_rl.trainer.mcore import MTPLossLoggingHelper, mpu, on_rank_thread
from slime_rl.trainer.micro import collect_per_sample, rows_by_sample
from slime_rl.trainer.model import moe_aux_losses
from slime_rl.trainer.objective import (
    StepInputs,
    combine_stats,
    dp_reduce_stats,
    fused_step_sums,
    opd_advantages,
    opd_sums,
    step_metrics,
    step_sums,
    token_advantages,
    train_metrics,
)
from slime_rl.trainer.parallel import broadcast_from_last_stage, dp_group, tp_group
from slime_rl.trainer.rank import MegatronRank, moe_metrics, mtp_metrics
from slime_rl.trainer.routing_replay import BATCH_KEY as ROUTING_KEY
from slime_rl.trainer.routing_replay import sample_routing
from slime_rl.trainer.steps import STAT_KEYS, LossScale, forward_only_step, policy_loss_step

LORA_ADAPTER_DIR = "lora_adapter"  # --save-hf's folder of a LoRA run holds the adapters here


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
                self._refresh_reference(base=bool(self.lora))
        # --use-opd: the teacher's weights, on the host like the reference's, swapped in for its forward
        self._teacher = self._load_copy(self.model_cfg.opd_teacher_load, "--opd-teacher-load") \
            if self.algo.use_opd and self.algo.opd_type != "sglang" else None

    def _refresh_reference(self, base: bool = False) -> None:
        """The reference (KL) weights := the current policy, as a CPU copy (swapped in only for the
        reference forward, so it costs host memory, not device memory). With LoRA only the adapters are
        copied (the base weights never change), and `base` zeroes their B: the reference is the base model
        without adapters, with no second copy of it."""
        if not self.lora:
            self._ref = {n: p.detach().to("cpu", copy=True) for n, p in self.gpt.named_parameters()}
            return
        self._ref = {n: p.detach().to("cpu", copy=True) for n, p in self.gpt.named_parameters()
                     if lora.is_adapter_name(n)}
        if base:
            self._ref = _without_adapters(self._ref)

    def _load_reference(self, path: str) -> None:
        """The reference (KL) weights := those of `path` (--ref-load, `_load_copy`)."""
        self._ref = self._load_copy(path, "--ref-load")

    def _load_copy(self, path: str, flag: str) -> dict[str, torch.Tensor]:
        """The weights of `path` (--ref-load, --opd-teacher-load) as a CPU copy by parameter name: a Megatron
        checkpoint (a root or one checkpoint folder; ours, the HF converter's, or Megatron-LM's torch_dist) or
        an HF folder of the same architecture. Loaded through the policy's own model (so TP/PP sharding
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
            # with LoRA: the checkpoint's base model, without adapters (a LoRA run's own checkpoint holds them)
            return _without_adapters({n: p.detach().to("cpu", copy=True) for n, p in params.items()})
        except (ValueError, FileNotFoundError, AssertionError, KeyError) as e:
            raise ValueError(f"{flag} {path}: {e}") from e
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
        with self._swapped(self._ref):
            yield

    @contextlib.contextmanager
    def _swapped(self, weights: dict[str, torch.Tensor]) -> Iterator[None]:
        """`weights` (a host copy by parameter name: the reference's, the teacher's) in the model for the
        block, then the current ones back, exactly."""
        params = {n: p for n, p in self.gpt.named_parameters() if n in weights}
        backup = {n: p.detach().to("cpu", copy=True) for n, p in params.items()}
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(weights[n])
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
                                           keep_logp=keep, mtp=self.mtp_train), mbs, forward_only=False)
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
        if self.mtp_train:
            out.update(self._mtp_losses(len(mbs)))
        return out

    def _mtp_losses(self, num_microbatches: int) -> dict[str, float]:
        """The multi-token-prediction losses of the mini-batch just run, as slime logs them: each MTP layer's loss
        (megatron's tracker: per micro-batch the mean over its counted tokens) averaged over the micro-batches and the
        DP x CP ranks, and their sum; the tracker is cleared. Identical on every rank (every rank calls it)."""
        values = torch.zeros(self.arch.mtp_built, dtype=torch.float64, device=self.info.device)
        tracker = MTPLossLoggingHelper.tracker
        if "loss_values" in tracker:  # the last pipeline stage, which holds the MTP layers
            values.copy_(tracker["loss_values"].double() / num_microbatches)
            MTPLossLoggingHelper.clean_metrics_in_tracker()
        broadcast_from_last_stage(values)
        group = mpu.get_data_parallel_group(with_context_parallel=True)
        dist.all_reduce(values, group=group)
        values /= dist.get_world_size(group)
        out = {f"mtp/mtp_{k + 1}_loss": float(v) for k, v in enumerate(values.tolist())}
        return {"mtp/mtp_loss": float(values.sum()), **out}

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
        recomputed = None
        if self.algo.use_rollout_logprobs:  # the engine's log-probs stand for the old policy (slime's flag)
            recomputed, old = old, [[float(x) for x in row] for row in batch["rollout_logprobs"]]
        ref = self._reference_logprobs(batch)
        adv = returns = None
        if self.algo.token_level_advantages:
            adv, returns = token_advantages(self.algo, batch, old, ref, self.info.device, dp_group(), values)
        teacher = None
        if self.algo.use_opd:  # on-policy distillation: the teacher's log-probs, then the reverse KL in the advantages
            if self.algo.opd_type == "sglang":  # from the teacher's own server, with the rollout (rewards/teacher.py)
                teacher = [[float(x) for x in row] for row in batch["teacher_logprobs"]]
            else:
                with self._swapped(self._teacher):
                    teacher = self._forward_logprobs(batch, with_entropy=False)[0]
            adv = opd_advantages(self.algo, batch, old, teacher, adv)
        inputs = StepInputs(old=old, entropy=entropy, ref=ref, advantages=adv, sums={}, returns=returns,
                            routing=routing, recomputed=recomputed)
        inputs.sums = step_sums(batch, inputs, self.info.device, dp_group())
        if teacher is not None:
            inputs.sums |= opd_sums(batch, old, teacher, self.info.device, dp_group())
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
                | moe_metrics(stats) | mtp_metrics(stats) | self._routing_agreement())

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
        if self.algo.separate_old_logprobs or self.algo.token_level_advantages or self.algo.use_rollout_logprobs \
                or self.algo.use_opd:  # OPD's advantages need the old log-probs before the update
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
                              have_ref=ref is not None) | moe_metrics([stats]) | mtp_metrics([stats])
                | self._routing_agreement())

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

    def hf_weight_metadata(self, skip_frozen: bool = False) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(hf_name, dtype, HF shape) of what `iter_hf_sources(skip_frozen)` yields, in order; no communication."""
        return hf_io.hf_weight_metadata(self.gpt, self.arch, skip_frozen=skip_frozen)

    @on_rank_thread
    def save_hf(self, path: str) -> str:
        """The model as an HF folder at `path` (atomic; config, tokenizer, generation config copied
        from --hf-checkpoint; vocab padding removed), through the weight-sync gather path; every
        rank calls it, global rank 0 writes."""
        out = hf_export.save_hf_folder(self.gpt, self.arch, path, self.model_cfg.hf_checkpoint)
        if self.lora:  # the merged model above, and the adapters PEFT loads onto the base (verl's layout)
            hf_export.save_peft_adapter(self.gpt, self.lora_spec, out / LORA_ADAPTER_DIR, self.model_cfg.hf_checkpoint)
        return str(out)

    @on_rank_thread
    def peft_adapter_state(self) -> tuple[dict[str, torch.Tensor], dict] | None:
        """--lora-sync adapter: the adapters whole under PEFT's names and their adapter_config, on global rank 0
        (None elsewhere); every rank calls it (TP gathers, an all-gather over the pipeline stages)."""
        tensors = hf_export.gather_peft_state(self.gpt)
        if tensors is None:
            return None
        return tensors, lora.sglang_adapter_config(self.lora_spec, lora.peft_modules(tensors),
                                                   str(self.model_cfg.hf_checkpoint))

    def set_adapters_enabled(self, on: bool) -> None:
        """Off: the model is the base (what a base weight sync sends); on: base + adapters."""
        lora.set_enabled(self.gpt, on)

    @on_rank_thread
    def save_peft(self, path: str) -> str:
        """The LoRA adapters as a PEFT folder at `path` (hf_export.save_peft_adapter); every rank calls it."""
        return str(hf_export.save_peft_adapter(self.gpt, self.lora_spec, path, self.model_cfg.hf_checkpoint))


def _without_adapters(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A host copy with every LoRA B zeroed: the adapters add exactly nothing (the base model)."""
    return {n: torch.zeros_like(t) if lora.is_adapter_name(n) and ".lora.B." in n else t for n, t in weights.items()}
