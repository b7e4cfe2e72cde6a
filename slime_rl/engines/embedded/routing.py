"""Routed experts of a Qwen-MoE, GLM-4.5 or MiniMax-M2 model in the built-in engine: SGLang's
`--enable-return-routed-experts`.

SGLang 0.5.23 (state_capturer/routed_experts.py, managers/scheduler_components/batch_result_processor.py,
managers/tokenizer_manager.py): with the server flag, a request's `return_routed_experts` answers
`meta_info["routed_experts"]`, the base64 of an int32 array [tokens, num_hidden_layers, top_k] holding
each MoE layer's top-k expert ids for the positions `[routed_experts_start_len, seqlen - 1)` of
prompt + output (the last output token was never fed to the model). Without the server flag SGLang
captures nothing and the key is absent (no error); a start outside [0, prompt tokens] aborts the
request naming `routed_experts_start_len`.

Here every `mlp.gate` (transformers' Qwen3MoeTopKRouter) gets a forward that records its
`router_indices` per forward. Its values are the router's own: softmax of the logits, top-k,
renormalised under `norm_topk_prob`. `select_round` (test and measurement only, never set by a run)
chooses the experts from the router logits rounded to that dtype (bf16: the routing of a bf16
engine) while the weights still come from the fp32 probabilities of the chosen experts, so a test
can force routing flips without changing anything else. The tiny test model's router (std 0.1) keeps
its choices far from ties: bf16 rounding flipped none of 192 (token, layer) choices, fp8 e5m2 (two
mantissa bits) 3-10 % of them, so the tests use fp8_e5m2.

A GLM-4.5 router (transformers' Glm4MoeTopkRouter: sigmoid scores plus e_score_correction_bias, groups,
routed_scaling_factor) keeps transformers' own forward and only records its choice (no select_round); so does
MiniMax-M2's (MiniMaxM2TopKRouter: sigmoid scores plus the MoE block's e_score_correction_bias, which its block
passes in).
"""

from __future__ import annotations

import base64
import re
import types

import numpy as np
import torch
import torch.nn.functional as F

from slime_rl.engines.payloads import decode_routed_experts  # noqa: F401 (the engine's half lives here too)

_GATE = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")
ROUND_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn,
                "fp8_e5m2": torch.float8_e5m2}


def _router_forward(capture: RoutingCapture, layer: int):
    def forward(self, hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(hidden_states, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if capture.select_round is None:
            top, idx = torch.topk(probs, self.top_k, dim=-1)
        else:
            # softmax is monotone: the top-k of the rounded logits is that of their probabilities
            _, idx = torch.topk(logits.to(capture.select_round).float(), self.top_k, dim=-1)
            top = probs.gather(-1, idx)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        capture.record(layer, idx)
        return logits, top.to(logits.dtype), idx

    return forward


def _recording_forward(capture: RoutingCapture, layer: int, inner):
    """A DeepSeek-style router (transformers' Glm4MoeTopkRouter: sigmoid scores, e_score_correction_bias,
    groups, routed_scaling_factor) keeps its own forward; its chosen experts are recorded."""
    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):  # MiniMax-M2's block passes its bias
        logits, weights, idx = inner(hidden_states, *args, **kwargs)
        capture.record(layer, idx)
        return logits, weights, idx

    return forward


class RoutingCapture:
    """Installs the recording forward on every MoE router of `model`; `take` returns what the last
    forward routed. Only the scheduler thread forwards (under the engine's model lock)."""

    def __init__(self, model: torch.nn.Module, select_round: str | None = None) -> None:
        text = model.config.get_text_config()
        self.num_layers = int(text.num_hidden_layers)
        self.top_k = int(text.num_experts_per_tok)
        if select_round is not None and select_round not in ROUND_DTYPES:
            raise ValueError(f"routing select_round {select_round!r}: expected one of {sorted(ROUND_DTYPES)}")
        self.select_round = ROUND_DTYPES.get(select_round) if select_round else None
        self._cur: dict[int, torch.Tensor] = {}
        self.keep = True  # False: route (select_round) but answer no experts (no server flag)
        self.layers: list[int] = []
        for name, mod in model.named_modules():
            m = _GATE.search(name)
            minimax = type(mod).__name__ == "MiniMaxM2TopKRouter"  # sigmoid; the bias is its block's
            if m and hasattr(mod, "top_k") and hasattr(mod, "weight") and (hasattr(mod, "norm_topk_prob") or minimax):
                layer = int(m.group(1))
                if hasattr(mod, "e_score_correction_bias") or minimax:
                    if self.select_round is not None:
                        raise ValueError(f"routing select_round {select_round!r}: only for softmax routers "
                                         f"(Qwen-MoE), not {type(mod).__name__}")
                    mod.forward = types.MethodType(_recording_forward(self, layer, mod.forward), mod)
                else:
                    mod.forward = types.MethodType(_router_forward(self, layer), mod)
                self.layers.append(layer)
        if not self.layers:
            raise ValueError(f"--enable-return-routed-experts: {type(model).__name__} has no MoE router "
                             "(Qwen-MoE, GLM-4.5, DeepSeek-V3 and MiniMax-M2 models only)")

    def record(self, layer: int, idx: torch.Tensor) -> None:
        self._cur[layer] = idx

    def take(self, batch: int, seq: int) -> torch.Tensor:
        """[batch, seq, num_layers, top_k] int32 on the host: the last forward's routing (layers
        without a router stay 0) ; clears it."""
        out = torch.zeros(batch, seq, self.num_layers, self.top_k, dtype=torch.int32)
        for layer, idx in self._cur.items():
            out[:, :, layer] = idx.reshape(batch, seq, self.top_k).to("cpu", torch.int32)
        self._cur = {}
        return out


def encode_routed_experts(rows: torch.Tensor) -> str:
    """SGLang's wire form: base64 of the int32 array's bytes (C order, native byte order)."""
    return base64.b64encode(np.ascontiguousarray(rows.numpy().astype(np.int32)).tobytes()).decode("ascii")
