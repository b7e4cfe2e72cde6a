"""Independent references for rollout routing replay (trainer/routing_replay.py): an engine routing
for the fixed batch that differs from the model's own on known (token, layer) pairs, and HF's
float64 model run under a given routing.

The "engine" routing is HF's own float64 top-2 of each position, except on every third position of
layer 0 and every fourth of layer 1 (counted over the whole sample), where the second expert is
replaced by the expert with the lowest router logit: far from any tie, so the flips are certain.
Under a given routing, a Qwen-MoE layer's weights are softmax of the router's own logits over the
chosen experts (HF's top-k probabilities renormalised, norm_topk_prob; megatron's softmax of the
top-k logits): that is what replay keeps from the trainer's router.
"""

from __future__ import annotations

import numpy as np
import torch

from tests.trainer.trainer_ref import hf_model

LAYERS, TOPK = 2, 2


def _gate_logits(model, tokens: list[int]) -> list[torch.Tensor]:
    out: dict[int, torch.Tensor] = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, o, i=i: out.__setitem__(i, o[0].detach()))
             for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    return [out[i] for i in range(LAYERS)]


def engine_routing(ckpt, batch: dict) -> tuple[list[np.ndarray], float]:
    """(per sample: int32 [len(tokens) - 1, LAYERS * TOPK], the share of (position, layer) pairs
    where it equals the model's own top-2 set)."""
    model = hf_model(ckpt)
    rows, same, total = [], 0, 0
    for toks in batch["tokens"]:
        logits = _gate_logits(model, toks)
        n = len(toks) - 1
        arr = np.zeros((n, LAYERS, TOPK), dtype=np.int32)
        for layer, lg in enumerate(logits):
            own = lg[:n].topk(TOPK, dim=-1).indices
            forced = own.clone()
            every = 3 if layer == 0 else 4
            for p in range(0, n, every):
                forced[p, 1] = int(lg[p].argmin())
            arr[:, layer] = forced.numpy()
            same += int((own.sort(-1).values == forced.sort(-1).values).all(-1).sum())
            total += n
        rows.append(arr.reshape(n, LAYERS * TOPK))
    return rows, same / total


def hf_forced_logprobs(ckpt, batch: dict, routing: list[np.ndarray],
                       agreement: list | None = None) -> list[torch.Tensor]:
    """HF float64 log-probs of each sample's response tokens with every MoE layer routed as
    `routing` says (the last position, never recorded, routes on its own: no response token reads it).
    `agreement`: appended [same, total] (position, layer) pairs where the router's own top-2 of this
    run (layer 1's input follows layer 0's forced routing) is the given set."""
    model = hf_model(ckpt)
    current: dict[str, np.ndarray] = {}
    counts = [0, 0]

    def gate_forward(layer: int, gate):
        def forward(hidden):
            hidden = hidden.reshape(-1, gate.hidden_dim)
            logits = torch.nn.functional.linear(hidden, gate.weight)
            idx = logits.topk(TOPK, dim=-1).indices
            rec = torch.from_numpy(current["r"].reshape(-1, LAYERS, TOPK)[:, layer]).long()
            own = idx[: rec.shape[0]].sort(-1).values
            counts[0] += int((own == rec.sort(-1).values).all(-1).sum())
            counts[1] += rec.shape[0]
            idx[: rec.shape[0]] = rec
            w = torch.softmax(logits.gather(1, idx), dim=-1)
            return logits, w.to(logits.dtype), idx
        return forward

    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate.forward = gate_forward(i, layer.mlp.gate)
    out = []
    with torch.no_grad():
        for toks, r, rec in zip(batch["tokens"], batch["response_lengths"], routing, strict=True):
            current["r"] = rec
            logits = model(torch.tensor([toks])).logits[0].double()
            n = len(toks)
            logp = torch.log_softmax(logits[n - r - 1 : n - 1], -1)
            out.append(logp.gather(1, torch.tensor(toks[n - r :])[:, None])[:, 0])
    if agreement is not None:
        agreement.extend(counts)
    return out
