"""mrope_positions: a hand-worked case, and agreement with transformers' Qwen2.5-VL get_rope_index."""

from __future__ import annotations

import pytest
import torch

from slime_rl.data.mrope import mrope_positions

PAD = 9


def test_hand_worked_case():
    # text a, vision_start, a 1x4x4 patch grid (merge 2 -> 2x2 = 4 pads), vision_end, text b
    ids = [1, 2, PAD, PAD, PAD, PAD, 3, 4]
    pos, delta = mrope_positions(ids, PAD, [[1, 4, 4]], 2)
    assert pos.tolist() == [[0, 1, 2, 2, 2, 2, 4, 5],
                            [0, 1, 2, 2, 3, 3, 4, 5],
                            [0, 1, 2, 3, 2, 3, 4, 5]]
    assert delta == 5 + 1 - 8
    # a pad sampled in the response is text: one more than the last position
    pos2, delta2 = mrope_positions(ids + [PAD, 7], PAD, [[1, 4, 4]], 2, n_prompt=len(ids))
    assert pos2[:, 8:].tolist() == [[6, 7]] * 3 and delta2 == delta


def test_errors_name_the_mismatch():
    with pytest.raises(ValueError, match="more image pads"):
        mrope_positions([1, PAD, PAD], PAD, [], 2)
    with pytest.raises(ValueError, match="needs 4 pad tokens"):
        mrope_positions([1, PAD, PAD, 3], PAD, [[1, 4, 4]], 2)
    with pytest.raises(ValueError, match="2 image grid"):
        mrope_positions([1, PAD, PAD, PAD, PAD], PAD, [[1, 4, 4], [1, 2, 2]], 2)


def test_matches_hf_get_rope_index(tiny_qwen2_5_vl):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen2_5_vl)
    cfg = model.config
    vs, ve, pad = cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id
    grids = [[1, 6, 10], [1, 8, 4]]
    ids = [5, 6, vs] + [pad] * 15 + [ve, 7, 8, vs] + [pad] * 8 + [ve, 9, 10, 11]
    response = [12, pad, 13]
    full = torch.tensor([ids + response])
    types = torch.zeros_like(full, dtype=torch.int)
    types[0, :len(ids)] = (full[0, :len(ids)] == pad).int()
    want, want_delta = model.model.get_rope_index(full, types, image_grid_thw=torch.tensor(grids))
    got, delta = mrope_positions(ids + response, pad, grids, cfg.vision_config.spatial_merge_size, n_prompt=len(ids))
    assert torch.equal(got, want[:, 0]) and delta == int(want_delta)
    text = [5, 6, 7]
    pos, d = mrope_positions(text, pad, [], 2)
    assert pos.tolist() == [[0, 1, 2]] * 3 and d == 0
