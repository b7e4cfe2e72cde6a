"""A calculator tool environment: an example of `--custom-generate-function-path`.

    --custom-generate-function-path slime_rl.rollout.examples.calculator.generate

The model may write `<calc>EXPR</calc>`; generation stops at `</calc>` (a stop string), the
environment evaluates EXPR (integer + - * / and parentheses only, no names, no calls) and appends
`<result>VALUE</result>` as environment tokens (loss_mask 0, log-prob 0.0), then generation
continues from prompt + everything so far. Up to MAX_TOOL_CALLS calls; the response budget
(`max_new_tokens`) covers model and environment tokens together, as the trainer sees both.

Tokens are appended, never re-tokenised: the model's tokens stay exactly what it sampled (and what
its log-probs refer to), the result text is encoded on its own.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

from slime_rl.data import Sample
from slime_rl.rollout.partial import COMPLETED, append_env_tokens, append_model_turn, mark_truncated, status
from slime_rl.rollout.routing import ClientPool

CALL_CLOSE = "</calc>"
CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
MAX_TOOL_CALLS = 4
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Div: operator.truediv}


def calculate(expr: str) -> str:
    """Value of an arithmetic expression, or "error"; never evaluates anything but numbers and + - * /."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("not arithmetic")

    try:
        result = value(ast.parse(expr.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return "error"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def pending_call(turn_text: str, finish: Any) -> str | None:
    """The expression of the call that ended this model turn, if the turn stopped on `</calc>`."""
    if not (isinstance(finish, dict) and finish.get("type") == "stop" and finish.get("matched") == CALL_CLOSE):
        return None
    calls = CALL.findall(turn_text)
    return calls[-1] if calls else None


async def generate(sample: Sample, sampling_params: dict[str, Any], client_pool: ClientPool) -> Sample:
    tok = client_pool.tokenizer
    budget_total = sampling_params["max_new_tokens"]
    params = dict(sampling_params)
    params["stop"] = list(params.get("stop") or []) + [CALL_CLOSE]
    # SGLang trims the matched stop string from `text` only; output_ids keep its tokens, which is what
    # we append, so the call the model wrote stays in its context.
    for _ in range(MAX_TOOL_CALLS + 1):
        budget = client_pool.budget(sample, budget_total)
        if budget <= 0:
            mark_truncated(sample)
            break
        out = await client_pool.generate(sample, sample.prompt_ids + sample.response_ids,
                                         {**params, "max_new_tokens": budget})
        turn = append_model_turn(sample, out, tok)
        if status(sample) != COMPLETED:  # cut (abort) or out of budget: nothing more this call
            break
        expr = pending_call(tok.decode(turn, skip_special_tokens=True), out["meta_info"].get("finish_reason"))
        if expr is None:
            break
        result = tok.encode(f"<result>{calculate(expr)}</result>", add_special_tokens=False)
        room = client_pool.budget(sample, budget_total, count=False)
        append_env_tokens(sample, result[:room], tok)
        sample.metadata["tool_calls"] = sample.metadata.get("tool_calls", 0) + 1
        if len(result) > room:
            mark_truncated(sample)
            break
    return sample
