"""The engines' routing on the sample (rollout routing replay): SGLang's meta_info routed_experts
(base64 int32, one row per position before the last token of the request's prompt + output) is kept
as Sample.rollout_routed_experts [rows, layers * top_k] and becomes the batch key the trainer reads."""

from __future__ import annotations

import base64
import dataclasses

import numpy as np
import pytest

from slime_rl.data import Sample
from slime_rl.engines.payloads import generate_payload
from slime_rl.orchestration.rollout_manager import samples_to_batch
from slime_rl.rollout.partial import append_model_turn


def _answer(ids: list[int], routed: np.ndarray | None) -> dict:
    meta = {"id": "r", "finish_reason": {"type": "stop"}, "weight_version": "0",
            "output_token_logprobs": [[-0.5, t, None] for t in ids]}
    if routed is not None:
        meta["routed_experts"] = base64.b64encode(routed.astype(np.int32).tobytes()).decode()
    return {"text": "", "output_ids": ids, "meta_info": meta}


def test_routed_experts_land_on_the_sample_row_per_position():
    s = Sample(index=0, group_index=0, prompt="p", prompt_ids=[1, 2, 3])
    routed = np.arange(4 * 2 * 2).reshape(4, 2, 2)  # 3 prompt + 2 output tokens: 4 positions fed
    append_model_turn(s, _answer([7, 8], routed))
    assert s.rollout_routed_experts.shape == (4, 4)
    np.testing.assert_array_equal(s.rollout_routed_experts.reshape(4, 2, 2), routed)
    # a continuation (partial rollout) sends prompt + response so far: its rows replace the old ones
    routed2 = np.arange(6 * 4).reshape(6, 4) + 100
    append_model_turn(s, _answer([9, 10], routed2))
    np.testing.assert_array_equal(s.rollout_routed_experts, routed2)
    s.reward = 1.0
    batch = samples_to_batch([[s]])
    np.testing.assert_array_equal(batch["rollout_routed_experts"][0], routed2)


def test_a_wrong_row_count_and_a_missing_routing_are_errors():
    s = Sample(index=3, group_index=0, prompt="p", prompt_ids=[1, 2, 3])
    with pytest.raises(RuntimeError, match="routed_experts holds 5 ids"):
        append_model_turn(s, _answer([7, 8], np.arange(5)))
    a = Sample(index=1, group_index=0, prompt="p", prompt_ids=[1, 2])
    append_model_turn(a, _answer([5], np.zeros((2, 4))))
    b = Sample(index=2, group_index=0, prompt="p", prompt_ids=[1, 2])
    append_model_turn(b, _answer([5], None))
    a.reward = b.reward = 0.0
    with pytest.raises(RuntimeError, match="samples \\[2\\] came back without the engines' routed_experts"):
        samples_to_batch([[a, b]])
    assert "rollout_routed_experts" not in samples_to_batch([[b]])


def test_the_request_asks_for_them():
    assert generate_payload([1, 2], {}, return_routed_experts=True)["return_routed_experts"] is True
    assert "return_routed_experts" not in generate_payload([1, 2], {})


def test_a_slime_generate_function_keeps_slimes_routed_experts():
    """slime's Sample.rollout_routed_experts is [rows, layers, top_k] (a tensor or lists); ours is
    [rows, layers * top_k]; to_slime hands ours over and from_slime takes slime's back."""
    import torch

    from slime_rl.data.slime_compat import to_slime
    from slime_rl.rollout.slime_compat import from_slime

    s = Sample(index=0, group_index=0, prompt="p", prompt_ids=[1, 2, 3])
    append_model_turn(s, _answer([7], np.zeros((3, 4))))
    out = to_slime(s)
    np.testing.assert_array_equal(out.rollout_routed_experts, np.zeros((3, 4)))
    out.append_response_tokens(None, tokens=[8], log_probs=[-0.1], meta_info={"finish_reason": {"type": "stop"}})
    out.rollout_routed_experts = torch.arange(4 * 2 * 2).reshape(4, 2, 2)  # 5 tokens: 4 positions fed
    back = from_slime(out, s, "gen.py:generate")
    np.testing.assert_array_equal(back.rollout_routed_experts, np.arange(16).reshape(4, 4))
    out.rollout_routed_experts = np.zeros((5, 2, 2))
    with pytest.raises(ValueError, match="rollout_routed_experts has 5 rows for 5 tokens"):
        from_slime(out, s, "gen.py:generate")


def test_a_leftover_sample_with_routing_survives_the_checkpoint_json():
    import json

    from slime_rl.orchestration.rollout_manager import _jsonable

    s = Sample(index=0, group_index=0, prompt="p", prompt_ids=[1, 2, 3])
    append_model_turn(s, _answer([7], np.arange(12).reshape(3, 4)))
    back = Sample(**json.loads(json.dumps(_jsonable(dataclasses.asdict(s)))))
    s.reward = back.reward = 1.0
    np.testing.assert_array_equal(samples_to_batch([[back]])["rollout_routed_experts"][0],
                                  s.rollout_routed_experts)
