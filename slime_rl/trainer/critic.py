"""PPO's critic: a Megatron value model, the policy's backbone with a scalar value head.

The model is the policy's GPTModel built from the same HF config (model.py) and loaded from the
same HF weights (or from a critic checkpoint, `--critic-load`); on the last pipeline stage the LM
output layer is replaced by `ValueHead`, a [hidden -> 1] linear layer, so the model's "logits" are
values [b, s, 1]. Everything else (DDP, distributed optimizer, LR schedule, micro-batching,
schedules, checkpoints) is the policy's (rank.MegatronRank).

Tensor parallelism: the hidden states after the final norm are replicated on every TP rank (the
last RowParallelLinear all-reduces its output), so each rank runs the whole head on the whole
sequence and gets the same values; the head's weights are replicated (not TP-sharded) and every
rank computes the same full gradient for them and for the hidden states, so no extra reduction is
needed. Under sequence parallelism each rank holds only s / tp positions: the head all-gathers the
sequence first, and the backward keeps each rank's own slice of the (identical, full) gradient.

Alignment: the value of response token j is V(s_j), the state before token j is emitted, read at
the position whose logits predict token j (MicroBatch.logit_index, the log-prob path's index): the
critic's values, the policy's log-probs and the advantages all line up token for token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from slime_rl.algo import masked_sum, value_loss_terms
from slime_rl.trainer.batching import MicroBatch, validate_batch
from slime_rl.trainer.loss_agg import GlobalCounts, local_counts, token_weights
from slime_rl.trainer.mcore import gather_from_sequence_parallel_region, on_rank_thread
from slime_rl.trainer.micro import collect_per_sample
from slime_rl.trainer.parallel import broadcast_from_last_stage, dp_group
from slime_rl.trainer.rank import MegatronRank
from slime_rl.trainer.steps import LossScale, model_forward, response_logits

INIT_STD = 0.02
# per-micro-batch sums of the value loss (summed over micro-batches and DP ranks)
CRITIC_STAT_KEYS = ("vf", "clipped", "value", "tokens", "loss")


class ValueHead(torch.nn.Module):
    """hidden [s, b, h] (after the final norm; [s / tp, b, h] under sequence parallel) ->
    (values [s, b, 1], None), called like megatron's output layer (see the module docstring)."""

    def __init__(self, hidden_size: int, sequence_parallel: bool, seed: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        # named weight / bias like megatron's output layer, whose checkpoint keys GPTModel expects
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.empty(1, dtype=dtype, device=device))
        # the same seed on every rank: the replicated head starts equal everywhere. std 0.02 (HF's
        # initializer_range, megatron's init_method_std): the first values are small, so the first
        # advantages are close to the returns themselves instead of noise of the reward's size
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(1, hidden_size, generator=g) * INIT_STD)
            self.bias.zero_()

    def forward(self, hidden: Tensor, weight: Tensor | None = None, runtime_gather_output: bool | None = None
                ) -> tuple[Tensor, None]:
        del weight, runtime_gather_output  # the LM layer's arguments; a value head has no tied weight
        if self.sequence_parallel:
            # backward: each rank keeps its slice of the full gradient (every rank computed all of it)
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None


def response_values(output: Tensor, mb: MicroBatch) -> Tensor:
    """Critic output [b, s, 1] (packed: [1, t, 1]) -> [b, T] values of the response tokens."""
    return response_logits(output, mb)[..., 0]


def values_step() -> Callable:
    """forward_step_func collecting {"values": [b, T], "mb"} (forward only)."""

    def step(data_iterator: Iterator[MicroBatch], model: torch.nn.Module):
        mb = next(data_iterator)
        output = model_forward(model, mb)

        def loss_func(output_tensor: Tensor):
            return torch.zeros((), device=output_tensor.device), {"mb": mb,
                                                                 "values": response_values(output_tensor, mb)}

        return output, loss_func

    return step


def value_loss_step(value_clip: float, scale: LossScale) -> Callable:
    """forward_step_func of one critic training micro-batch: the clipped value loss per token
    (algo.value_loss_terms against per_token old_values / returns), weighted by loss_weight (the
    loss_agg_mode's global denominators, as the policy's), scaled like steps.policy_loss_step."""

    def step(data_iterator: Iterator[MicroBatch], model: torch.nn.Module):
        mb = next(data_iterator)
        output = model_forward(model, mb)

        def loss_func(output_tensor: Tensor):
            values = response_values(output_tensor, mb)
            per_token, clipped = value_loss_terms(values, mb.per_token["old_values"], mb.per_token["returns"],
                                                  value_clip)
            share = masked_sum(per_token, mb.per_token["loss_weight"])
            mask = mb.loss_mask
            sums = torch.stack([masked_sum(per_token, mask), masked_sum(clipped, mask),
                                masked_sum(values, mask), mask.sum(), share]).detach().float()
            return share * scale.factor, {"sums": sums}

        return output, loss_func

    return step


