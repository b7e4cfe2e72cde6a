"""Tool calls in a model turn, in OpenAI's shape.

Qwen2.5/Qwen3 and Hermes-style templates have the model write each call as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; SGLang's `qwen25` / `hermes` tool-call
parsers read that syntax, and so does `parse_tool_calls`. The text before the first call is the message's
content. A block whose JSON does not parse, or has no string `name`, stays in the content (a model turn
is never lost to a parse).
"""

from __future__ import annotations

import json
import re
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str, call_id_prefix: str = "call") -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a model turn's text: OpenAI's `message.content` (None when only calls were
    written) and `message.tool_calls` (`{"id", "type": "function", "function": {"name", "arguments"}}` with
    `arguments` a JSON string, as OpenAI sends it)."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for m in TOOL_CALL.finditer(text):
        call = _call(m.group(1))
        if call is None:
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        name, arguments = call
        calls.append({"id": f"{call_id_prefix}_{len(calls)}", "type": "function",
                      "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
    if not calls:
        return text, []
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return (content or None), calls


def _call(body: str) -> tuple[str, Any] | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return obj["name"], arguments


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates take them: an assistant's tool-call `arguments` given as a JSON string
    (OpenAI's wire form) become the object (templates render them with `tojson`), as SGLang's and vLLM's
    chat serving do; a `content` of None becomes ''."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                c = dict(c)
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        pass
                c["function"] = fn
                calls.append(c)
            m["tool_calls"] = calls
        out.append(m)
    return out
