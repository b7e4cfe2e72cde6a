"""Rollout room alone: group generation against a fake engine client (the real engine is tested in
tests/engines; the full loop in tests/e2e)."""

import asyncio

import pytest
import torch

from slime_rl.config import RolloutConfig
from slime_rl.data import PromptRow
from slime_rl.orchestration.rollout_manager import rollout_metrics, samples_to_batch
from slime_rl.rollout.generate import generate_groups
from slime_rl.weight_sync.broadcast import buckets, dtype_name, flatten_bucket


class FakeClient:
    def __init__(self, name, answer):
        self.base_url, self.answer, self.calls = name, answer, []
        self.in_flight = self.peak = 0

    async def generate(self, input_ids, sampling_params, return_logprob, rid, image_data=None):
        self.calls.append((rid, sampling_params))
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        for _ in range(1 + len(self.calls) % 3):  # uneven service times, counted in event-loop turns:
            await asyncio.sleep(0)                # deterministic where wall-clock timers are not
        self.in_flight -= 1
        ids = [ord(c) for c in self.answer]
        return {"text": self.answer, "output_ids": ids,
                "meta_info": {"finish_reason": {"type": "length"}, "weight_version": "3",
                              "output_token_logprobs": [[-0.5, i, None] for i in ids]}}


class CharTok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_groups_scored_balanced_and_batched():
    a, b = FakeClient("a", "7"), FakeClient("b", "3")
    rows = [PromptRow("p0", [1, 2], "7", {}), PromptRow("p1", [3], "3", {})]
    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=4, max_response_len=5, temperature=0.7,
                        concurrency_per_engine=2)
    groups = asyncio.run(generate_groups([a, b], rows, cfg, lambda s: 1.0 if s.response == s.label else 0.0,
                                         CharTok(), progress=False))
    assert [len(g) for g in groups] == [4, 4]
    assert len(a.calls) == len(b.calls) == 4  # least-in-flight routing spreads the load evenly
    assert a.peak + b.peak <= 4  # the concurrency cap (2 per engine) held
    assert {p["max_new_tokens"] for _, p in a.calls} == {5}
    flat = [s for g in groups for s in g]
    assert sorted(s.index for s in flat) == list(range(8))
    assert all(s.rollout_logprobs == [-0.5] for s in flat) and all(s.weight_version == "3" for s in flat)

    batch = samples_to_batch(groups)
    assert batch["tokens"][0][:2] == [1, 2] and len(batch["loss_masks"][0]) == batch["response_lengths"][0] == 1
    # per group, advantages sum to zero (mean-centred)
    adv = torch.tensor(batch["advantages"]).view(2, 4)
    assert torch.allclose(adv.sum(dim=1), torch.zeros(2), atol=1e-6)
    m = rollout_metrics(groups)
    assert m["rollout/truncated_frac"] == 1.0 and m["rollout/response_len_mean"] == 1.0


@pytest.mark.parametrize("max_bytes", [1, 1000, 5000, 20000, 1 << 30])
def test_buckets_keep_deepseek_q_a_and_kv_a_together(tiny_deepseek_v3, max_bytes):
    """Weight sync of the tiny DeepSeek-V3, in the order the trainer sends it: whatever the bucket size, every
    layer's kv_a_proj_with_mqa is in the bucket of its q_a_proj (SGLang's DeepSeek loader fuses the pair only
    within one load_weights call); every other bucket boundary is where the size alone puts it."""
    from slime_rl.trainer.convert import hf_shapes, load_arch

    shapes = hf_shapes(load_arch(tiny_deepseek_v3))
    named = [(n, torch.zeros(shape, dtype=torch.bfloat16)) for n, shape in shapes.items()]
    out = [[n for n, _ in b] for b in buckets(named, max_bytes=max_bytes)]
    assert [n for b in out for n in b] == [n for n, _ in named]  # order kept, nothing lost
    where = {n: i for i, b in enumerate(out) for n in b}
    pairs = [(n, n.replace("q_a_proj", "kv_a_proj_with_mqa")) for n in shapes
             if n.endswith("self_attn.q_a_proj.weight")]
    assert len(pairs) == 4
    assert all(where[q] == where[kv] for q, kv in pairs)
    sizes = {n: t.numel() * 2 for n, t in named}
    for b in out:  # over the cap only a lone tensor or a bucket that the pair completes
        if sum(sizes[n] for n in b) > max_bytes and len(b) > 1:
            assert b[-1].endswith("kv_a_proj_with_mqa.weight"), b


def test_buckets_respect_size_and_order():
    named = [(f"w{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([4, 4, 10, 1, 1])]
    out = [[n for n, _ in b] for b in buckets(named, max_bytes=32)]
    assert out == [["w0", "w1"], ["w2"], ["w3", "w4"]]
    mixed = [("a", torch.zeros(2)), ("b", torch.zeros(2, dtype=torch.bfloat16)), ("c", torch.zeros(2))]
    assert [[n for n, _ in b] for b in buckets(mixed, max_bytes=1 << 20)] == [["a"], ["b"], ["c"]]
    flat = flatten_bucket([("x", torch.tensor([1.0, -2.0])), ("y", torch.tensor([3.0]))])
    assert flat.dtype == torch.uint8 and flat.numel() == 12
    assert flat[:8].view(torch.float32).tolist() == [1.0, -2.0] and flat[8:].view(torch.float32).tolist() == [3.0]
    assert dtype_name(torch.bfloat16) == "bfloat16"


def _groups(rewards, lengths):
    from slime_rl.data import Sample

    return [[Sample(index=0, group_index=g, prompt="p", prompt_ids=[1], reward=r, response_ids=[5] * n)
             for r, n in zip(rs, ns, strict=True)] for g, (rs, ns) in enumerate(zip(rewards, lengths, strict=True))]


def test_batch_advantages_follow_the_estimator_flags():
    from slime_rl.config import AlgoConfig

    groups = _groups([[1.0, 0.0, 0.0]], [[2, 2, 2]])
    rloo = samples_to_batch(groups, AlgoConfig(advantage_estimator="rloo"))["advantages"]
    assert rloo == [1.0, -0.5, -0.5]  # r_i minus the mean of the other two, by hand
    dr = samples_to_batch(groups, AlgoConfig(normalize_group_std=False))["advantages"]
    assert torch.allclose(torch.tensor(dr, dtype=torch.float64), torch.tensor([2 / 3, -1 / 3, -1 / 3],
                                                                              dtype=torch.float64))


def test_overlong_penalty_shapes_rewards_before_advantages():
    from slime_rl.config import AlgoConfig

    # max len 10, buffer 4: no penalty up to 6 tokens, -0.5 at 8, -1 at 10 (factor 1)
    groups = _groups([[1.0, 1.0, 1.0]], [[6, 8, 10]])
    batch = samples_to_batch(groups, AlgoConfig(overlong_buffer_len=4, overlong_penalty_factor=1.0), 10)
    assert batch["rewards"] == [1.0, 0.5, 0.0]
    assert batch["advantages"][0] > batch["advantages"][1] > batch["advantages"][2]