class CriticWorker(MegatronRank):
    """One rank of the critic group; built like the policy's TrainerWorker (same arguments: pass
    the critic's ParallelConfig and OptimizerConfig, CriticConfig.parallel / .optimizer)."""

    takes_lora = False  # the value model trains whole (its head is new); --lora-rank adapts the policy
    builds_mtp = False  # the MTP layers are the policy's (the value model predicts no tokens)

    def _prepare_model(self) -> None:
        gpt = self.gpt
        # the head is ours alone: megatron must not tie it to the embedding, nor (with PP) all-reduce
        # the first stage's embedding grads with a last-stage copy that no longer exists: every stage
        # must agree, or finalize_model_grads waits forever on the embedding group
        gpt.share_embeddings_and_output_weights = False
        if not gpt.post_process:
            return  # only the last pipeline stage has an output layer
        param = next(gpt.decoder.parameters())
        gpt.output_layer = ValueHead(gpt.config.hidden_size, gpt.config.sequence_parallel, self.model_cfg.seed,
                                     param.dtype, param.device)

    @torch.no_grad()
    @on_rank_thread
    def compute_values(self, batch: dict) -> list[list[float]]:
        """Per-sample values of the response tokens (same length as each response); forward only.
        Every rank returns the same lists for its DP shard."""
        n = validate_batch(batch, ("tokens", "response_lengths"))
        if n == 0:
            return []
        mbs = self.micro.micro_batches(batch, self.micro.groups(batch, list(range(n))))
        store = self._run(values_step(), mbs, forward_only=True)
        return collect_per_sample(store, "values", n, [int(r) for r in batch["response_lengths"]], self.info.device)

    @on_rank_thread
    def forward_backward(self, batch: dict, old_values: list, returns: list) -> dict[str, float]:
        """Zero the grads and run one mini-batch of the value loss; returns DP-summed CRITIC_STAT_KEYS."""
        tokens, samples = self._dp_sum(list(local_counts(batch["loss_masks"])))
        counts = GlobalCounts(tokens=tokens, samples=samples, max_len=self.loss_agg_max_len)
        per_token = {"old_values": old_values, "returns": returns,
                     "loss_weight": token_weights(batch["loss_masks"], self.loss_agg_mode, counts)}
        groups = self.micro.equalized_groups(batch, list(range(len(batch["tokens"]))), dp_group(),
                                             self.info.device)
        mbs = self.micro.micro_batches(batch, groups, per_token)
        scale = LossScale(num_microbatches=len(mbs), dp_size=self.dp_size)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        store = self._run(value_loss_step(self.algo.value_clip, scale), mbs, forward_only=False)
        sums = torch.zeros(len(CRITIC_STAT_KEYS), dtype=torch.float32, device=self.info.device)
        if store:  # the last pipeline stage
            sums.copy_(torch.stack([out["sums"] for out in store]).sum(dim=0))
        broadcast_from_last_stage(sums)
        return dict(zip(CRITIC_STAT_KEYS, self._dp_sum(sums.tolist()), strict=True))

    @on_rank_thread
    def train_step(self, batch: dict, old_values: list, returns: list) -> dict[str, float]:
        """One critic update on this DP rank's shard: `old_values` (compute_values at rollout time)
        and `returns` (the policy's GAE returns) per sample; one optimizer step per mini-batch of
        global_batch_size / dp samples. Metrics (identical on every rank):
          train/value_loss: per-mini-batch token mean of the clipped value loss, averaged;
          train/explained_variance: 1 - Var[R - V_old] / Var[R] over the step's trained tokens
            (population variances; NaN when the returns are all equal);
          critic/value_mean (V_old over trained tokens), critic/value_clipfrac, critic/grad_norm
          (mean over mini-batches, before clipping), critic/lr."""
        n = validate_batch(batch, ("tokens", "response_lengths", "loss_masks"))
        if n == 0:
            raise ValueError("critic train_step got an empty batch on this DP rank")
        ev = self._explained_variance_sums(batch, old_values, returns)
        stats, norms, lr = [], [], 0.0
        for ids in self._minibatches(n):
            s = self.forward_backward(self._sub(batch, ids), [old_values[i] for i in ids], [returns[i] for i in ids])
            grad_norm, lr = self.optimizer_step()
            stats.append(s)
            norms.append(grad_norm)
        tokens = max(sum(s["tokens"] for s in stats), 1.0)
        count, sum_r, sum_r2, sum_d, sum_d2, sum_v = ev
        var_r = sum_r2 / max(count, 1.0) - (sum_r / max(count, 1.0)) ** 2
        var_d = sum_d2 / max(count, 1.0) - (sum_d / max(count, 1.0)) ** 2
        return {
            "train/value_loss": sum(s["vf"] / max(s["tokens"], 1.0) for s in stats) / len(stats),
            "train/explained_variance": 1.0 - var_d / var_r if var_r > 0 else float("nan"),
            "critic/value_mean": sum_v / max(count, 1.0),
            "critic/value_clipfrac": sum(s["clipped"] for s in stats) / tokens,
            "critic/grad_norm": sum(norms) / len(norms),
            "critic/lr": lr,
        }

    def _explained_variance_sums(self, batch: dict, values: list, returns: list) -> list[float]:
        """DP-summed [count, sum R, sum R^2, sum (R - V), sum (R - V)^2, sum V] over trained tokens."""
        acc = [0.0] * 6
        for mask, v_row, r_row in zip(batch["loss_masks"], values, returns, strict=True):
            for m, v, r in zip(mask, v_row, r_row, strict=True):
                if m:
                    acc = [acc[0] + 1, acc[1] + r, acc[2] + r * r, acc[3] + (r - v), acc[4] + (r - v) ** 2, acc[5] + v]
        return self._dp_sum(acc)
