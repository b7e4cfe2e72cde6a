"""Reward shaping applied per sample before the advantage estimator. Pure tensor math."""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(response_lengths: Tensor | list[int], max_len: int, buffer_len: int,
                     penalty_factor: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13), per sample.

    response_lengths: [B] response token counts. With L = length, L_max = max_len, L_c = buffer_len:
      0                                  if L <= L_max - L_c
      ((L_max - L_c) - L) / L_c * factor if L_max - L_c < L <= L_max   (linear, 0 -> -factor)
      -factor                            if L > L_max
    Returns [B] float32 (float64 if the lengths are), added to the task reward of each sample.
    """
    if buffer_len <= 0 or buffer_len > max_len:
        raise ValueError(f"overlong buffer length must be in (0, max_len={max_len}], got {buffer_len}")
    lengths = torch.as_tensor(response_lengths)
    dtype = torch.float64 if lengths.dtype == torch.float64 else torch.float32
    lengths = lengths.to(dtype)
    expected = max_len - buffer_len
    penalty = (expected - lengths) / buffer_len * penalty_factor
    return torch.clamp(penalty, min=-penalty_factor, max=0.0)
