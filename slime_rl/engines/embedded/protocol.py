"""SGLang's `/generate` wire format for the embedded engine: request parsing and response building.

Request fields are those of SGLang's `GenerateReqInput` (python/sglang/srt/managers/io_struct.py,
SGLang 0.5.23); the response follows tokenizer_manager.py: {"text", "output_ids", "meta_info": {"id",
"finish_reason", "prompt_tokens", "weight_version", "num_retractions", "completion_tokens",
"cached_tokens", "reasoning_tokens", ...}}, and with `return_logprob` also "input_token_logprobs",
"output_token_logprobs" (lists of [logprob, token_id, text or None]) and
"output_token_logprobs_length". A batch request (list of prompts) answers a list of such dicts.
`output_ids` keep a matched stop token (and its log-prob); only `text` is trimmed, as SGLang's
detokenizer does (trim_matched_stop).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from slime_rl.engines.embedded.request import GenRequest
from slime_rl.engines.embedded.routing import encode_routed_experts
from slime_rl.engines.embedded.sampling import RequestError, SamplingParams, check_text
from slime_rl.engines.embedded.vision import VisionInputs, per_request_images

# GenerateReqInput fields the embedded engine acts on. Any other GenerateReqInput field is accepted
# at its neutral value (None/False/0/empty) and refused otherwise, naming it.
HANDLED = frozenset({
    "text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "return_text_in_logprobs",
    "stream", "rid", "log_metrics", "top_logprobs_num", "image_data", "return_routed_experts",
    "routed_experts_start_len", "lora_path",  # lora_path: checked by the server (adapters.py)
})


def parse_generate(body: Any, tokenizer, vocab_size: int, context_len: int,
                   next_rid, vision: VisionInputs | None = None) -> tuple[list[GenRequest], bool]:
    """Validate a /generate body; returns the requests and whether it was a batch request.

    `vision` (a vision-language model) turns `image_data` into pixel inputs; without it image_data
    is refused."""
    if not isinstance(body, dict):
        raise RequestError("body: expected a JSON object (SGLang's GenerateReqInput)")
    for name, value in body.items():
        if name not in HANDLED and value not in (None, False, 0, [], {}, ""):
            raise RequestError(f"{name}: not supported by the embedded engine")
    if body.get("stream"):
        raise RequestError("stream: streaming is not supported by the embedded engine; send stream=false")
    if body.get("top_logprobs_num"):
        raise RequestError("top_logprobs_num: top log-probs are not supported by the embedded engine")
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise RequestError("text, input_ids: give exactly one of them")
    if input_ids is not None:
        is_batch = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if is_batch else [input_ids]
        for p in prompts:  # the length first: a prompt of millions of ids is refused before they are checked
            if isinstance(p, list) and len(p) >= context_len:
                raise RequestError(f"input_ids: the prompt has {len(p):,} tokens; the context length is "
                                   f"{context_len:,}")
        for p in prompts:
            if not isinstance(p, list) or not p or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in p):
                raise RequestError(f"input_ids: expected a non-empty list (or list of lists) of ints in "
                                   f"[0, {vocab_size})")
    else:
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not texts or not all(isinstance(t, str) and t for t in texts):
            raise RequestError("text: expected a non-empty string or a list of them")
        for t in texts:
            check_text(t, "text")
        prompts = [tokenizer.encode(t) for t in texts]
    n = len(prompts)
    sps = _per_item(body.get("sampling_params"), n, is_batch, "sampling_params", (dict,))
    lps = _per_item(body.get("return_logprob"), n, is_batch, "return_logprob", (bool,))
    starts = _per_item(body.get("logprob_start_len"), n, is_batch, "logprob_start_len", (int,))
    rids = _rids(body.get("rid"), n, is_batch, next_rid)
    # SGLang takes one value of each for the whole batch (GenerateReqInput.__getitem__ copies them)
    want_routed = body.get("return_routed_experts") or False
    routed_start = body.get("routed_experts_start_len") or 0
    if not isinstance(want_routed, bool):
        raise RequestError("return_routed_experts: expected a bool")
    if not isinstance(routed_start, int) or isinstance(routed_start, bool):
        raise RequestError("routed_experts_start_len: expected an int")
    images = per_request_images(body.get("image_data"), n, is_batch)
    if vision is None and any(images):
        raise RequestError("image_data: this model has no vision tower")
    reqs = []
    for i, prompt in enumerate(prompts):
        pixels = grids = None
        if vision is not None:
            prompt, pixels, grids = vision.prepare(list(prompt), images[i])
        if len(prompt) >= context_len:
            raise RequestError(f"input_ids: the prompt has {len(prompt)} tokens; the context length is "
                               f"{context_len}")
        params = SamplingParams.from_json(sps[i], vocab_size)
        # As SGLang, cap the output so prompt + output fits the context.
        params.max_new_tokens = min(params.max_new_tokens, context_len - len(prompt))
        if want_routed and not 0 <= routed_start <= len(prompt):
            # SGLang's scheduler aborts such a request with this message (400)
            raise RequestError(f"routed_experts_start_len={routed_start} must be in [0, {len(prompt)}] "
                               "(the number of input tokens)")
        start = -1 if starts[i] is None else starts[i]
        if start >= len(prompt):
            raise RequestError(f"logprob_start_len: {start} is not below the prompt length {len(prompt)}")
        reqs.append(GenRequest(rid=rids[i], input_ids=list(prompt), params=params,
                               return_logprob=bool(lps[i]), logprob_start_len=start, pixel_values=pixels,
                               image_grid_thw=grids, return_routed_experts=want_routed,
                               routed_experts_start_len=routed_start))
    return reqs, is_batch


def _per_item(value: Any, n: int, is_batch: bool, name: str, types: tuple) -> list:
    if is_batch and isinstance(value, list):
        if len(value) != n:
            raise RequestError(f"{name}: the batch has {n} prompts but {len(value)} values")
        items = value
    else:
        items = [value] * n
    for v in items:
        if v is not None and (not isinstance(v, types) or (bool not in types and isinstance(v, bool))):
            raise RequestError(f"{name}: expected {' or '.join(t.__name__ for t in types)}")
    return items


def _rids(rid: Any, n: int, is_batch: bool, next_rid) -> list[str]:
    if rid is None:
        return [next_rid() for _ in range(n)]
    if is_batch and isinstance(rid, list):
        if len(rid) != n or not all(isinstance(r, str) and r for r in rid):
            raise RequestError(f"rid: expected {n} non-empty strings")
        return rid
    if not isinstance(rid, str) or not rid:
        raise RequestError("rid: expected a non-empty string")
    return [f"{rid}_{i}" for i in range(n)] if is_batch else [rid]


def seed_generator(req: GenRequest, device: torch.device) -> None:
    """A request with `sampling_seed` draws from its own generator: same seed, same tokens, any batch."""
    if req.params.sampling_seed is not None:
        req.generator = torch.Generator(device=device).manual_seed(req.params.sampling_seed)


def build_response(req: GenRequest, tokenizer, weight_version: str, text_in_logprobs: bool) -> dict:
    p, reason = req.params, req.finish_reason or {}
    ids = req.output_ids
    matched = reason.get("matched")
    if isinstance(matched, int) and not p.no_stop_trim and ids:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
    if isinstance(matched, str):
        pos = text.find(matched)
        if pos >= 0:
            text = text[:pos + len(matched)] if p.no_stop_trim else text[:pos]
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": len(req.input_ids),
        "weight_version": weight_version,
        "num_retractions": req.retractions,
        "completion_tokens": len(req.output_ids),
        "cached_tokens": 0,
        "reasoning_tokens": 0,
        "e2e_latency": max(0.0, req.finished_at - req.created) if req.finished_at else time.monotonic() - req.created,
    }
    if req.return_logprob:
        def entries(vals: list, toks: list[int]) -> list:
            texts = [tokenizer.decode([t]) for t in toks] if text_in_logprobs else [None] * len(toks)
            return [[v, t, s] for v, t, s in zip(vals, toks, texts, strict=True)]

        start = max(req.logprob_start_len, 0)
        meta["input_token_logprobs"] = entries(req.input_logprobs, req.input_ids[start:]) \
            if req.logprob_start_len >= 0 else []
        meta["output_token_logprobs"] = entries(req.output_logprobs, req.output_ids)
        meta["output_token_logprobs_length"] = len(req.output_ids)
    if req.return_routed_experts and req.routed:
        # positions [start, seqlen - 1) of prompt + output; absent without the server flag (no capture)
        rows = torch.cat(req.routed)[: len(req.input_ids) + len(req.output_ids) - 1]
        meta["routed_experts"] = encode_routed_experts(rows[req.routed_experts_start_len:])
    return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}
