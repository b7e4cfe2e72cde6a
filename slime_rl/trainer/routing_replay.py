"""Routing replay: slime's R3 (`--use-rollout-routing-replay`), R2 (`--use-routing-replay`) and
`train/routing_agreement`.

The engines return, per sample, the top-k experts each MoE layer chose for every position fed to
the model (SGLang's `routed_experts`: rows for positions [0, len(tokens) - 1), layer, k; the batch
key `rollout_routed_experts`, one [rows, layers * k] int32 array per sample). Here they follow the
tokens into each micro-batch in the order megatron's router sees them ([s, b] flattened, the
packed row when THD, this TP rank's chunk of the sequence under sequence parallelism; each pipeline
stage picks its own layers by the router's global `layer_number`).

Megatron-core 0.19's own hook does the replay: `TopKRouter.router_replay` (a `RouterReplay`, made
when `moe_enable_routing_replay`) is asked for the top-k inside `topk_routing_with_score_function`;
in REPLAY_FORWARD it returns the recorded indices and the router's own scores gathered at them, so
the gates are still softmax(own logits at the recorded experts) and gradients reach the router as
in slime. Each router gets an `EngineRouting` of its own (not megatron's class-wide list, which the
ranks of one process would share); it also counts, on the positions the engine routed, how often
the router's own top-k set equals the engine's (whether or not it replays).

R2 (`--use-routing-replay` without R3): the routers' own top-k in the forward that computes the old
log-probs (the rollout's weights) is recorded (`EngineRouting.recording`), turned back into per-sample
rows of the same shape as the engines' (`sample_routing`, the inverse of `micro_batch_routing`), and
carried under BATCH_KEY into the training micro-batches of the same step, where it is replayed like
R3's: the later mini-batches route as the old-log-prob pass did, whatever the earlier optimizer steps
did to the routers. With R3, the old-log-prob pass already replays the engines' routing and so does
training: R3 implies R2 (as in slime), nothing is recorded.

Positions without a recorded row (a sample's last token, micro-batch padding, environment tokens
after the last model turn) take experts 0..k-1: no loss reads their outputs (a causal model's
trained log-probs depend only on earlier positions; padding is never read).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from slime_rl.trainer.mcore import RouterReplay, RouterReplayAction, TopKRouter

BATCH_KEY = "rollout_routed_experts"


class EngineRouting(RouterReplay):
    """One router's replay target for the next forward, and its agreement counts."""

    def __init__(self, layer: int, replay: bool) -> None:
        super().__init__()
        # megatron's class-wide registry is for its global set_replay_data; not used here
        RouterReplay.global_router_replay_instances.remove(self)
        self.layer, self.replay = layer, replay
        self.mask: Tensor | None = None
        self.count = False  # count agreement in the next forwards (the rollout weights' forward)
        self.agree, self.total = 0, 0
        # R2: a list while the old-log-prob forward runs; each call appends the top-k it used
        # ([tokens, k] long, CPU), one entry per micro-batch
        self.recording: list[Tensor] | None = None

    def set_target(self, topk: Tensor | None, mask: Tensor | None) -> None:
        self.clear_indices()
        self.mask = mask
        if topk is None:
            self.clear_router_replay_action()
        else:
            self.target_topk_idx = topk
            self.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        out = self._topk(scores, topk, num_groups, group_topk, default_compute_topk)
        if self.recording is not None:
            self.recording.append(out[1].detach().to("cpu", torch.long))
        return out

    def _topk(self, scores, topk, num_groups, group_topk, default_compute_topk):
        if self.target_topk_idx is None:
            return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = self.target_topk_idx.to(scores.device)
        if target.shape != (scores.shape[0], topk):
            raise ValueError(f"routing replay, layer {self.layer}: {tuple(target.shape)} recorded experts for "
                             f"{scores.shape[0]} tokens x top-{topk}")
        if self.count and self.mask is not None:
            with torch.no_grad():
                _, own = default_compute_topk(scores.detach(), topk, num_groups=num_groups, group_topk=group_topk)
                same = (own.sort(dim=-1).values == target.sort(dim=-1).values).all(dim=-1)
                m = self.mask.to(scores.device)
                self.agree += int((same & m).sum())
                self.total += int(m.sum())
        if not self.replay:
            return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        return scores.gather(1, target), target


def attach(gpt: torch.nn.Module, replay: bool) -> list[EngineRouting]:
    """An EngineRouting on every TopKRouter of this rank's decoder (a multi-token-prediction layer's router is not
    the engine's decoder's: the engines return no routing for it)."""
    out = []
    mtp = set(gpt.mtp.modules()) if hasattr(gpt, "mtp") else set()
    for mod in gpt.modules():
        if isinstance(mod, TopKRouter) and mod not in mtp:
            if getattr(mod.config, "moe_router_fusion", False):
                raise ValueError("routing replay: --moe-router-fusion bypasses megatron's replay hook")
            if mod.layer_number is None:
                raise ValueError("routing replay: a router without its layer number")
            mod.router_replay = EngineRouting(int(mod.layer_number) - 1, replay)
            out.append(mod.router_replay)
    return out


