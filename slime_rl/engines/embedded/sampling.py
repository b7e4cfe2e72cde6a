"""Per-request sampling parameters and the vectorised sampler of the embedded engine.

Field names and defaults follow SGLang's `SamplingParams` (python/sglang/srt/sampling/sampling_params.py,
SGLang 0.5.23): max_new_tokens=128, temperature=1.0, top_p=1.0, top_k=-1 (whole vocabulary),
min_p=0.0, stop, stop_token_ids, ignore_eos, skip_special_tokens, no_stop_trim, sampling_seed.
As in SGLang, a temperature below 1e-6 means greedy: the temperature becomes 1.0 and top_k 1, so the
log-probs of a greedy request are those of softmax(logits).

Log-prob convention (the trainer computes the same, so `train/rollout_logprob_abs_diff` is ~0): the
returned log-prob of a token is log_softmax(logits / temperature) over the FULL vocabulary, taken
before any top-p / top-k / min-p truncation. Truncation only decides which tokens can be drawn.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

_SAMPLING_EPS = 1e-6
# Sampling fields we honour; the others SGLang accepts (penalties, grammars, n>1, ...) are refused
# with a 400 naming them rather than silently ignored, so a recipe never trains on the wrong
# distribution without noticing.
SUPPORTED_FIELDS = frozenset({
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "sampling_seed", "n",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
})
# Accepted only at their neutral value.
_NEUTRAL = {"n": 1, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
            "min_new_tokens": 0}


class RequestError(ValueError):
    """A bad request: the HTTP layer answers 400 with this message (which names the field)."""


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: set[int] = field(default_factory=set)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    # SGLang's: the longest stop string in tokens (`normalize`); the stop check decodes only the last
    # stop_str_max_len + 1 output tokens
    stop_str_max_len: int = 0

    def normalize(self, tokenizer: Any) -> None:
        """SGLang's `SamplingParams.normalize` for stop strings: `stop_str_max_len`, the most tokens
        a stop string encodes to (no special tokens)."""
        self.stop_str_max_len = max((len(tokenizer.encode(s, add_special_tokens=False)) for s in self.stop), default=0)

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None, vocab_size: int) -> SamplingParams:
        """Validate SGLang's `sampling_params` dict. `None` values mean "default", as in SGLang."""
        if raw is not None and not isinstance(raw, dict):
            raise RequestError("sampling_params: expected a JSON object")
        raw = {k: v for k, v in (raw or {}).items() if v is not None}
        unknown = sorted(set(raw) - SUPPORTED_FIELDS)
        if unknown:
            raise RequestError(f"sampling_params.{unknown[0]}: not supported by the embedded engine")
        for name, neutral in _NEUTRAL.items():
            if name in raw and raw[name] != neutral:
                raise RequestError(f"sampling_params.{name}: only {neutral} is supported by the embedded engine")
        p = cls()
        p.max_new_tokens = _int(raw, "max_new_tokens", p.max_new_tokens, lo=0)
        p.temperature = _float(raw, "temperature", p.temperature, lo=0.0)
        p.top_p = _float(raw, "top_p", p.top_p, lo=0.0, hi=1.0)
        if "top_p" in raw and p.top_p <= 0.0:
            raise RequestError("sampling_params.top_p: must be in (0, 1]")
        # SGLang maps -1 to 1 << 30 (TOP_K_ALL); a larger k means the same and would overflow a tensor
        p.top_k = _int(raw, "top_k", p.top_k, lo=-1, hi=1 << 30)
        if p.top_k == 0:
            raise RequestError("sampling_params.top_k: must be -1 (all) or >= 1")
        p.min_p = _float(raw, "min_p", p.min_p, lo=0.0, hi=1.0)
        stop = raw.get("stop", [])
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError("sampling_params.stop: expected a non-empty string or a list of them")
        for s in stop:
            check_text(s, "sampling_params.stop")
        p.stop = stop
        ids = raw.get("stop_token_ids", [])
        if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
            raise RequestError(f"sampling_params.stop_token_ids: expected a list of ints in [0, {vocab_size})")
        p.stop_token_ids = set(ids)
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if name in raw:
                if not isinstance(raw[name], bool):
                    raise RequestError(f"sampling_params.{name}: expected a bool")
                setattr(p, name, raw[name])
        if "sampling_seed" in raw:
            p.sampling_seed = _int(raw, "sampling_seed", 0, lo=0, hi=(1 << 63) - 1)  # a torch generator's seed
        if p.temperature < _SAMPLING_EPS:  # SGLang: greedy is top_k=1 at temperature 1
            p.temperature, p.top_k = 1.0, 1
        return p


