"""slime's R2 (--use-routing-replay alone): the routing the trainer's own routers chose in the forward
that computed the old log-probs is replayed in the training forwards of the same step.

Scenarios r2_1 / r2_ep2 (routing_replay_scenarios.py): two global mini-batches ({0, 2}, then {1, 3}),
one sample per micro-batch, right-padded rows, and a large Adam step after the first, so that the
routers' own top-2 changes for some tokens of the second mini-batch. Every router call is recorded
with the experts it used and the router's own top-2 of its logits (torch.topk in the test's spy).
Expected values independent of slime_rl.trainer: the old pass's calls themselves, and HF's float64
model with the weights after the first step, run under the recorded routing (routing_ref.py).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from slime_rl.trainer.routing_replay import micro_batch_routing, sample_routing
from tests.trainer.routing_ref import hf_forced_logprobs
from tests.trainer.trainer_ref import hf_logprobs, hf_model, make_batch, select

TOL = 1e-5
FIRST, SECOND = (0, 2), (1, 3)  # the global mini-batches


def _lens() -> list[int]:
    return [len(t) for t in make_batch()["tokens"]]


def _folder(ckpt, tensors: dict, path):
    """An HF folder: the checkpoint's config and tokenizer with `tensors` as its weights."""
    shutil.copytree(ckpt, path, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def _recorded(calls: dict, i: int, n: int) -> np.ndarray:
    """Sample i's routing from the old pass's calls, [n, layers * top-k] (BATCH_KEY's form)."""
    return torch.stack([calls["old", layer, i][0][:n] for layer in (0, 1)], dim=1).reshape(n, 4).numpy()


def test_sample_routing_inverts_micro_batch_routing():
    """Recorded router-order top-k back to per-sample rows: padded [s, b] and packed layouts."""
    rng = np.random.default_rng(0)
    lengths = [4, 2, 3]
    batch = {"tokens": [[0] * n for n in lengths],
             "rollout_routed_experts": [rng.integers(0, 8, size=(n - 1, 2 * 2)).astype(np.int32) for n in lengths]}
    for starts, seq in ((None, 4), ([0, 4, 6], 10)):
        ids, _ = micro_batch_routing(batch, [0, 1, 2], 2, 2, 8, seq, starts)
        rows = sample_routing({0: ids[:, 0], 1: ids[:, 1]}, lengths, 2, 2, 8, seq, starts)
        for got, want in zip(rows, batch["rollout_routed_experts"], strict=True):
            assert got.dtype == np.int32 and np.array_equal(got, want)
        # a pipeline stage with layer 1 only: layer 0 gets 0..k-1
        rows = sample_routing({1: ids[:, 1]}, lengths, 2, 2, 8, seq, starts)
        assert (rows[0].reshape(3, 2, 2)[:, 0] == [0, 1]).all()
    with pytest.raises(ValueError, match="layer 0: recorded \\(3, 2\\) for 12 tokens"):
        sample_routing({0: torch.zeros(3, 2, dtype=torch.long)}, lengths, 2, 2, 8, 4, None)


@pytest.fixture(scope="module")
def r2(scenario):
    (one,) = scenario("r2_1", 1)
    return one


@pytest.mark.slow
def test_r2_replays_the_old_logprob_routing_after_an_update(r2, ckpts, tmp_path):
    lens = _lens()
    for key in ("r2", "free"):  # first mini-batch: the rollout's weights, so both route as the old pass
        calls = r2[f"{key}/calls"]
        for i in FIRST:
            n = lens[i] - 1  # positions whose outputs a log-prob reads (R2 records no more)
            for layer in (0, 1):
                idx, own = calls["train0", layer, i]
                assert torch.equal(idx[:n].sort(-1).values, calls["old", layer, i][0][:n].sort(-1).values)
                assert torch.equal(idx[:n].sort(-1).values, own[:n].sort(-1).values)
    moved = {"r2": 0, "free": 0}
    for key in moved:
        calls = r2[f"{key}/calls"]
        for i in SECOND:
            n = lens[i] - 1  # positions whose outputs a log-prob reads
            for layer in (0, 1):
                rec = calls["old", layer, i][0][:n]
                idx, own = calls["train1", layer, i]
                changed = (own[:n].sort(-1).values != rec.sort(-1).values).any(-1)
                moved[key] += int(changed.sum())
                if key == "r2":
                    assert torch.equal(idx[:n], rec), (i, layer)  # replayed as recorded
                else:
                    assert torch.equal(idx, own)  # routes on its own, so differs where `changed`
    assert moved["r2"] > 0 and moved["free"] > 0, moved  # the step did change the routers' choice
    # the replayed forward's log-probs = HF float64 with the weights after step 1 under the recorded routing;
    # without R2, HF's own routing with that run's weights after step 1 (Adam's first step turns tiny
    # gradient differences, e.g. the unread last position's experts, into ~1e-4 weight differences)
    batch = make_batch()
    w1 = _folder(ckpts["qwen3_moe"], r2["r2/w1"], tmp_path / "w1")
    forced = hf_forced_logprobs(w1, select(batch, list(SECOND)),
                                [_recorded(r2["r2/calls"], i, lens[i] - 1) for i in SECOND])
    own = hf_logprobs(hf_model(_folder(ckpts["qwen3_moe"], r2["free/w1"], tmp_path / "free_w1")),
                      select(batch, list(SECOND)))
    for i, want, free in zip(SECOND, forced, own, strict=True):
        assert float((r2["r2/logp"][i] - want).abs().max()) < TOL
        assert float((r2["free/logp"][i] - free).abs().max()) < TOL  # without R2: its own routing
    assert max(float((f - o).abs().max()) for f, o in zip(forced, own, strict=True)) > 1e-3
    # the old pass routed on its own: the initial model's log-probs
    ref = hf_logprobs(hf_model(ckpts["qwen3_moe"]), batch)
    for key in ("r2", "free"):
        for i, row in r2[f"{key}/old"].items():
            assert float((torch.tensor(row, dtype=torch.float64) - ref[i]).abs().max()) < TOL


@pytest.mark.slow
def test_r2_changes_nothing_on_the_fused_path(r2):
    """One mini-batch per rollout: old log-probs come from the training forward; R2 has nothing to replay."""
    assert r2["fused_r2/phases"] == r2["fused_free/phases"] == ["train0"]  # no separate old-log-prob pass
    assert r2["fused_r2/metrics"] == r2["fused_free/metrics"]
    for name, t in r2["fused_free/weights"].items():
        assert torch.equal(r2["fused_r2/weights"][name], t), name


@pytest.mark.slow
def test_r2_expert_parallel_equals_one_rank(r2, scenario):
    """EP=2 (DP=2, rank r holds samples 2r, 2r + 1): the same replayed experts and log-probs."""
    ranks = scenario("r2_ep2", 2)
    lens, seen = _lens(), set()
    for rec in ranks:
        for (phase, layer, i), (idx, _) in rec["r2/calls"].items():
            n = lens[i] - 1
            assert torch.equal(idx[:n], r2["r2/calls"][phase, layer, i][0][:n]), (phase, layer, i)
            seen.add(phase)
        for i, row in rec["r2/logp"].items():
            assert float((row - r2["r2/logp"][i]).abs().max()) < TOL, i
    assert seen == {"old", "train0", "train1"}
    for rec in ranks:
        for k in ("train/loss", "train/grad_norm"):
            assert rec["r2/metrics"][k] == pytest.approx(r2["r2/metrics"][k], rel=1e-5, abs=1e-7), k


R2_LAYOUTS = [("r2_ep2tp2", True), ("r2_ep2pp2", False)]


@pytest.mark.slow
@pytest.mark.parametrize("name,every_rank", R2_LAYOUTS, ids=[c[0] for c in R2_LAYOUTS])
def test_r2_tensor_or_pipeline_and_expert_parallel_equal_one_rank(r2, scenario, name, every_rank):
    """TP=2 (sequence parallel, packed rows: each TP rank's routers see half of every row, the recorded
    halves are gathered) x EP=2, or PP=2 (each stage records and replays its own layer) x EP=2, DP=2:
    one rank's training log-probs of both mini-batches (on the last stage) and metrics."""
    ranks = scenario(name, 4)
    assert sum(1 for rec in ranks if rec["r2/logp"]) == (4 if every_rank else 2)
    for rec in ranks:
        if every_rank or rec["r2/logp"]:
            assert sorted(rec["r2/logp"]) == sorted(rec["r2/old"])
        for i, row in rec["r2/logp"].items():
            assert float((row - r2["r2/logp"][i]).abs().max()) < TOL, i
        for k in ("train/loss", "train/grad_norm"):
            assert rec["r2/metrics"][k] == pytest.approx(r2["r2/metrics"][k], rel=1e-5, abs=1e-7), k