def sample_rows(value, n_tokens: int, num_layers: int, topk: int, sample: int) -> np.ndarray:
    """One sample's engine routing as [rows, num_layers, topk] int64 (rows <= n_tokens - 1)."""
    arr = np.asarray(value, dtype=np.int64)
    if arr.size % (num_layers * topk):
        raise ValueError(f"trainer batch sample {sample}: {BATCH_KEY} has {arr.size} ids, not a multiple of "
                         f"{num_layers} layers x top-{topk}")
    arr = arr.reshape(-1, num_layers, topk)
    if arr.shape[0] > n_tokens - 1:
        raise ValueError(f"trainer batch sample {sample}: {BATCH_KEY} has {arr.shape[0]} rows for {n_tokens} tokens "
                         f"(at most {n_tokens - 1}: the last token is never fed to the engine's model)")
    return arr


def micro_batch_routing(batch: dict, sample_ids: Sequence[int], num_layers: int, topk: int, num_experts: int,
                        seq_len: int, packed_starts: Sequence[int] | None, sp_size: int = 1,
                        sp_rank: int = 0) -> tuple[Tensor, Tensor]:
    """([tokens, num_layers, topk] long, [tokens] bool) in the router's token order for one
    micro-batch: `seq_len` positions per row; `packed_starts`: each sample's offset in the one packed
    row (THD), None for right-padded rows (one per sample). The bool marks engine-routed positions."""
    rows = 1 if packed_starts is not None else len(sample_ids)
    fill = torch.arange(topk, dtype=torch.long) % num_experts
    ids = fill.expand(rows, seq_len, num_layers, topk).clone()
    mask = torch.zeros(rows, seq_len, dtype=torch.bool)
    for k, i in enumerate(sample_ids):
        rec = torch.from_numpy(sample_rows(batch[BATCH_KEY][i], len(batch["tokens"][i]), num_layers, topk, i))
        if rec.numel() and (int(rec.min()) < 0 or int(rec.max()) >= num_experts):
            raise ValueError(f"trainer batch sample {i}: {BATCH_KEY} holds expert ids outside [0, {num_experts})")
        r, off = (0, packed_starts[k]) if packed_starts is not None else (k, 0)
        ids[r, off:off + rec.shape[0]] = rec
        mask[r, off:off + rec.shape[0]] = True
    if sp_size > 1:  # sequence parallel: this TP rank's contiguous chunk of the sequence
        if seq_len % sp_size:
            raise ValueError(f"routing replay: {seq_len} positions do not split over {sp_size} SP ranks")
        chunk = seq_len // sp_size
        ids, mask = ids[:, sp_rank * chunk:(sp_rank + 1) * chunk], mask[:, sp_rank * chunk:(sp_rank + 1) * chunk]
    # the router flattens hidden states [s, b, h]: sequence-major
    return ids.transpose(0, 1).reshape(-1, num_layers, topk), mask.transpose(0, 1).reshape(-1)


def sample_routing(recorded: dict[int, Tensor], sample_lengths: Sequence[int], num_layers: int, topk: int,
                   num_experts: int, seq_len: int, packed_starts: Sequence[int] | None) -> list[np.ndarray]:
    """The inverse of `micro_batch_routing` (without sequence parallelism): one micro-batch's
    recorded top-k, {layer: [tokens, topk] in the router's order} (the layers of this pipeline stage),
    as per-sample int32 [len - 1, num_layers * topk] rows (BATCH_KEY's form); `sample_lengths`: the
    micro-batch's samples' token counts in order. Layers of other stages get 0..k-1 (never read here)."""
    rows = 1 if packed_starts is not None else len(sample_lengths)
    fill = torch.arange(topk, dtype=torch.long) % num_experts
    ids = fill.expand(seq_len * rows, num_layers, topk).clone()
    for layer, rec in recorded.items():
        if rec.shape != (seq_len * rows, topk):
            raise ValueError(f"routing replay, layer {layer}: recorded {tuple(rec.shape)} for {seq_len * rows} "
                             f"tokens x top-{topk}")
        ids[:, layer] = rec
    ids = ids.reshape(seq_len, rows, num_layers, topk).transpose(0, 1)  # [rows, s, L, k]
    out = []
    for k, n in enumerate(sample_lengths):
        r, off = (0, packed_starts[k]) if packed_starts is not None else (k, 0)
        out.append(ids[r, off:off + n - 1].reshape(n - 1, num_layers * topk).numpy().astype(np.int32))
    return out


def set_targets(routers: Sequence[EngineRouting], routing: tuple[Tensor, Tensor] | None) -> None:
    """Before a forward: each router's layer of the micro-batch's routing (None: route freely)."""
    for r in routers:
        if routing is None:
            r.set_target(None, None)
        else:
            ids, mask = routing
            r.set_target(ids[:, r.layer].contiguous(), mask)