def check_text(text: str, name: str) -> None:
    """A JSON string may hold a lone UTF-16 surrogate ("\\ud800"): not text any tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{name}: not valid Unicode (a lone surrogate {text[e.start]!a} at character "
                           f"{e.start})") from None


def _int(raw: dict, name: str, default: int, lo: int | None = None, hi: int | None = None) -> int:
    v = raw.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f" in [{lo}, {hi}]" if hi is not None else (f" >= {lo}" if lo is not None else "")
        raise RequestError(f"sampling_params.{name}: expected an int{bounds}")
    return v


def _float(raw: dict, name: str, default: float, lo: float, hi: float | None = None) -> float:
    v = raw.get(name, default)
    if (isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < lo
            or (hi is not None and v > hi)):
        raise RequestError(f"sampling_params.{name}: expected a number in [{lo}, {hi if hi is not None else 'inf'}]")
    return float(v)


def device_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.tensor(values, dtype, device)` without a host synchronization on CUDA: the values go
    into pinned host memory and are copied asynchronously (the pinned block is not reused before
    the copy ran: the caching host allocator records the copy's stream). A plain `torch.tensor(...,
    device="cuda")` copies from pageable memory and waits for the stream, once per call."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class HostCopy:
    """A step's sampled tokens [B] (long) and their log-probs [B] on their way to the host.

    On CUDA: one non-blocking copy into pinned memory and an event recorded after it on the tensors'
    stream; `get` waits for that event only, so a step launched after this one keeps the device busy
    while the host reads this one (the overlap scheduler, engine.py). On CPU the values are already
    there: no copy, no event (the same calls, so the same scheduler logic runs)."""

    def __init__(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        both = torch.stack([tokens.double(), logprobs.double()])  # token ids < 2**53 are exact in float64
        self._event: torch.cuda.Event | None = None
        if both.device.type == "cuda":
            self._host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            self._host.copy_(both, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(both.device))
        else:
            self._host = both

    def get(self) -> tuple[list[int], list[float]]:
        if self._event is not None:
            self._event.synchronize()
        return self._host[0].long().tolist(), self._host[1].tolist()


def token_logprobs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits / T) over the full vocabulary in float32; logits [B, V], temperature [B]
    (float32: a bf16 logit is promoted inside the division, one pass instead of a copy and a pass)."""
    return torch.log_softmax(torch.div(logits, temperature[:, None].float()), dim=-1)


def log_neg_log(u: torch.Tensor, in_place: bool) -> torch.Tensor:
    """log(-log U) = -G, G the Gumbel noise of U(0, 1) draws u; U is clamped at 1e-20 first (torch's
    rand can draw 0). In place: u itself becomes the result (no [B, V] buffer more); out of place
    for torch.compile, which would otherwise write the mutation back to its input."""
    if in_place:
        return u.clamp_(min=1e-20).log_().neg_().log_()
    return u.clamp(min=1e-20).log().neg().log()


