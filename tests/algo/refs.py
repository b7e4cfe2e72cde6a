"""Plain-Python float64 references written from the papers' formulas (loops, no torch math).

Inputs are nested lists: rows of samples, columns of response tokens; masks hold 0/1.
"""

from __future__ import annotations

import math

Matrix = list[list[float]]


def valid_positions(mask_row: list[float]) -> list[int]:
    return [t for t, m in enumerate(mask_row) if m > 0]


def whiten(values: Matrix, mask: Matrix, eps: float = 1e-8) -> Matrix:
    xs = [values[b][t] for b in range(len(values)) for t in valid_positions(mask[b])]
    n = len(xs)
    if n == 0:
        return [[0.0] * len(row) for row in values]
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / n
    if n >= 2:
        var = var * n / (n - 1)
    out = []
    for b, row in enumerate(values):
        out.append([(row[t] - mean) / math.sqrt(var + eps) if mask[b][t] > 0 else 0.0 for t in range(len(row))])
    return out


def grpo(groups: Matrix, eps: float = 1e-6, normalize_std: bool = True) -> Matrix:
    out = []
    for row in groups:
        n = len(row)
        mean = sum(row) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in row) / (n - 1)) if n > 1 else 0.0
        out.append([(r - mean) / (std + eps) if (normalize_std and n > 1) else r - mean for r in row])
    return out


def rloo(groups: Matrix) -> Matrix:
    out = []
    for row in groups:
        n = len(row)
        adv = []
        for i in range(n):
            others = [row[j] for j in range(n) if j != i]
            adv.append(row[i] - sum(others) / len(others) if others else 0.0)
        out.append(adv)
    return out


def token_rewards(rewards: list[float], mask: Matrix, kl: Matrix | None, kl_coef: float) -> Matrix:
    out = []
    for b, row in enumerate(mask):
        r = [0.0] * len(row)
        pos = valid_positions(row)
        for t in pos:
            r[t] = -kl_coef * kl[b][t] if kl is not None else 0.0
        if pos:
            r[pos[-1]] += rewards[b]
        out.append(r)
    return out


def returns(tok_rewards: Matrix, mask: Matrix, gamma: float) -> Matrix:
    out = []
    for b, row in enumerate(tok_rewards):
        g = [0.0] * len(row)
        pos = valid_positions(mask[b])
        running = 0.0
        for t in reversed(pos):
            running = row[t] + gamma * running
            g[t] = running
        out.append(g)
    return out


def reinforce_pp(rewards: list[float], mask: Matrix, kl: Matrix | None, kl_coef: float,
                 gamma: float) -> tuple[Matrix, Matrix]:
    g = returns(token_rewards(rewards, mask, kl, kl_coef), mask, gamma)
    return whiten(g, mask), g


def reinforce_pp_baseline(groups: Matrix, mask: Matrix, kl: Matrix | None, kl_coef: float) -> Matrix:
    n = len(groups[0])
    raw = []
    for b, row in enumerate(mask):
        group = groups[b // n]
        centred = group[b % n] - sum(group) / n
        raw.append([(centred - (kl_coef * kl[b][t] if kl is not None else 0.0)) if row[t] > 0 else 0.0
                    for t in range(len(row))])
    return whiten(raw, mask)


def gae(rewards: Matrix, values: Matrix, mask: Matrix, gamma: float, lam: float) -> tuple[Matrix, Matrix]:
    adv_out, ret_out = [], []
    for b, row in enumerate(mask):
        pos = valid_positions(row)
        adv = [0.0] * len(row)
        ret = [0.0] * len(row)
        a_next = 0.0
        for k in range(len(pos) - 1, -1, -1):
            t = pos[k]
            v_next = values[b][pos[k + 1]] if k + 1 < len(pos) else 0.0
            delta = rewards[b][t] + gamma * v_next - values[b][t]
            a_next = delta + gamma * lam * a_next
            adv[t] = a_next
            ret[t] = a_next + values[b][t]
        adv_out.append(adv)
        ret_out.append(ret)
    return adv_out, ret_out


def ppo_token(logp: float, old: float, a: float, eps: float, eps_high: float,
              c: float | None = None) -> tuple[float, bool]:
    r = math.exp(logp - old)
    surr1 = r * a
    surr2 = min(max(r, 1 - eps), 1 + eps_high) * a
    loss = -min(surr1, surr2)
    if c is not None and a < 0:
        loss = min(loss, -c * a)
    return loss, surr2 < surr1


def entropy(logits: list[float]) -> float:
    mx = max(logits)
    z = sum(math.exp(x - mx) for x in logits)
    ps = [math.exp(x - mx) / z for x in logits]
    return -sum(p * math.log(p) for p in ps if p > 0)


def aggregate(loss: Matrix, mask: Matrix, mode: str, max_len: int | None = None) -> float:
    tok_sum, tok_n, seq_means, seq_sums = 0.0, 0, [], []
    for b, row in enumerate(loss):
        pos = valid_positions(mask[b])
        s = sum(row[t] for t in pos)
        tok_sum += s
        tok_n += len(pos)
        if pos:
            seq_means.append(s / len(pos))
            seq_sums.append(s)
    if mode == "token-mean":
        return tok_sum / max(tok_n, 1)
    n_seq = max(len(seq_means), 1)
    if mode == "seq-mean-token-mean":
        return sum(seq_means) / n_seq
    if mode == "seq-mean-token-sum":
        return sum(seq_sums) / n_seq
    assert mode == "seq-mean-token-sum-norm" and max_len is not None
    return sum(seq_sums) / (n_seq * max_len)


def overlong(length: int, max_len: int, buffer_len: int, factor: float) -> float:
    expected = max_len - buffer_len
    if length <= expected:
        return 0.0
    if length <= max_len:
        return (expected - length) / buffer_len * factor
    return -factor
