"""Issue 5, PPO's critic: the value model (slime_rl.trainer.critic) and the PPO advantages.

References: HF transformers float64 (the backbone's hidden states after the final norm, times the
critic's own head) for the values; tests/algo/refs.py (float64 loops) for GAE; the value loss and
explained variance written out here from the values and returns. Tolerances (2 CPU cores):
  * values vs HF fp64, packed vs padded vs alone, TP=2 / SP / PP=2 vs TP=1: 1e-5 absolute (fp32);
  * metrics vs the hand formulas: 1e-5 absolute; TP=2 / SP / PP=2 vs TP=1 metrics: 1e-5 relative + 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch

from slime_rl.config.groups import AlgoConfig
from slime_rl.trainer.batching import build_micro_batch
from slime_rl.trainer.critic import response_values
from slime_rl.trainer.objective import token_advantages
from tests.algo import refs
from tests.trainer.critic_scenarios import RETURNS
from tests.trainer.trainer_ref import hf_model, make_batch

TOL = 1e-5


def _max_diff(got: list[list[float]], want: list[list[float]]) -> float:
    assert [len(g) for g in got] == [len(w) for w in want]
    return max(abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))


def _hf_values(ckpt, batch: dict, weight: torch.Tensor, bias: torch.Tensor) -> list[list[float]]:
    """V of response token j of sample i: the head applied to the final-norm hidden state at the
    position that predicts token j (L - R + j - 1), HF float64."""
    model = hf_model(ckpt)
    out = []
    with torch.no_grad():
        for toks, r in zip(batch["tokens"], batch["response_lengths"], strict=True):
            hidden = model.model(torch.tensor([toks])).last_hidden_state[0].double()  # [L, h]
            n = len(toks)
            v = hidden[n - r - 1 : n - 1] @ weight.double()[0] + bias.double()[0]
            out.append(v.tolist())
    return out


def test_response_values_read_the_positions_that_predict_each_response_token():
    """A hand-made critic output whose value at position p is p: the value of response token j of
    a sample of length L with R response tokens must come from position L - R + j - 1, in the
    padded layout and in the packed one (offset by the sample's start in the pack)."""
    from slime_rl.trainer.packing import build_packed_micro_batch

    batch = {"tokens": [[5, 6, 7, 8, 9], [1, 2, 3], [4, 4, 4, 4]], "response_lengths": [2, 1, 3],
             "loss_masks": [[1, 1], [1], [1, 0, 1]]}
    want = [[2.0, 3.0], [1.0], [0.0, 1.0, 2.0]]  # L - R + j - 1
    padded = build_micro_batch(batch, [0, 1, 2], torch.device("cpu"))
    pos = torch.arange(padded.tokens.shape[1], dtype=torch.float32)
    out = pos.view(1, -1, 1).expand(3, -1, 1)  # [b, s, 1]
    got = response_values(out, padded)
    assert [row[:n].tolist() for row, n in zip(got, [2, 1, 3], strict=True)] == want
    packed = build_packed_micro_batch(batch, [0, 1, 2], torch.device("cpu"))
    out = torch.arange(packed.tokens.shape[1], dtype=torch.float32).view(1, -1, 1)  # [1, t, 1]
    got = response_values(out, packed)
    starts = [0, 5, 8]
    assert [row[:n].tolist() for row, n in zip(got, [2, 1, 3], strict=True)] == \
        [[s + x for x in w] for s, w in zip(starts, want, strict=True)]


@pytest.mark.parametrize("gamma,lambd,kl_coef", [(1.0, 1.0, 0.0), (0.9, 0.8, 0.0), (0.99, 0.95, 0.1)])
def test_ppo_token_advantages_are_whitened_gae_of_outcome_rewards(gamma, lambd, kl_coef):
    batch = make_batch()
    values = [[0.1 * (i + 1) - 0.05 * j for j in range(r)] for i, r in enumerate(batch["response_lengths"])]
    old = [[-0.5 - 0.1 * j for j in range(r)] for r in batch["response_lengths"]]
    ref = [[-0.7 + 0.05 * j for j in range(r)] for r in batch["response_lengths"]]
    algo = AlgoConfig(advantage_estimator="ppo", gamma=gamma, lambd=lambd, kl_coef=kl_coef, kl_loss_type="k1")
    adv, ret = token_advantages(algo, batch, old, ref if kl_coef else None, torch.device("cpu"), None, values)
    width = max(batch["response_lengths"])

    def pad(rows):
        return [list(r) + [0.0] * (width - len(r)) for r in rows]

    mask = pad(batch["loss_masks"])
    kl = [[o - f for o, f in zip(orow, frow, strict=True)] for orow, frow in zip(pad(old), pad(ref), strict=True)]
    tok = refs.token_rewards(batch["rewards"], mask, kl if kl_coef else None, kl_coef)
    want_adv, want_ret = refs.gae(tok, pad(values), mask, gamma, lambd)
    want_adv = refs.whiten(want_adv, mask)
    lens = batch["response_lengths"]
    assert _max_diff(adv, [r[:n] for r, n in zip(want_adv, lens, strict=True)]) < TOL
    assert _max_diff(ret, [r[:n] for r, n in zip(want_ret, lens, strict=True)]) < TOL


def test_ppo_advantages_need_values():
    batch = make_batch()
    with pytest.raises(ValueError, match="critic's values"):
        token_advantages(AlgoConfig(advantage_estimator="ppo"), batch, [[0.0] * r for r in batch["response_lengths"]],
                         None, torch.device("cpu"), None, None)


@pytest.mark.slow
def test_critic_values_equal_hf_backbone_with_the_head(scenario, ckpts):
    (rec,) = scenario("critic1", 1)
    assert rec["tied"]  # qwen2 ties its embeddings: the input embedding stays, the LM head is gone
    assert [p for p in rec["params"] if p.startswith("output_layer")] == ["output_layer.bias", "output_layer.weight"]
    want = _hf_values(ckpts["qwen2"], make_batch(), rec["head/weight"], rec["head/bias"])
    for layout in ("padded", "packed", "alone"):
        assert _max_diff(rec[f"{layout}/values"], want) < TOL, layout
    assert _max_diff(rec["tp1/values"], want) < TOL


def _trained(batch: dict, rows: list[list[float]]) -> list[float]:
    return [x for m, row in zip(batch["loss_masks"], rows, strict=True) for k, x in zip(m, row, strict=True) if k]


@pytest.mark.slow
def test_critic_step_metrics_match_the_formulas_and_fit_the_returns(scenario):
    (rec,) = scenario("critic1", 1)
    batch = make_batch()
    v, r = _trained(batch, rec["tp1/values"]), _trained(batch, [list(x) for x in RETURNS])
    n = len(v)
    m = rec["tp1/metrics"]
    # one mini-batch: its forward is the old values, so the clip cannot act; token-mean loss
    assert abs(m["train/value_loss"] - sum(0.5 * (a - b) ** 2 for a, b in zip(v, r, strict=True)) / n) < TOL
    assert m["critic/value_clipfrac"] == 0.0
    mean_r = sum(r) / n
    d = [b - a for a, b in zip(v, r, strict=True)]
    mean_d = sum(d) / n
    ev = 1 - (sum((x - mean_d) ** 2 for x in d) / n) / (sum((x - mean_r) ** 2 for x in r) / n)
    assert abs(m["train/explained_variance"] - ev) < TOL
    assert abs(m["critic/value_mean"] - sum(v) / n) < TOL
    assert math.isfinite(m["critic/grad_norm"]) and m["critic/grad_norm"] > 0
    after = _trained(batch, rec["tp1/after"])

    def sq_err(values: list[float]) -> float:
        return sum((a - b) ** 2 for a, b in zip(values, r, strict=True))

    assert sq_err(after) < sq_err(v)  # one update moved the values towards the returns
    # Llama (untied LM head, replaced too), two mini-batches: the second one is clipped somewhere
    lm = rec["llama/metrics"]
    assert all(math.isfinite(x) for x in lm.values()) and lm["critic/grad_norm"] > 0
    assert 0 < lm["critic/value_clipfrac"] < 1


@pytest.mark.slow
def test_critic_checkpoint_round_trip_is_exact(scenario):
    (rec,) = scenario("critic1", 1)
    assert rec["reload/extra"] == {"rollout_id": 0}
    assert rec["reload/values"] == rec["tp1/after"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "sp", "pp"])
def test_critic_at_tp2_equals_tp1(scenario, layout):
    """TP=2 (the head on replicated hidden states), TP=2 + sequence parallel (the head gathers the
    sequence) and PP=2 (the head on the last stage, values broadcast): values, metrics and the
    values after one update equal TP=1's."""
    (one,) = scenario("critic1", 1)
    recs = scenario("critic2", 2)
    assert sorted(r["tp_rank"] for r in recs) == [0, 1]  # of the TP=2 critic
    for rec in recs:
        assert _max_diff(rec[f"{layout}/values"], one["tp1/values"]) < TOL
        assert _max_diff(rec[f"{layout}/after"], one["tp1/after"]) < TOL
        for key, want in one["tp1/metrics"].items():
            assert rec[f"{layout}/metrics"][key] == pytest.approx(want, rel=1e-5, abs=1e-6), key