def gumbel_pick(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor | None,
                sampled: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-prob, without top-k/top-p/min-p: logits [B, V], temperature [B]
    (fp32), u [B, V] U(0, 1) draws (None: every row greedy; overwritten when run eagerly), sampled
    [B] bool (None: every row samples; False: that row is greedy and its u is not read). Returns
    (tokens [B] long, logprobs [B] fp32): the Gumbel-max draw argmax(log_softmax(x) + G),
    G = -log(-log U), x = logits / T, and log_softmax(x) at the token.

    Eagerly the [B, V] log-softmax is ATen's one fused kernel. Under torch.compile (compiled.py's
    CompiledSampler) it is never written: the log-normalizer is the same for every token of a row,
    so argmax(x + G) is the same draw, and the token's log-prob is x[token] - logsumexp(x), a few
    fused passes over [B, V] (bench/decode_step.py, 1xH200, batch 256, 152k ids: 0.37 ms; eagerly
    0.87 ms). Eagerly that form is the slower one: ATen's logsumexp is composite (1.02 ms)."""
    x = torch.div(logits, temperature[:, None])  # a bf16 logit is promoted inside the division
    compiling = torch.compiler.is_compiling()
    lse = torch.logsumexp(x, dim=-1) if compiling else None
    base = x if compiling else torch.log_softmax(x, dim=-1)
    scores = base
    if u is not None:
        # -G = log(-log U); base + G as base - (-G), bit for bit. Eagerly in place: `u` is consumed
        neg_g = log_neg_log(u, in_place=not compiling)
        if sampled is not None:
            neg_g = torch.where(sampled[:, None], neg_g, 0.0)
        scores = base - neg_g
    tokens = scores.argmax(dim=-1)
    chosen = base.gather(1, tokens[:, None]).squeeze(1)
    return tokens, chosen if lse is None else chosen - lse


def needs_truncation(p: SamplingParams, vocab_size: int) -> bool:
    """Whether top-k / top-p / min-p can remove a token (greedy, top_k=1, is handled apart)."""
    return (1 < p.top_k < vocab_size) or p.top_p < 1.0 or p.min_p > 0.0


