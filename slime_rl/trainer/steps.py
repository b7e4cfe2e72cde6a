"""forward_step functions for megatron's `get_forward_backward_func()` schedules.

Loss scaling, read from megatron-core 0.19.2 (pipeline_parallel/schedules.py forward_step_calc_loss
and distributed/distributed_data_parallel.py), with calculate_per_token_loss=False (default):
  * a loss_func returning (loss, extra) has its loss divided by num_microbatches (and multiplied
    by the context-parallel size cp) before backward;
  * DDP pre-scales every gradient bucket by 1/(dp_size * cp) and all-reduces with SUM over the
    DP x CP group (every CP rank computes the whole loss but back-propagates only its own
    positions, context_parallel.py: the cp factors cancel and the CP sum is the gradient once).
The mini-batch loss is L = sum_{all ranks, micro-batches, tokens} w_t * loss_t with per-token
weights w from loss_agg.py (token-mean: w = mask / N, N = global masked-token count; the seq-*
modes likewise carry their global denominators), so each micro-batch returns
sum_mb(w * loss_t) * num_microbatches * dp_size, which the two divisions above turn back into
its exact share of L. The gradient is then independent of the micro-batch size, the number of
micro-batches, token-budget packing and the DP split (tested).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from slime_rl.config.groups import AlgoConfig
from slime_rl.trainer.batching import MicroBatch
from slime_rl.trainer.context_parallel import gather_replicated
from slime_rl.trainer.logprobs import gather_response_logits, vocab_parallel_entropy, vocab_parallel_logprobs
from slime_rl.trainer.model import unwrap
from slime_rl.trainer.objective import STAT_KEYS, policy_objective
from slime_rl.trainer.routing_replay import set_targets
from slime_rl.trainer.vision import decoder_input

__all__ = ["STAT_KEYS", "LossScale", "forward_only_step", "model_forward", "policy_loss_step"]


def model_forward(model: torch.nn.Module, mb: MicroBatch, mtp: bool = False) -> Tensor:
    """Vocab-parallel logits [b, s, V_pad / tp] ([1, t, ...] when packed; float32) on the last
    stage, the hidden states on the others. attention_mask=None: attention is causal by itself
    (SDPACoreAttention); padding is on the right, and packed samples are split by cu_seqlens.
    Vision-language micro-batches carry 3-D positions, and the first stage builds its decoder input
    with the image features (vision.py). `mtp`: the multi-token-prediction layers run and add their loss
    (model.MTPGPTModel; megatron-core's process_mtp_loss): position i's MTP head predicts token i + 2, counted
    where mb.mtp_mask is 1 at i + 2 (a trained response token), the loss averaged over those tokens of the
    micro-batch, times --mtp-loss-scaling-factor / the MTP layers, its gradient injected into the backward by
    megatron's MTPLossAutoScaler (1 / num_microbatches, then DDP's 1 / dp: the mean over micro-batches and DP ranks,
    as in slime)."""
    extra = {}
    if mb.vision is not None:
        gpt = unwrap(model)
        if gpt.pre_process:
            extra["decoder_input"] = decoder_input(gpt, mb)
    gpt = unwrap(model)
    if mb.padding is not None and getattr(gpt.config, "num_moe_experts", None):
        # MoE: padding out of the routers' load-balancing loss (as a longer row must not change it);
        # under context parallelism the CP rank's part (context_parallel.split_micro_batch)
        extra["padding_mask"] = mb.padding
    routers = getattr(gpt, "engine_routing", None)
    if routers:  # MoE: the engines' routing of this micro-batch, or none (routing_replay.py)
        set_targets(routers, mb.routing)
    if hasattr(gpt, "mtp_train"):  # a model with MTP layers: they run in this forward or not
        gpt.mtp_train = mtp and mb.mtp_mask is not None
        if gpt.mtp_train:
            extra["loss_mask"] = mb.mtp_mask
    return model(input_ids=mb.tokens, position_ids=mb.position_ids, attention_mask=None,
                 packed_seq_params=mb.packed_seq_params, **extra)


def response_logits(output: Tensor, mb: MicroBatch) -> Tensor:
    """[b, s, V_local] (or packed [1, t, V_local]) -> [b, T, V_local] at mb.logit_index."""
    if mb.packed_seq_params is not None:
        return output[0][mb.logit_index]  # indices into the one packed row
    return gather_response_logits(output, mb.logit_index)


def response_logprobs(output: Tensor, mb: MicroBatch, temperature: float, vocab_size: int) -> Tensor:
    """Logits -> [b, T] log-probs of the response tokens (differentiable); under context
    parallelism each CP rank computes its own positions and gets the whole [b, T]."""
    return gather_replicated(vocab_parallel_logprobs(response_logits(output, mb), mb.targets,
                                                     temperature=temperature, vocab_size=vocab_size), mb)


def forward_only_step(temperature: float, vocab_size: int, with_entropy: bool) -> Callable:
    """forward_step_func collecting {"logp": [b, T], "entropy": [b, T] (optional), "mb"}."""

    def step(data_iterator: Iterator[MicroBatch], model: torch.nn.Module):
        mb = next(data_iterator)
        output = model_forward(model, mb)

        def loss_func(output_tensor: Tensor):
            out = {"mb": mb, "logp": response_logprobs(output_tensor, mb, temperature, vocab_size)}
            if with_entropy:
                logits = response_logits(output_tensor, mb)
                out["entropy"] = gather_replicated(vocab_parallel_entropy(
                    logits, temperature=temperature, vocab_size=vocab_size), mb)
            # the schedule scales the first element in place; it is not used in forward-only runs
            return torch.zeros((), device=output_tensor.device), out

        return output, loss_func

    return step


@dataclass(frozen=True)
class LossScale:
    """Undoes megatron's loss scaling (module docstring); the denominators are in the weights."""

    num_microbatches: int
    dp_size: int

    @property
    def factor(self) -> float:
        return float(self.num_microbatches * self.dp_size)


