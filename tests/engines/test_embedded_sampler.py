"""The embedded engine's sampler (sampling.sample): the distributions it draws from, computed by hand
here, and that a seeded row's draw does not depend on the rows beside it (which decide whether the
batch takes the sort path for truncation, the shared-noise path, or neither)."""

from __future__ import annotations

import torch

from slime_rl.engines.embedded.sampling import SamplingParams, sample, token_logprobs

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])  # already sorted: truncation sets are easy to read
N = 20000


def _params(**raw) -> SamplingParams:
    return SamplingParams.from_json(raw, vocab_size=len(PROBS))


def _draw(p: SamplingParams, n: int = N, seed: int = 0) -> torch.Tensor:
    """n independent draws in one batch (rows sharing the default generator); frequencies [V]."""
    lp = PROBS.log().expand(n, -1).contiguous()
    tokens = sample(lp, [p] * n, [None] * n, torch.Generator().manual_seed(seed))
    return torch.bincount(tokens, minlength=len(PROBS)).double() / n


def _close(freq: torch.Tensor, want: list[float]) -> None:
    want_t = torch.tensor(want, dtype=torch.float64)
    # 5 standard errors of a binomial frequency at N draws (plus a floor for p = 0 entries)
    tol = 5 * (want_t * (1 - want_t) / N).sqrt() + 1e-12
    assert ((freq - want_t).abs() <= tol).all(), (freq.tolist(), want)


def test_plain_temperature_sampling_draws_from_softmax():
    _close(_draw(_params(temperature=1.0)), [0.5, 0.3, 0.15, 0.05])
    # temperature 2 on the logits: p_i^(1/2) renormalised (by hand from PROBS)
    root = PROBS.double().sqrt()
    lp = token_logprobs(PROBS.log().expand(N, -1), torch.full((N,), 2.0))
    tokens = sample(lp, [_params(temperature=2.0)] * N, [None] * N, torch.Generator().manual_seed(1))
    _close(torch.bincount(tokens, minlength=4).double() / N, (root / root.sum()).tolist())


def test_truncation_keeps_the_sets_worked_out_by_hand():
    _close(_draw(_params(top_k=2)), [0.5 / 0.8, 0.3 / 0.8, 0, 0])
    # top_p 0.7: token 1's mass before it is 0.5 <= 0.7 (kept), token 2's is 0.8 > 0.7 (dropped)
    _close(_draw(_params(top_p=0.7)), [0.5 / 0.8, 0.3 / 0.8, 0, 0])
    # top_p 0.85: 0.8 <= 0.85 keeps token 2 too
    _close(_draw(_params(top_p=0.85)), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    # min_p 0.25: keep p >= 0.125
    _close(_draw(_params(min_p=0.25)), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    assert torch.equal(_draw(_params(temperature=0.0), n=64), torch.tensor([1.0, 0, 0, 0], dtype=torch.float64))


def test_a_seeded_row_draws_the_same_whatever_its_neighbours():
    torch.manual_seed(0)
    V = 1000
    lp = torch.log_softmax(torch.randn(6, V), dim=-1)
    mine = _params(temperature=1.0)

    def seeded() -> torch.Generator:
        return torch.Generator().manual_seed(1234)

    alone = [sample(lp[:1], [mine], [seeded()], torch.Generator().manual_seed(0)).item() for _ in range(2)]
    assert alone[0] == alone[1]
    neighbours = [_params(top_p=0.9), _params(temperature=0.0), _params(top_k=5), mine, mine]
    for seed in (0, 7):
        got = sample(lp, [mine] + neighbours, [seeded()] + [None] * 5, torch.Generator().manual_seed(seed))
        assert got[0].item() == alone[0]
        assert got[2].item() == lp[2].argmax().item()  # the greedy neighbour
        assert got[3].item() in lp[3].topk(5).indices.tolist()
    # a truncation that keeps every token (min_p 1e-30: the sort path) draws what no truncation draws
    wide = sample(lp[:1], [_params(min_p=1e-30)], [seeded()], torch.Generator())
    assert wide.item() == alone[0]
