"""Independent references for the trainer tests: a fixed batch, and HF transformers in float64.

Nothing here imports slime_rl.trainer: log-probs, entropy and the policy-loss gradient are
computed from the HF model of the same folder, so a layout or scaling bug in the Megatron path
cannot also be in the expected values.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

LENGTHS = (7, 12, 5, 9)
RESPONSE_LENGTHS = (3, 6, 2, 4)
LOSS_MASKS = ([1, 1, 1], [1, 1, 0, 0, 1, 1], [1, 1], [0, 1, 1, 1])
ADVANTAGES = (1.0, -1.0, 0.5, -0.25)


def make_batch(vocab_size: int = 64, seed: int = 0) -> dict:
    """Four samples of different lengths (so micro-batches need right-padding), some masked tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
    rollout = [[-1.0 - 0.25 * j for j in range(r)] for r in RESPONSE_LENGTHS]  # arbitrary numbers
    return {
        "tokens": tokens,
        "response_lengths": list(RESPONSE_LENGTHS),
        "loss_masks": [list(m) for m in LOSS_MASKS],
        "advantages": list(ADVANTAGES),
        "rollout_logprobs": rollout,
        "rewards": [1.0, 0.0, 1.0, 0.0],
    }


def select(batch: dict, ids: list[int]) -> dict:
    return {k: [v[i] for i in ids] for k, v in batch.items()}


def hf_model(ckpt: str | Path):
    """The HF model in float64. MoE models run their experts one by one ("eager"): transformers'
    default grouped_mm kernel takes no float64."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, experts_implementation="eager").double()


def _response_logits(model, batch: dict, i: int, temperature: float,
                     inputs: Callable[[int], dict] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    toks = torch.tensor([batch["tokens"][i]])
    r = batch["response_lengths"][i]
    logits = model(toks, **(inputs(i) if inputs else {})).logits[0].double() / temperature  # [L, V]
    n = toks.shape[1]
    return logits[n - r - 1 : n - 1], toks[0, n - r :]


def hf_logprobs(model, batch: dict, temperature: float = 1.0,
                inputs: Callable[[int], dict] | None = None) -> list[torch.Tensor]:
    """`inputs(i)`: the model's further keyword inputs for sample i (a vision-language model's pixels)."""
    out = []
    with torch.no_grad():
        for i in range(len(batch["tokens"])):
            logits, targets = _response_logits(model, batch, i, temperature, inputs)
            out.append(torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0])
    return out


def hf_entropy(model, batch: dict, temperature: float = 1.0) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for i in range(len(batch["tokens"])):
            logp = torch.log_softmax(_response_logits(model, batch, i, temperature)[0], -1)
            out.append(-(logp.exp() * logp).sum(-1))
    return out


def masked_token_mean(values: list[torch.Tensor], batch: dict) -> float:
    num = sum(float((v * torch.tensor(m, dtype=torch.float64)).sum())
              for v, m in zip(values, batch["loss_masks"], strict=True))
    return num / sum(sum(m) for m in batch["loss_masks"])


def hf_policy_grad(model, batch: dict, mode: str = "token-mean", max_len: int | None = None,
                   inputs: Callable[[int], dict] | None = None,
                   drop_missing: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, grads by HF name) of the PPO loss at ratio 1 (old = current policy), aggregated by
    `mode`, written out by hand per mode (independent of slime_rl.trainer.loss_agg):
      token-mean:              L = -sum_i sum_t m_it A_i r_it / sum_i n_i
      seq-mean-token-mean:     L = -(1/B) sum_i (sum_t m_it A_i r_it) / n_i
      seq-mean-token-sum:      L = -(1/B) sum_i sum_t m_it A_i r_it
      seq-mean-token-sum-norm: L = -(1/(B * max_len)) sum_i sum_t m_it A_i r_it
    with r = exp(logp - stopgrad(logp)) = 1, n_i = sum_t m_it, B = #{i : n_i > 0}. At ratio 1
    the clip is inactive, so dL/dθ = the same sums with r replaced by dlogp."""
    model.zero_grad()
    n = [sum(m) for m in batch["loss_masks"]]
    n_tokens, n_samples = sum(n), sum(1 for x in n if x > 0)
    total = torch.zeros((), dtype=torch.float64)
    for i in range(len(batch["tokens"])):
        if n[i] == 0:
            continue
        logits, targets = _response_logits(model, batch, i, 1.0, inputs)
        logp = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
        mask = torch.tensor(batch["loss_masks"][i], dtype=torch.float64)
        ratio = torch.exp(logp - logp.detach())
        term = -(mask * batch["advantages"][i] * ratio).sum()
        if mode == "token-mean":
            total = total + term / n_tokens
        elif mode == "seq-mean-token-mean":
            total = total + term / n[i] / n_samples
        elif mode == "seq-mean-token-sum":
            total = total + term / n_samples
        elif mode == "seq-mean-token-sum-norm":
            total = total + term / (n_samples * max_len)
        else:
            raise ValueError(mode)
    total.backward()
    # a parameter no gradient reaches: zeros (Qwen3.5's vision tower on a text-only batch), or with drop_missing
    # none at all (GLM-5's indexer: it only chooses keys, under torch.no_grad, and the trainer reports none for it)
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
             for n, p in model.named_parameters() if p.grad is not None or not drop_missing}
    if getattr(model.config, "tie_word_embeddings", False):
        grads.pop("lm_head.weight", None)  # same tensor as the embedding in HF's state dict
    return float(total.detach()), grads


def make_tiny_qwen3(out: Path, seed: int = 2) -> Path:
    """Tiny Qwen3 (q/k RMSNorm per head, no qkv bias, head_dim 32 != hidden / heads, untied),
    norms drawn at random like tools/make_tiny_model.py does, so a q/k-norm mix-up shows."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                      max_position_embeddings=512, tie_word_embeddings=False, dtype="float32",
                      rope_parameters={"rope_theta": 1e6, "rope_type": "default"})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out, safe_serialization=True)
    return Path(out)