def policy_loss_step(algo: AlgoConfig, vocab_size: int, scale: LossScale, fused_old: bool = False,
                     keep_logp: bool = False, mtp: bool = False) -> Callable:
    """forward_step_func for one training micro-batch (see the module docstring for the scale).

    The per-token objective is objective.policy_objective (pg loss of the configured kind, TIS,
    KL loss, entropy bonus). The micro-batch returns share * scale.factor, share =
    sum(loss_weight * loss_t) (loss_weight [b, T] from loss_agg.token_weights), plus detached
    sums for the metrics (objective.STAT_KEYS; "loss" is this micro-batch's share of L).
    fused_old: the old log-probs are this forward's, detached (objective.policy_objective); the
    old policy's entropy is computed here too, without grad unless the entropy bonus needs it.
    keep_logp: the micro-batch's output also holds "sample_ids" (mb.sample_ids) and "logp", this
    forward's log-probs detached ([b, T]; the fused path's old log-probs), which the schedule keeps
    in its store on the last pipeline stage (--save-debug-train-data: micro.rows_by_sample).
    mtp: the multi-token-prediction loss is added (--enable-mtp-training: model_forward).
    """

    def step(data_iterator: Iterator[MicroBatch], model: torch.nn.Module):
        mb = next(data_iterator)
        output = model_forward(model, mb, mtp=mtp)

        def loss_func(output_tensor: Tensor):
            logits = response_logits(output_tensor, mb)  # [b, T, V_local]
            logp = gather_replicated(vocab_parallel_logprobs(logits, mb.targets, temperature=algo.temperature,
                                                             vocab_size=vocab_size), mb)  # [b, T]
            entropy = old_entropy = None
            if algo.entropy_coef > 0:
                entropy = gather_replicated(vocab_parallel_entropy(logits, temperature=algo.temperature,
                                                                   vocab_size=vocab_size), mb)
            if fused_old:
                if entropy is not None:
                    old_entropy = entropy.detach()
                else:
                    with torch.no_grad():
                        old_entropy = gather_replicated(vocab_parallel_entropy(
                            logits.detach(), temperature=algo.temperature, vocab_size=vocab_size), mb)
            share, sums = policy_objective(algo, logp, mb, entropy, old_entropy)
            if keep_logp:
                return share * scale.factor, {"sums": sums, "sample_ids": mb.sample_ids, "logp": logp.detach()}
            return share * scale.factor, {"sums": sums}

        return output, loss_func

    return step
