"""Malformed `/generate` requests drawn from SGLang's GenerateReqInput / SamplingParams schema (the fields
the built-in engine reads, protocol.py and sampling.py): each draw breaks one thing -- a field of the
wrong type, a number out of its range, a missing or doubled field, an unsupported field, a huge, deep
or garbled body, a bad key, a bad method -- so that every draw must be refused with a 4xx.

The invalid values per field are written from SGLang's rules (sampling_params.py `verify`, io_struct.py),
not taken from the engine's checks."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

VOCAB = 64  # tools/make_tiny_model.py's vocabulary

# sampling_params field -> values SGLang refuses (type or range)
BAD_SAMPLING = {
    "max_new_tokens": [-1, "8", 1.5, [8], True, {"n": 1}],
    "temperature": [-0.1, "1", float("nan"), float("inf"), [1.0], True],
    "top_p": [0, 0.0, 1.5, -1, float("nan"), "0.9"],
    "top_k": [0, -2, (1 << 30) + 1, 10**30, 1.5, "5", False],
    "min_p": [-0.1, 1.5, float("nan"), "0"],
    "stop": [5, [""], [1], {"a": 1}, [None]],
    "stop_token_ids": [[-1], [VOCAB], "3", [1.5], 7],
    "ignore_eos": ["yes", 1, [True]],
    "skip_special_tokens": ["no", 0],
    "sampling_seed": [-1, 2**64, "7", 1.5, [1]],
    "n": [2, 8],  # n > 1: the engine answers one sample per prompt and says so
    "frequency_penalty": [0.5], "presence_penalty": [1.0], "repetition_penalty": [1.2], "min_new_tokens": [3],
    "json_schema": ["{}"], "regex": ["a+"], "no_such_field": [1],
}
# top-level field -> values refused
BAD_TOP = {
    "input_ids": [[], [-1], [VOCAB], [1.5], "abc", [[]], [[1], [-1]], [True], [[1, 2], "x"], {"a": 1}, 3],
    "text": ["", 5, [""], [1], {"t": "x"}],
    "sampling_params": ["x", [1], 5, True],
    "return_logprob": ["yes", 1, [1, 2, 3]],
    "logprob_start_len": ["1", 1.5, 100],
    "rid": [5, "", [1]],
    "stream": [True],
    "top_logprobs_num": [3],
    "image_data": ["http://127.0.0.1:1/x.png"],
    "lora_path": ["adapter"],
    "return_hidden_states": [True],
}


@dataclass
class Bad:
    kind: str
    body: bytes
    headers: dict[str, str]
    method: str = "POST"
    path: str = "/generate"


def _good_body(rng: random.Random) -> dict:
    return {"input_ids": [rng.randrange(61) for _ in range(rng.randint(1, 8))],
            "sampling_params": {"max_new_tokens": rng.randint(1, 4), "temperature": rng.choice([0.0, 0.7, 1.0])}}


def draw(rng: random.Random, key: str, max_request_bytes: int) -> Bad:
    """One malformed request (with the right key unless the draw breaks the key)."""
    auth = {"Authorization": f"Bearer {key}"}
    kind = rng.choice(["sampling", "sampling", "sampling", "top", "top", "top", "missing", "both", "not_object",
                       "garbled", "truncated", "deep", "huge", "bad_key", "no_key", "method", "batch_mismatch"])
    body = _good_body(rng)
    if kind == "sampling":
        name = rng.choice(sorted(BAD_SAMPLING))
        body["sampling_params"][name] = rng.choice(BAD_SAMPLING[name])
        kind = f"sampling_params.{name}"
    elif kind == "top":
        name = rng.choice(sorted(BAD_TOP))
        value = rng.choice(BAD_TOP[name])
        if name == "text":
            body.pop("input_ids")
        body[name] = value
        kind = name
    elif kind == "missing":
        body.pop("input_ids")
    elif kind == "both":
        body["text"] = "hello"
    elif kind == "batch_mismatch":  # a batch of 2 prompts with 3 sampling_params
        body["input_ids"] = [[1, 2], [3, 4]]
        body["sampling_params"] = [{"max_new_tokens": 1}] * 3
    if kind == "not_object":
        raw = json.dumps(rng.choice([[1, 2], 5, "text", None, True])).encode()
    elif kind == "garbled":
        raw = bytes(rng.randrange(256) for _ in range(rng.randint(1, 200)))
        raw = b"\xff" + raw  # never valid UTF-8 JSON
    elif kind == "truncated":
        full = json.dumps(body).encode()
        raw = full[:rng.randint(1, len(full) - 1)]
    elif kind == "deep":
        depth = rng.choice([2_000, 50_000])
        raw = b'{"input_ids": ' + b"[" * depth + b"]" * depth + b"}"
    elif kind == "huge":
        raw = b'{"text": "' + b"a" * (max_request_bytes + rng.randint(1, 4096)) + b'"}'
    else:
        raw = json.dumps(body).encode()  # NaN/Infinity written bare, as another language's client might
    if kind == "bad_key":
        auth = {"Authorization": rng.choice([f"Bearer {key}x", "Bearer wrong", f"Basic {key}", key])}
    elif kind == "no_key":
        auth = {}
    method = rng.choice(["DELETE", "PATCH"]) if kind == "method" else "POST"
    return Bad(kind, raw, auth, method)


def good_requests(n: int) -> list[dict]:
    """Requests whose answers are fixed by their seeds (own generator per request), so a run under fuzz
    must give the tokens of a quiet run."""
    out = []
    for i in range(n):
        out.append({"input_ids": [(7 * j + 11 * i + 5) % 61 for j in range(4 + i % 5)], "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, "temperature": [1.0, 0.7][i % 2],
                                        "top_p": [1.0, 0.9][i % 2], "sampling_seed": 1000 + i}})
    return out
