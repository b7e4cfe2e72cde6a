"""--opd-type sglang: the teacher of on-policy distillation is a server of its own (SGLang, or the built-in
engine: any model that shares the policy's tokenizer), as in slime's examples/on_policy_distillation: each
finished sample's tokens go to the teacher's /generate (`--rm-url`) with `max_new_tokens` 0, `return_logprob`
and `logprob_start_len` 0, and the teacher's log-prob of each response token is kept with the sample
(`Sample.teacher_logprobs`). The trainer then takes them for the reverse KL in the advantages
(trainer/objective.py `opd_advantages`) instead of running a teacher forward itself."""

from __future__ import annotations

from typing import Any

from slime_rl.data import Sample


class TeacherError(RuntimeError):
    """The teacher server's answer cannot give this sample's response log-probs; the message names the URL."""


def teacher_body(sample: Sample, temperature: float) -> dict[str, Any]:
    """The /generate body of slime's on_policy_distillation.reward_func: the sample's tokens, nothing generated,
    the log-prob of every token from the first on."""
    return {"input_ids": list(sample.tokens), "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"temperature": temperature, "max_new_tokens": 0, "skip_special_tokens": False}}


def response_logprobs(answer: dict[str, Any], sample: Sample, url: str) -> list[float]:
    """The teacher's log-probs of the sample's response tokens from its /generate answer: SGLang's
    meta_info.input_token_logprobs ([logprob, token id, text] per token, none for the first), the last
    response_length of them (slime's post_process_rewards); the token ids must be the sample's."""
    entries = (answer.get("meta_info") or {}).get("input_token_logprobs") or []
    tokens, n = sample.tokens, sample.response_length
    if len(entries) != len(tokens):
        raise TeacherError(f"teacher {url}: {len(entries)} input_token_logprobs for a sample of {len(tokens)} tokens "
                           "(is it a /generate of SGLang's API?)")
    tail = entries[len(entries) - n:]
    if [int(e[1]) for e in tail] != tokens[len(tokens) - n:]:
        raise TeacherError(f"teacher {url}: its input_token_logprobs name other token ids than the sample's response "
                           "(does the teacher share the policy's tokenizer?)")
    return [float(e[0]) for e in tail]


async def fetch_teacher_logprobs(url: str, sample: Sample, temperature: float, timeout_s: float | None) -> list[float]:
    """POST the sample to the teacher at `url` (its /generate) and return its response tokens' log-probs."""
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s)) as client:
        r = await client.post(url, json=teacher_body(sample, temperature))
    if r.status_code != 200:
        raise TeacherError(f"teacher {url} answered {r.status_code}: {r.text[:300]}")
    return response_logprobs(r.json(), sample, url)
