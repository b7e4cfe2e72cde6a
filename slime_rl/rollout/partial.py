"""Per-token bookkeeping of a response that grows over several requests: model turns, environment
tokens, and the continuation of a partial rollout.

A response may be built by more than one /generate call: a multi-turn custom generate function
appends model turns and environment tokens; a partial rollout (a group cut at the deadline or after
enough groups were kept) is continued next step from prompt + response so far. Every response token
therefore carries, index-aligned with `response_ids`:
- `rollout_logprobs`: the engine's log-prob (0.0 for environment tokens, which no model sampled);
- `loss_mask`: 1 = trained (model tokens), 0 = not (environment tokens, masked off-policy tokens);
- `metadata[VERSIONS]`: the engine weight version that produced it (None for environment tokens),
  so the trainer can mask or importance-correct tokens sampled by older weights.
`metadata[STATUS]` says where the sample stands: PENDING (nothing yet), ABORTED (cut, to be
continued), COMPLETED (stopped by EOS / a stop string or token) or TRUNCATED (hit a length cap).
These live in `metadata` because `Sample` belongs to the data room; the keys are proposed as fields.
"""

from __future__ import annotations

from typing import Any

from slime_rl.data import Sample
from slime_rl.data.sample import ROLLOUT_STATUS_KEY as STATUS
from slime_rl.data.sample import TOKEN_VERSIONS_KEY as VERSIONS
from slime_rl.engines.payloads import decode_routed_experts

PENDING, ABORTED, COMPLETED, TRUNCATED = "pending", "aborted", "completed", "truncated"
DONE = (COMPLETED, TRUNCATED)


def status(sample: Sample) -> str:
    return sample.metadata.get(STATUS, PENDING)


def is_done(sample: Sample) -> bool:
    return status(sample) in DONE


def token_versions(sample: Sample) -> list[str | None]:
    return sample.metadata.setdefault(VERSIONS, [])


def _check_aligned(sample: Sample) -> None:
    n = len(sample.response_ids)
    lens = (len(sample.rollout_logprobs), len(sample.loss_mask), len(token_versions(sample)))
    assert lens == (n, n, n), f"sample {sample.index}: per-token lists {lens} != {n} response tokens"


def append_model_turn(sample: Sample, out: dict[str, Any], tokenizer: Any = None) -> list[int]:
    """Append one /generate answer (SGLang's shape) as trained tokens; set finish_reason, status and
    weight_version from it. Returns the new token ids. An abort keeps the tokens it had."""
    meta = out.get("meta_info") or {}
    entries = meta.get("output_token_logprobs") or []
    ids = [int(e[1]) for e in entries] if entries else [int(t) for t in out.get("output_ids") or []]
    lps = [float(e[0]) for e in entries]
    if len(lps) != len(ids):
        raise RuntimeError(f"engine answer {meta.get('id')!r}: {len(lps)} log-probs for {len(ids)} tokens "
                           "(was return_logprob sent?)")
    version = meta.get("weight_version")
    routed = meta.get("routed_experts")
    sample.response_ids.extend(ids)
    if routed is not None:
        # SGLang's rows cover [0, seqlen - 1) of this request's prompt + output, which is the
        # sample's tokens so far (the request sent them all)
        rows = len(sample.tokens) - 1
        flat = decode_routed_experts(routed, f"engine answer {meta.get('id')!r}: routed_experts")
        if rows < 1 or flat.size % rows:
            raise RuntimeError(f"engine answer {meta.get('id')!r}: routed_experts holds {flat.size} ids, not a "
                               f"whole number per position for the {rows} positions before the last token")
        sample.rollout_routed_experts = flat.reshape(rows, -1)
    sample.rollout_logprobs.extend(lps)
    sample.loss_mask.extend([1] * len(ids))
    token_versions(sample).extend([version] * len(ids))
    if version is not None:
        sample.weight_version = version
    finish = meta.get("finish_reason") or {}
    sample.finish_reason = finish.get("type", "") if isinstance(finish, dict) else str(finish)
    sample.metadata[STATUS] = {"abort": ABORTED, "length": TRUNCATED}.get(sample.finish_reason, COMPLETED)
    if tokenizer is not None:
        sample.response = tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    _check_aligned(sample)
    return ids


def append_env_tokens(sample: Sample, ids: list[int], tokenizer: Any = None) -> None:
    """Append environment tokens (tool output, user turn): in the context, never trained, no log-prob."""
    sample.response_ids.extend(int(t) for t in ids)
    sample.rollout_logprobs.extend([0.0] * len(ids))
    sample.loss_mask.extend([0] * len(ids))
    token_versions(sample).extend([None] * len(ids))
    if tokenizer is not None:
        sample.response = tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    _check_aligned(sample)


def mark_truncated(sample: Sample) -> None:
    """No budget left (response or context length): finished as SGLang would, by length."""
    sample.finish_reason = "length"
    sample.metadata[STATUS] = TRUNCATED


def offpolicy_tokens(sample: Sample) -> list[int]:
    """1 for each model token produced by weights other than the latest that touched the sample
    (`sample.weight_version`), else 0: what was sampled before a weight update and continued after."""
    return [int(v is not None and v != sample.weight_version) for v in token_versions(sample)]


def mask_offpolicy(sample: Sample) -> int:
    """`--mask-offpolicy-in-partial-rollout`: drop off-policy tokens from the loss; returns how many."""
    n = 0
    for i, off in enumerate(offpolicy_tokens(sample)):
        if off and sample.loss_mask[i]:
            sample.loss_mask[i] = 0
            n += 1
    return n


def group_status(group: list[Sample]) -> str:
    """COMPLETED when every sample is done, else ABORTED (the group must be continued)."""
    return COMPLETED if all(is_done(s) for s in group) else ABORTED
