"""From the trainer's batch (a dict of per-sample lists) to padded micro-batch tensors.

Layout: a micro-batch of b samples is right-padded to s = its longest prompt+response. Attention
is causal, so padding after a sample's last token cannot change the logits of its real tokens and
needs no mask. The response token j of sample i (0 <= j < R_i, L_i = its total length) is
tokens[i, L_i - R_i + j], predicted by the logits at position L_i - R_i + j - 1. Response-side
tensors are [b, T] with T = max R_i, right-padded; `valid` is 1 on real response tokens and
`loss_mask` is the sample's loss mask (a subset of valid).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

TRAIN_KEYS = ("tokens", "response_lengths", "loss_masks", "advantages", "rollout_logprobs", "rewards")


@dataclass
class MicroBatch:
    sample_ids: list[int]  # positions in the rank's batch
    tokens: Tensor  # [b, s] long
    position_ids: Tensor  # [b, s] long
    logit_index: Tensor  # [b, T] long: position whose logits predict response token j
    targets: Tensor  # [b, T] long: the response tokens (0 on padding)
    valid: Tensor  # [b, T] float: 1 on real response tokens
    loss_mask: Tensor  # [b, T] float: 1 on trained tokens
    per_token: dict[str, Tensor] = field(default_factory=dict)  # [b, T] float: advantages, old_logp, ...
    # megatron PackedSeqParams for THD micro-batches (packing.py): tokens are then [1, t] and
    # logit_index points into that one packed row; None for the right-padded layout
    packed_seq_params: Any = None
    # context parallel (context_parallel.py): 1 where this CP rank holds the position predicting
    # response token j (logit_index is then local); None without CP
    cp_own: Tensor | None = None
    # vision-language samples (vision.py): image inputs; position_ids are then [3, b, s] (mRoPE)
    vision: Any = None
    # [b, s] (packed: [1, t]) bool, True on positions that hold no sample's token (right padding,
    # the pad of a packed row): megatron's MoE routers leave them out of the load-balancing loss
    padding: Tensor | None = None
    # MoE with the engines' routing (routing_replay.py): ([tokens, layers, k] expert ids, [tokens] bool
    # engine-routed) in the order this rank's routers see the tokens; None without
    routing: tuple[Tensor, Tensor] | None = None
    # multi-token prediction (micro.MicroBatching.mtp): [b, s] (packed: [1, t]) float, 1 at the positions of the
    # trained response tokens (loss_mask), the tokens whose MTP prediction counts (steps.model_forward); under
    # context parallelism this rank's positions
    mtp_mask: Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Sequence positions the model runs (the schedule's seq_length)."""
        return int(self.tokens.shape[1])

    @property
    def response_lengths(self) -> list[int]:
        return [int(n) for n in self.valid.sum(dim=1).tolist()]


def validate_batch(batch: dict, keys: Sequence[str] = TRAIN_KEYS) -> int:
    """Check fields and per-sample lengths; returns the number of samples. Errors name the field."""
    missing = [k for k in keys if k not in batch]
    if missing:
        raise KeyError(f"trainer batch lacks fields {missing} (has {sorted(batch)})")
    n = len(batch["tokens"])
    for k in keys:
        if len(batch[k]) != n:
            raise ValueError(f"trainer batch field {k!r} has {len(batch[k])} entries, tokens has {n}")
    for i in range(n):
        total, resp = len(batch["tokens"][i]), int(batch["response_lengths"][i])
        if not 0 < resp < total:
            raise ValueError(f"trainer batch sample {i}: response_lengths={resp} must be in "
                             f"[1, len(tokens)={total}) (at least one prompt token)")
        for k in ("loss_masks", "rollout_logprobs"):
            if k in keys and len(batch[k][i]) != resp:
                raise ValueError(f"trainer batch sample {i}: len({k})={len(batch[k][i])} != "
                                 f"response_lengths={resp}")
    return n


def _pad(rows: list[Sequence[float]], width: int, dtype: torch.dtype) -> Tensor:
    out = torch.zeros(len(rows), width, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(list(r), dtype=dtype)
    return out


def build_micro_batch(batch: dict, sample_ids: list[int], device: torch.device,
                      per_token: dict[str, list[Sequence[float]]] | None = None) -> MicroBatch:
    """Tensors for the samples `sample_ids` of `batch`. `per_token` holds extra per-sample
    response-length lists (e.g. old log-probs), indexed like the batch."""
    toks = [batch["tokens"][i] for i in sample_ids]
    resp = [int(batch["response_lengths"][i]) for i in sample_ids]
    s, t = max(len(x) for x in toks), max(resp)
    tokens = _pad(toks, s, torch.long)
    starts = torch.tensor([len(x) - r for x, r in zip(toks, resp, strict=True)])  # first response pos
    j = torch.arange(t)
    valid = (j.unsqueeze(0) < torch.tensor(resp).unsqueeze(1)).float()
    token_pos = (starts.unsqueeze(1) + j).clamp(max=s - 1)
    targets = torch.gather(tokens, 1, token_pos) * valid.long()
    extra: dict[str, Tensor] = {}
    if "loss_masks" in batch:
        loss_mask = _pad([batch["loss_masks"][i] for i in sample_ids], t, torch.float32) * valid
    else:
        loss_mask = valid.clone()
    if "advantages" in batch:
        adv = torch.tensor([float(batch["advantages"][i]) for i in sample_ids])
        extra["advantages"] = adv.unsqueeze(1) * valid  # one scalar per sample, on all its tokens
    if "rollout_logprobs" in batch:
        extra["rollout_logp"] = _pad([batch["rollout_logprobs"][i] for i in sample_ids], t, torch.float32)
    for name, rows in (per_token or {}).items():
        extra[name] = _pad([rows[i] for i in sample_ids], t, torch.float32)
    return MicroBatch(
        sample_ids=list(sample_ids),
        tokens=tokens.to(device),
        position_ids=torch.arange(s).unsqueeze(0).expand(len(toks), s).contiguous().to(device),
        logit_index=(token_pos - 1).clamp(min=0).to(device),
        targets=targets.to(device),
        valid=valid.to(device),
        loss_mask=loss_mask.to(device),
        per_token={k: v.to(device) for k, v in extra.items()},
        padding=(torch.arange(s).unsqueeze(0) >= torch.tensor([len(x) for x in toks]).unsqueeze(1)).to(device),
    )


def chunks(ids: list[int], size: int) -> list[list[int]]:
    """Consecutive groups of `size` (the last may be shorter)."""
    if size < 1:
        raise ValueError(f"chunk size must be >= 1, got {size}")
    return [ids[k : k + size] for k in range(0, len(ids), size)]


def unpad(x: Tensor, mb: MicroBatch) -> list[list[float]]:
    """[b, T] -> per-sample lists of response length."""
    rows = x.detach().float().cpu().tolist()
    return [row[:n] for row, n in zip(rows, mb.response_lengths, strict=True)]
