"""The embedded engine's sampler (sampling.sample, and SamplerPlan.draw, the engine's entry, which
skips the [B, V] log-softmax when no row truncates): the distributions it draws from and the
log-probs it reports, computed by hand or in float64 here, and that a seeded row's draw does not
depend on the rows beside it (which decide whether the batch takes the sort path for truncation,
the shared-noise path, or neither)."""

from __future__ import annotations

import torch

from slime_rl.engines.embedded.sampling import SamplerPlan, SamplingParams, gumbel_pick, sample, token_logprobs

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


def _plan_draw(logits: torch.Tensor, params: list[SamplingParams], gens: list, seed: int):
    plan = SamplerPlan(params, gens, logits.shape[1], logits.device)
    return plan.draw(logits, torch.Generator().manual_seed(seed))


def test_draw_samples_the_tempered_softmax_and_reports_its_float64_logprob():
    """The engine's path without truncation: frequencies of softmax(logits / T) worked out by hand
    (T = 2: p_i^(1/2) renormalised), and each token's log-prob equal to log_softmax(logits / T) at
    that token computed in float64 (the convention of the module: full vocabulary, at T)."""
    logits = (PROBS.log() + 3.0).expand(N, -1).contiguous()  # a shift changes nothing, by hand
    tokens, lp = _plan_draw(logits, [_params(temperature=2.0)] * N, [None] * N, seed=3)
    root = PROBS.double().sqrt()
    _close(torch.bincount(tokens, minlength=4).double() / N, (root / root.sum()).tolist())
    want = torch.log_softmax(logits.double() / 2.0, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), want, atol=1e-6, rtol=0)
    _close(torch.bincount(_plan_draw(logits, [_params()] * N, [None] * N, seed=4)[0], minlength=4).double() / N,
           PROBS.tolist())


def test_draw_greedy_rows_and_seeded_rows_beside_sampled_ones():
    torch.manual_seed(1)
    V = 1000
    logits = torch.randn(5, V) * 3
    mine = _params(temperature=0.8)

    def seeded() -> torch.Generator:
        return torch.Generator().manual_seed(99)

    alone_tok, alone_lp = _plan_draw(logits[:1], [mine], [seeded()], seed=0)
    ref = torch.log_softmax(logits[0].double() / 0.8, dim=-1)[alone_tok]
    torch.testing.assert_close(alone_lp.double(), ref, atol=1e-6, rtol=0)
    # greedy rows (all greedy: no noise drawn; and mixed with sampling rows), the seeded row unchanged
    # by its neighbours, and by a truncating neighbour (which sends the batch to the sort path)
    for neighbours in ([_params(temperature=0.0)] * 4, [_params(temperature=0.0), mine, mine, _params(top_k=1)],
                       [_params(top_p=0.9), _params(temperature=0.0), mine, mine]):
        params = [mine] + neighbours
        tok, lp = _plan_draw(logits, params, [seeded()] + [None] * 4, seed=5)
        assert tok[0] == alone_tok[0]
        for i, p in enumerate(params):
            if p.top_k == 1:
                assert tok[i] == logits[i].argmax()
            # every row's log-prob at its own temperature (greedy rows: temperature 1, as SGLang)
            want = torch.log_softmax(logits[i].double() / p.temperature, dim=-1)[tok[i]]
            torch.testing.assert_close(lp[i].double(), want, atol=1e-6, rtol=0)
    all_greedy = _plan_draw(logits, [_params(temperature=0.0)] * 5, [None] * 5, seed=0)[0]
    assert torch.equal(all_greedy, logits.argmax(dim=-1))


def test_gumbel_pick_is_the_gumbel_max_draw_of_the_log_softmax():
    """Against the textbook form written out in float64 with the same uniforms: argmax over
    log_softmax(x) - log(-log U) (x = logits / T), whose normalizer gumbel_pick leaves out."""
    torch.manual_seed(2)
    logits, temp = torch.randn(64, 500).bfloat16() * 4, torch.rand(64) + 0.5
    u = torch.rand(64, 500)
    tok, lp = gumbel_pick(logits, temp, u.clone(), None)  # eagerly it overwrites its uniforms
    x = logits.double() / temp.double()[:, None]
    ref_lp = torch.log_softmax(x, dim=-1)
    assert torch.equal(tok, (ref_lp - (-u.double().log()).log()).argmax(dim=-1))
    torch.testing.assert_close(lp.double(), ref_lp.gather(1, tok[:, None]).squeeze(1), atol=1e-5, rtol=0)


def test_draw_equals_the_log_softmax_path_bit_for_bit():
    """Without truncation the engine's `draw` (gumbel_pick, eagerly) and the sort path's formula
    (token_logprobs, then `sample`) take the same uniforms from the same generators and must give
    the same tokens and the same log-probs exactly: greedy, shared-noise and own-generator rows."""
    torch.manual_seed(3)
    logits = (torch.randn(7, 2000) * 3).bfloat16()
    params = [_params(temperature=t) for t in (1.0, 0.0, 0.7, 1.3, 0.0, 1.0, 2.0)]

    def gens() -> list:
        return [None, None, torch.Generator().manual_seed(5), None, None, torch.Generator().manual_seed(6), None]

    plan = SamplerPlan(params, gens(), 2000, logits.device)
    tok, lp = plan.draw(logits, torch.Generator().manual_seed(11))
    plan = SamplerPlan(params, gens(), 2000, logits.device)
    ref_lp = token_logprobs(logits, plan.temperature)
    ref_tok = plan.sample(ref_lp, torch.Generator().manual_seed(11))
    assert torch.equal(tok, ref_tok)
    assert torch.equal(lp, ref_lp.gather(1, ref_tok[:, None]).squeeze(1))
