"""Advantage estimators over groups of samples of one prompt. Pure tensor math."""

from __future__ import annotations

import torch
from torch import Tensor


def grpo_advantages(rewards: Tensor, eps: float = 1e-6, normalize_std: bool = True) -> Tensor:
    """GRPO: each sample's reward minus its group's mean, divided by the group's std.

    rewards: [G, n] (G groups of n samples of the same prompt). Returns [G, n], one scalar per
    sample, later broadcast to its response tokens. std is the unbiased (n - 1) one, as in the
    GRPO paper's implementation; a group of equal rewards (or n = 1) gets advantage 0.
    normalize_std=False gives Dr.GRPO (mean-centred only).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, n_samples], got shape {tuple(rewards.shape)}")
    rewards = rewards.to(torch.float64 if rewards.dtype == torch.float64 else torch.float32)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not normalize_std or rewards.shape[1] == 1:
        return centred
    std = rewards.std(dim=1, keepdim=True, unbiased=True)
    return centred / (std + eps)
