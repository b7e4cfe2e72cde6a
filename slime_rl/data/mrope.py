"""Qwen2.5-VL's 3-D rotary positions (mRoPE) for one token sequence, without a model instance.

The trainer needs them per sample to pack sequences (positions [3, T_total] go next to the packed
tokens), the engine gets them from the HF model. The rule, as Qwen2-VL/2.5-VL define it:
- a text token has the same position on the t, h and w axes: one more than the largest position
  before it;
- an image of patch grid (t, h, w) becomes t * (h/m) * (w/m) tokens (m = spatial merge size) laid out
  row-major over (t, h/m, w/m); starting from s = the next text position, a token at (i, j, k) gets
  (s + i, s + j, s + k) (a still image has t = 1), and the next text position is s + max(h, w)/m.
Only image pads inside the prompt are images: the same id sampled in a response is text, as in the
engine. `delta` = max position + 1 - length, the shift of every later text position (HF's
rope_deltas).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def mrope_positions(token_ids: Sequence[int], image_token_id: int, grids: Sequence[Sequence[int]],
                    merge_size: int, n_prompt: int | None = None) -> tuple[torch.Tensor, int]:
    """(positions [3, len(token_ids)] long, delta) for prompt (+ response) tokens with images `grids`."""
    n_prompt = len(token_ids) if n_prompt is None else n_prompt
    pos = torch.empty(3, len(token_ids), dtype=torch.long)
    cur, i, k = 0, 0, 0
    while i < len(token_ids):
        if token_ids[i] != image_token_id or i >= n_prompt:
            pos[:, i] = cur
            cur, i = cur + 1, i + 1
            continue
        if k >= len(grids):
            raise ValueError(f"token {i}: more image pads in the prompt than the {len(grids)} image grid(s)")
        t, h, w = (int(x) for x in grids[k])
        gh, gw = h // merge_size, w // merge_size
        n = t * gh * gw
        if token_ids[i:i + n].count(image_token_id) != n or i + n > n_prompt:
            raise ValueError(f"image {k} (grid {[t, h, w]}) needs {n} pad tokens from position {i}")
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        pos[:, i:i + n] = torch.stack([tt, hh, ww]).reshape(3, n) + cur
        cur += max(gh, gw)
        i, k = i + n, k + 1
    if k != len(grids):
        raise ValueError(f"{len(grids)} image grid(s) but {k} image(s) in the prompt")
    delta = int(pos.max()) + 1 - len(token_ids) if len(token_ids) else 0
    return pos, delta
