"""Rollout routing replay in the trainer (slime's R3, --use-rollout-routing-replay): the routers use
the engine's experts with gates from their own logits, on one rank and with experts, tensors and
layers spread over ranks; train/routing_agreement counts the pairs the trainer would route alike.

Expected values (routing_ref.py, independent of slime_rl.trainer): HF's float64 model run under the
engine's routing, and under its own; the agreement from how the engine routing was built.
Tolerance: log-probs 1e-5 absolute (fp32 vs float64, as test_moe.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slime_rl.trainer.routing_replay import micro_batch_routing
from tests.trainer.routing_ref import engine_routing, hf_forced_logprobs
from tests.trainer.trainer_ref import hf_logprobs, hf_model, make_batch

TOL = 1e-5


def _max_diff(got: list, want: list) -> float:
    return max(float((torch.as_tensor(g, dtype=torch.float64) - w.double()).abs().max())
               for g, w in zip(got, want, strict=True))


@pytest.fixture(scope="module")
def rr_ref(ckpts):
    batch = make_batch()
    routing, share = engine_routing(ckpts["qwen3_moe"], batch)
    same_total: list = []
    forced = hf_forced_logprobs(ckpts["qwen3_moe"], batch, routing, same_total)
    # without replay the trainer routes on its own throughout; with it, layer 1 sees the hidden
    # states of layer 0's replayed routing, so its own choice is that run's
    return {"forced": forced, "own": hf_logprobs(hf_model(ckpts["qwen3_moe"]), batch),
            "agreement/free": share, "agreement/replay": same_total[0] / same_total[1]}


def test_engine_routing_follows_the_tokens_into_the_router_order():
    """Padded rows: sequence-major [s, b]; packed: offsets in the one row; SP: this rank's chunk;
    positions the engine never routed get 0..k-1 and are masked."""
    batch = {"tokens": [[1, 2, 3], [4, 5]],
             "rollout_routed_experts": [np.array([[1, 2], [3, 4]]), np.array([[5, 6]])]}  # 1 layer, top-2
    ids, mask = micro_batch_routing(batch, [0, 1], 1, 2, 8, seq_len=3, packed_starts=None)
    # [s=3, b=2]: (pos0, s0), (pos0, s1), (pos1, s0), (pos1, s1), (pos2, s0), (pos2, s1)
    assert ids[:, 0].tolist() == [[1, 2], [5, 6], [3, 4], [0, 1], [0, 1], [0, 1]]
    assert mask.tolist() == [True, True, True, False, False, False]
    ids, mask = micro_batch_routing(batch, [0, 1], 1, 2, 8, seq_len=6, packed_starts=[0, 3])
    assert ids[:, 0].tolist() == [[1, 2], [3, 4], [0, 1], [5, 6], [0, 1], [0, 1]]
    assert mask.tolist() == [True, True, False, True, False, False]
    ids, mask = micro_batch_routing(batch, [0, 1], 1, 2, 8, seq_len=6, packed_starts=[0, 3], sp_size=2, sp_rank=1)
    assert ids[:, 0].tolist() == [[5, 6], [0, 1], [0, 1]] and mask.tolist() == [True, False, False]
    with pytest.raises(ValueError, match="sample 0: rollout_routed_experts has 3 rows for 3 tokens"):
        micro_batch_routing({**batch, "rollout_routed_experts": [np.zeros((3, 2)), np.zeros((1, 2))]},
                            [0, 1], 1, 2, 8, 3, None)
    with pytest.raises(ValueError, match="outside \\[0, 8\\)"):
        micro_batch_routing({**batch, "rollout_routed_experts": [np.full((2, 2), 8), np.zeros((1, 2))]},
                            [0, 1], 1, 2, 8, 3, None)


@pytest.mark.slow
def test_one_rank_replays_the_engine_routing(scenario, rr_ref):
    (one,) = scenario("rr1", 1)
    assert 0.5 < rr_ref["agreement/free"] < 1  # the engine routing flips some pairs
    assert _max_diff(rr_ref["own"], rr_ref["forced"]) > 1e-3  # and the flips change the log-probs
    for layout in ("padded", "packed"):
        assert _max_diff(one[f"replay/{layout}/logp"], rr_ref["forced"]) < TOL
        assert _max_diff(one[f"free/{layout}/logp"], rr_ref["own"]) < TOL
    # the batch's rollout log-probs are the forced ones: the step-0 gap closes with replay only
    assert one["replay/metrics"]["train/rollout_logprob_abs_diff"] < TOL
    assert one["free/metrics"]["train/rollout_logprob_abs_diff"] > 1e-4
    for key in ("replay", "free"):
        want = rr_ref[f"agreement/{key}"]
        assert one[f"{key}/metrics"]["train/routing_agreement"] == pytest.approx(want, abs=1e-12), key


RR_CASES = [("rr_ep2", 2), ("rr_ep2tp2", 4), ("rr_ep2pp2", 4)]


@pytest.mark.slow
@pytest.mark.parametrize("name,world", RR_CASES, ids=[c[0] for c in RR_CASES])
def test_parallel_replay_equals_one_rank(scenario, rr_ref, name, world):
    (one,) = scenario("rr1", 1)
    ranks = scenario(name, world)
    for layout in ("packed",) if name == "rr_ep2tp2" else ("padded", "packed"):
        diff = 0.0
        for rec in ranks:
            for i, row in zip(rec["replay/ids"], rec[f"replay/{layout}/logp"], strict=True):
                diff = max(diff, max(abs(a - b) for a, b in zip(row, one[f"replay/{layout}/logp"][i], strict=True)))
        assert diff < 1e-6, (name, layout, diff)
    for rec in ranks:
        want = rr_ref["agreement/replay"]
        assert rec["replay/metrics"]["train/routing_agreement"] == pytest.approx(want, abs=1e-12)
        assert rec["replay/metrics"]["train/rollout_logprob_abs_diff"] < TOL