def sample(logprobs: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           default_generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row from the temperature-scaled distribution truncated by top-k/top-p/min-p:
    `SamplerPlan(params, generators, V, device).sample(logprobs, default_generator)`."""
    return SamplerPlan(params, generators, logprobs.shape[1], logprobs.device).sample(logprobs, default_generator)


class SamplerPlan:
    """What the sampler decides on the host from the rows' parameters, and the per-row tensors it
    needs, built once for a batch of rows (the engine keeps it while its rows stay the same, so a
    decode step does not rebuild and upload them).

    params: each row's request parameters; generators: a row's own generator (a request with
    `sampling_seed`: the same tokens whatever batch it lands in) or None (the `default_generator` of
    `sample`). Cost per step is what the requests ask for:
    - greedy rows (top_k 1): argmax, no noise drawn;
    - the others: Gumbel-max in vocabulary order, argmax(log p + G) with G = -log(-log U), which is
      a draw from p; rows without their own generator share one [n, V] draw;
    - only rows that truncate are sorted (the top-k/top-p/min-p mask is built in sorted order and
      scattered back to vocabulary order), so plain temperature sampling never sorts the vocabulary.
    Because the noise is indexed by token id in every case, a row draws the same token whether or
    not its neighbours needed the sort. Every tensor is built here, before any noise is drawn: a
    row whose parameters break it fails before any generator advanced.
    """

    def __init__(self, params: list[SamplingParams], generators: list[torch.Generator | None], vocab_size: int,
                 device: torch.device) -> None:
        self.rows, self.vocab_size = len(params), vocab_size
        self.temperature = device_tensor([p.temperature for p in params], torch.float32, device)
        greedy = [p.top_k == 1 for p in params]
        self.all_greedy = all(greedy)
        self.greedy = device_tensor(greedy, torch.bool, device) if any(greedy) and not self.all_greedy else None
        self.sampled = ~self.greedy if self.greedy is not None else None  # gumbel_pick's mask
        trunc = [i for i, p in enumerate(params) if not greedy[i] and needs_truncation(p, vocab_size)]
        self.trunc: tuple[torch.Tensor, ...] | None = None
        if trunc:
            self.trunc = (device_tensor(trunc, torch.long, device),
                          device_tensor([params[i].top_k for i in trunc], torch.long, device),
                          device_tensor([params[i].top_p for i in trunc], torch.float32, device),
                          device_tensor([params[i].min_p for i in trunc], torch.float32, device))
        shared = [i for i in range(len(params)) if not greedy[i] and generators[i] is None]
        self.all_shared = len(shared) == len(params)
        self.shared = device_tensor(shared, torch.long, device) if shared and not self.all_shared else None
        self.own = [(i, g) for i, g in enumerate(generators) if not greedy[i] and g is not None]

    def draw(self, logits: torch.Tensor, default_generator: torch.Generator,
             pick: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [B] (long) and their log-probs [B] (fp32, at the rows' temperatures) from the
        logits [B, V]. Rows that truncate go through `token_logprobs` and `sample`; otherwise
        `gumbel_pick` does it (the same formula; `pick`: a compiled `gumbel_pick`, which does not write
        the [B, V] log-softmax: --enable-torch-compile), from the uniform draws `uniform` makes."""
        if self.trunc is not None:
            logprobs = token_logprobs(logits, self.temperature)
            tokens = self.sample(logprobs, default_generator)
            return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)
        assert logits.shape == (self.rows, self.vocab_size), "a plan samples the batch it was built for"
        u = None if self.all_greedy else self.uniform(logits.device, default_generator)
        return (pick or gumbel_pick)(logits, self.temperature, u, self.sampled)

    def uniform(self, dev: torch.device, default_generator: torch.Generator) -> torch.Tensor:
        """U(0, 1) draws [B, V] in fp32 for the rows that sample: the shared ones from one draw of the
        default generator, a row with its own generator from it (greedy rows: left unset)."""
        B, V = self.rows, self.vocab_size
        noise = torch.empty((B, V), device=dev, dtype=torch.float32)
        if self.all_shared:
            torch.rand((B, V), generator=default_generator, device=dev, out=noise)
        elif self.shared is not None:
            noise[self.shared] = torch.rand((len(self.shared), V), generator=default_generator, device=dev)
        for i, g in self.own:
            noise[i] = torch.rand(V, generator=g, device=dev)
        return noise

    def sample(self, logprobs: torch.Tensor, default_generator: torch.Generator) -> torch.Tensor:
        """Token ids [B] (long) from logprobs [B, V] (`token_logprobs` with `self.temperature`)."""
        B, V = logprobs.shape
        assert (B, V) == (self.rows, self.vocab_size), "a plan samples the batch it was built for"
        dev = logprobs.device
        if self.all_greedy:
            return logprobs.argmax(dim=-1)
        scores = logprobs
        if self.trunc is not None:
            idx, top_k, top_p, min_p = self.trunc
            sub = logprobs.index_select(0, idx)
            sorted_lp, order = sub.sort(dim=-1, descending=True)
            sorted_p = sorted_lp.exp()
            rank = torch.arange(V, device=dev).expand(len(idx), V)
            k = torch.where(top_k < 1, torch.full_like(top_k, V), top_k.clamp(max=V))
            drop = rank >= k[:, None]
            # top-p: keep the smallest prefix whose mass reaches top_p (the first token is always kept)
            mass_before = sorted_p.cumsum(dim=-1) - sorted_p
            drop |= mass_before > top_p[:, None]
            drop |= sorted_p < (min_p[:, None] * sorted_p[:, :1])
            drop[:, 0] = False
            drop_vocab = torch.zeros_like(drop).scatter_(1, order, drop)  # back to token-id order
            scores = logprobs.index_copy(0, idx, sub.masked_fill(drop_vocab, float("-inf")))
        noise = self.uniform(dev, default_generator)
        # Gumbel noise is -log(-log U); scores + gumbel is computed as scores - log(-log U), equal to
        # it bit for bit (IEEE a + (-b) == a - b) and one pass over [B, V] less
        neg_gumbel = log_neg_log(noise, in_place=True)
        pick = torch.argmax(scores - neg_gumbel, dim=-1)
        if self.greedy is not None:
            pick = torch.where(self.greedy, logprobs.argmax(dim=-1), pick)
        return pick
