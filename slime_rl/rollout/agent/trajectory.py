"""One agent trajectory as one training sample, token for token.

An agent speaks OpenAI's chat API; the engine speaks token ids. `Trajectory.chat` answers one
`/v1/chat/completions` body and keeps the sample exact:

- the first request's messages, rendered by the model's chat template with the generation prompt, are
  the sample's prompt ids;
- each answer's tokens are the engine's sampled ids, appended as they came (loss mask 1, the engine's
  log-probs, the weight version), never decoded and encoded again;
- a later request must extend the conversation: the messages of the previous request, then the assistant
  message this trajectory answered (as the harness echoes it: content, tool calls), then new messages
  (tool results, a user turn). Only the new part is tokenized: the template's end-of-turn text after the
  sampled tokens (e.g. Qwen's `\\n` after a sampled `<|im_end|>`, or the whole `<|im_end|>\\n` when the
  turn stopped on a stop string or the budget) and the template's rendering of the new messages with the
  generation prompt, taken as the difference of two renderings; appended as environment tokens (loss
  mask 0, log-prob 0.0).
- Anything else (an edited or dropped message, other tools, a template whose rendering of the longer
  conversation does not start with the shorter one's, e.g. one that strips earlier reasoning) **branches**
  the trajectory: the sample stays as it was before that request (what it holds is exact and is trained),
  the request and later ones are answered from the full rendering without being recorded, and
  `metadata["agent_branched"]` says so (metric `rollout/agent_branched_frac`).

The response budget (--rollout-max-response-len) covers model and environment tokens, as the trainer sees
both; past it the answer is `finish_reason: "length"` with no content and the sample is truncated.
"""

from __future__ import annotations

import asyncio
import time
from functools import lru_cache
from typing import Any

from slime_rl.data import Sample
from slime_rl.rollout.agent.toolcalls import parse_tool_calls, template_messages
from slime_rl.rollout.partial import (
    ABORTED,
    STATUS,
    VERSIONS,
    append_env_tokens,
    append_model_turn,
    mark_truncated,
    status,
)
from slime_rl.rollout.routing import ClientPool

_PROBE = "q7Zx"  # a probe message's content: text no template adds by itself


class RequestError(ValueError):
    """A request this trajectory cannot answer (OpenAI's 400 `invalid_request_error`), naming the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class TrajectoryClosed(RuntimeError):
    """A request for a trajectory whose agent run is over (OpenAI's 404)."""


class RolloutCut(RuntimeError):
    """The rollout stopped this trajectory's request (the step's batch is full, or a weight update's pause
    with partial rollout off): the agent's request fails; the trajectory is not trained."""


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None, generation_prompt: bool,
           template_kwargs: dict[str, Any] | None = None) -> str:
    kwargs = dict(template_kwargs or {})
    if tools:
        kwargs["tools"] = tools
    return tokenizer.apply_chat_template(template_messages(messages), tokenize=False,
                                         add_generation_prompt=generation_prompt, **kwargs)


@lru_cache(maxsize=8)
def _turn_end(tokenizer: Any) -> str:
    """The text the chat template writes after an assistant message's content (Qwen: `<|im_end|>\\n`)."""
    user = [{"role": "user", "content": _PROBE}]
    asked = render(tokenizer, user, None, True)
    answered = render(tokenizer, user + [{"role": "assistant", "content": _PROBE}], None, False)
    if not answered.startswith(asked) or _PROBE not in answered[len(asked):]:
        raise RequestError("the model's chat template renders an assistant message in a way this endpoint cannot "
                           "follow (the conversation with the answer does not start with the prompt it answered)")
    rest = answered[len(asked):]
    return rest[rest.index(_PROBE) + len(_PROBE):]


def _same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether the harness sent back message `a` as this trajectory knows it (`b`): role, content (None and
    '' alike), name, tool_call_id, and tool calls by name and (parsed) arguments."""
    ta, tb = template_messages([a])[0], template_messages([b])[0]
    if ta.get("role") != tb.get("role") or ta.get("content") != tb.get("content"):
        return False
    if ta.get("tool_call_id") != tb.get("tool_call_id") or ta.get("name") != tb.get("name"):
        return False

    def calls(m: dict[str, Any]) -> list[tuple[Any, Any]]:
        return [((c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments"))
                for c in m.get("tool_calls") or []]
    return calls(ta) == calls(tb)


def _plain(message: Any) -> dict[str, Any]:
    """A message as a dict of its non-None fields (a harness may send SDK objects' dumps with extra nulls)."""
    if not isinstance(message, dict):
        raise RequestError("each message must be an object", "messages")
    return {k: v for k, v in message.items() if v is not None or k == "content"}


class Trajectory:
    """The sample one agent run fills; `chat` runs on the rollout's event loop, one request at a time."""

    def __init__(self, sample: Sample, sampling_params: dict[str, Any], pool: ClientPool,
                 template_kwargs: dict[str, Any] | None = None) -> None:
        self.sample, self.params, self.pool = sample, dict(sampling_params), pool
        self.tok = pool.tokenizer
        self.template_kwargs = template_kwargs
        self.budget_total = int(sampling_params["max_new_tokens"])
        self.messages: list[dict[str, Any]] | None = None  # the last request's, then the answer we gave
        self.tools: list[dict] | None = None
        self.last_turn: list[int] = []
        self.turns = 0
        self.tool_calls = 0
        self.branched = False
        self.exhausted = False  # the response budget is spent: every later answer is "length"
        self.cut = False  # the rollout aborted a request: the sample is ABORTED, whatever the agent does next
        self.closed = False  # the agent run is over (it returned, failed or timed out): no request is recorded
        self._serving: asyncio.Task | None = None  # the task answering the current request
        self._lock = asyncio.Lock()
        self._ids = 0
        self.key = ""  # set by the endpoint that serves it
        # /v1/completions: the last request's prompt and the answer's text (a text prompt must extend it), and
        # whether this trajectory speaks that API (one trajectory uses one of the two)
        self.completion_text: str | None = None
        self.completions = False

    # ---- the request ----
    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        async with self._lock:
            return await self._serve(self._chat, body)

    async def _serve(self, method: Any, body: dict[str, Any]) -> dict[str, Any]:
        if self.closed:
            raise TrajectoryClosed("this trajectory is finished (its agent run returned or timed out)")
        self._serving = asyncio.current_task()
        try:
            return await method(body)
        finally:
            self._serving = None

    def close(self) -> None:
        """The agent run is over: a request being answered is cancelled (its engine request aborted; the sample
        keeps nothing of it) and later ones are refused."""
        self.closed = True
        if self._serving is not None and self._serving is not asyncio.current_task():
            self._serving.cancel()

    async def _chat(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.cut:
            raise RolloutCut("the rollout stopped this trajectory (its step is complete)")
        if self.completions:
            raise RequestError("this trajectory speaks /v1/completions: one trajectory uses one of the two APIs",
                               "messages")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list", "messages")
        messages = [_plain(m) for m in messages]
        if body.get("n", 1) != 1:
            raise RequestError("only n=1 is served (one trajectory is one sample)", "n")
        tools = body.get("tools") or None
        text = render(self.tok, messages, tools, True, self.template_kwargs)
        if self.messages is None:
            self._begin(text, self.tok.encode(text, add_special_tokens=False))
            self.sample.metadata["agent_messages"] = len(messages)
        elif not self.branched:
            new = self._extension(messages, tools, text)
            if new is None:
                self._branch()
            else:
                self._add_env(new)
        if self.branched:
            return self._answer(body, *await self._untracked(body, self.tok.encode(text, add_special_tokens=False)))
        turn = await self._turn(body)
        if turn is None:  # nothing more fits: the sample ends here, truncated
            self.messages = messages + [{"role": "assistant", "content": ""}]
            self.tools = tools
            self.last_turn = []
            return self._answer(body, [], "", {"type": "length"}, self.sample.tokens)
        answer = self._answer(body, *turn)
        message = answer["choices"][0]["message"]
        self.messages = messages + [{k: v for k, v in message.items() if k in ("role", "content", "tool_calls")}]
        self.tools = tools
        return answer

    # ---- /v1/completions ----
    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """OpenAI's legacy completions: `prompt` a string (or one string in a list) or token ids. The first
        prompt is the sample's prompt; a later one must extend the trajectory (a text prompt: the last prompt and
        the answer's text, then new text; token ids: the sample's tokens, then new ids), the new part recorded as
        environment tokens (loss mask 0). Anything else branches, as for chat."""
        async with self._lock:
            return await self._serve(self._complete, body)

    async def _complete(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.cut:
            raise RolloutCut("the rollout stopped this trajectory (its step is complete)")
        if self.messages is not None:
            raise RequestError("this trajectory speaks /v1/chat/completions: one trajectory uses one of the two "
                               "APIs", "prompt")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        text_prompt = isinstance(prompt, str)
        ids_prompt = isinstance(prompt, list) and bool(prompt) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        if not (text_prompt and prompt) and not ids_prompt:
            raise RequestError("'prompt' must be a non-empty string or a non-empty list of token ids (one prompt: "
                               "one trajectory is one sample)", "prompt")
        if body.get("n", 1) != 1:
            raise RequestError("only n=1 is served (one trajectory is one sample)", "n")
        if body.get("echo"):
            raise RequestError("echo is not served", "echo")
        s = self.sample
        if not self.completions:  # the first request: its prompt is the sample's
            self.completions = True
            ids = self.tok.encode(prompt) if text_prompt else list(prompt)
            self._begin(prompt if text_prompt else self.tok.decode(ids, skip_special_tokens=False), ids)
        elif not self.branched:
            new: list[int] | None = None
            if text_prompt and self.completion_text is not None and prompt.startswith(self.completion_text):
                new = self.tok.encode(prompt[len(self.completion_text):], add_special_tokens=False)
            elif ids_prompt and prompt[:len(s.tokens)] == s.tokens:
                new = list(prompt[len(s.tokens):])
            if new is None:
                self._branch()
            else:
                self._add_env(new)
        if self.branched:
            ids = self.tok.encode(prompt) if text_prompt else list(prompt)
            return self._completion(body, *await self._untracked(body, ids))
        turn = await self._turn(body)
        if turn is None:  # nothing more fits: the sample ends here, truncated
            self.completion_text = prompt if text_prompt else None
            return self._completion(body, [], "", {"type": "length"}, s.tokens, [])
        self.completion_text = prompt + turn[1] if text_prompt else None
        return self._completion(body, *turn)

    # ---- what both APIs do with a request ----
    def _begin(self, prompt: str, prompt_ids: list[int]) -> None:
        """The first request: its prompt (whatever the data row's prompt was) starts the sample over."""
        s = self.sample
        s.prompt, s.prompt_ids = prompt, prompt_ids
        s.response, s.response_ids, s.rollout_logprobs, s.loss_mask = "", [], [], []
        s.metadata.pop(STATUS, None)
        s.metadata.pop(VERSIONS, None)

    def _branch(self) -> None:
        self.branched = True
        self.sample.metadata["agent_branched"] = True

    def _add_env(self, new: list[int]) -> None:
        """A request's new tokens after the last answer, as environment tokens within the response budget."""
        if not self.exhausted:
            room = self.pool.budget(self.sample, self.budget_total, count=False)
            append_env_tokens(self.sample, new[:room], self.tok)
            self.exhausted = len(new) > room

    async def _turn(self, body: dict[str, Any]) -> tuple | None:
        """One recorded answer on the sample's tokens: (ids, text, finish_reason, the prompt ids it answered,
        its log-probs), or None when the budget is spent (the sample marked truncated)."""
        budget = 0 if self.exhausted else self.pool.budget(self.sample, self.budget_total)
        if budget <= 0:
            self.exhausted = True
            mark_truncated(self.sample)
            return None
        prompt_ids = self.sample.tokens
        out = await self.pool.generate(self.sample, prompt_ids, self._params(body, budget))
        ids = append_model_turn(self.sample, out, self.tok)
        if status(self.sample) == ABORTED:
            self.cut = True
            raise RolloutCut("the rollout stopped this request (its step is complete)")
        self.turns += 1
        self.last_turn = ids
        finish = (out.get("meta_info") or {}).get("finish_reason") or {}
        logprobs = self.sample.rollout_logprobs[len(self.sample.rollout_logprobs) - len(ids):]
        return ids, out.get("text") or "", finish, prompt_ids, logprobs

    def _completion(self, body: dict[str, Any], ids: list[int], text: str, finish: dict[str, Any],
                    prompt_ids: list[int], logprobs: list[float]) -> dict[str, Any]:
        """OpenAI's text_completion object (logprobs when asked: tokens, token_logprobs, text_offset)."""
        self._ids += 1
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None,
                                  "finish_reason": "length" if finish.get("type") == "length" else "stop"}
        if body.get("logprobs") is not None and body.get("logprobs") is not False:
            tokens = [self.tok.decode([t], skip_special_tokens=False) for t in ids]
            offsets, at = [], 0
            for t in tokens:
                offsets.append(at)
                at += len(t)
            choice["logprobs"] = {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None,
                                  "text_offset": offsets}
        return self._envelope(body, f"cmpl-{self.sample.index}-{self._ids}", "text_completion", choice, ids,
                              prompt_ids)

    @staticmethod
    def _envelope(body: dict[str, Any], ident: str, kind: str, choice: dict[str, Any], ids: list[int],
                  prompt_ids: list[int]) -> dict[str, Any]:
        """The object around one choice, as OpenAI's chat and completions endpoints both write it."""
        out = {"id": ident, "object": kind, "created": int(time.time()), "model": body.get("model") or "policy",
               "choices": [choice], "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                                              "total_tokens": len(prompt_ids) + len(ids)}}
        if body.get("return_token_ids"):  # vLLM's extension: the ids the engine was given and gave back
            choice["token_ids"] = list(ids)
            out["prompt_token_ids"] = list(prompt_ids)
        return out

    def _extension(self, messages: list[dict[str, Any]], tools: list[dict] | None, text: str) -> list[int] | None:
        """The environment tokens this request adds after the last answer, or None: it does not extend it."""
        known = self.messages
        assert known is not None
        if tools != self.tools or len(messages) <= len(known):
            return None
        if not all(_same_message(a, b) for a, b in zip(messages[:len(known)], known, strict=False)):
            return None
        # the harness's own echo of the answer renders as the template renders it; what follows it is new
        through = render(self.tok, messages[:len(known)], tools, False, self.template_kwargs)
        if not text.startswith(through):
            return None
        end = _turn_end(self.tok)
        # the sampled turn ended on the template's end-of-turn token (a special token, e.g. <|im_end|>): what
        # the template writes after it; any other ending (a stop string, the budget): the whole end of turn
        last = self.last_turn[-1] if self.last_turn else None
        text_last = self.tok.decode([last], skip_special_tokens=False) if last in self._specials() else ""
        closing = end[len(text_last):] if text_last and end.startswith(text_last) else end
        return self.tok.encode(closing + text[len(through):], add_special_tokens=False)

    def _specials(self) -> set[int]:
        return set(getattr(self.tok, "all_special_ids", []) or [])

    def _params(self, body: dict[str, Any], budget: int) -> dict[str, Any]:
        params = dict(self.params)
        cap = body.get("max_completion_tokens", body.get("max_tokens"))
        if cap is not None:
            if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
                raise RequestError("'max_tokens' must be a positive integer", "max_tokens")
            budget = min(budget, cap)
        params["max_new_tokens"] = budget
        stop = body.get("stop")
        if stop is not None:
            stop = [stop] if isinstance(stop, str) else stop
            if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
                raise RequestError("'stop' must be a string or a list of strings", "stop")
            params["stop"] = list(params.get("stop") or []) + stop
        return params

    async def _untracked(self, body: dict[str, Any], ids: list[int]) -> tuple:
        """A request after a branch, on `ids`: answered, not recorded (the sample keeps the exact part before it).
        Returns what `_turn` does: (ids, text, finish_reason, the prompt ids, log-probs)."""
        room = self.budget_total
        if self.pool.max_context_len is not None:
            room = min(room, self.pool.max_context_len - len(ids))
        if room <= 0:
            return [], "", {"type": "length"}, ids, []
        out = await self.pool.generate(self.sample, ids, self._params(body, room))
        meta = out.get("meta_info") or {}
        finish = meta.get("finish_reason") or {}
        if finish.get("type") == "abort":
            self.cut = True
            self.sample.metadata[STATUS] = ABORTED
            raise RolloutCut("the rollout stopped this request (its step is complete)")
        entries = meta.get("output_token_logprobs") or []
        return [int(e[1]) for e in entries], out.get("text") or "", finish, ids, [float(e[0]) for e in entries]

    # ---- the answer, in OpenAI's shape ----
    def _answer(self, body: dict[str, Any], ids: list[int], text: str, finish: dict[str, Any],
                prompt_ids: list[int], logprobs: list[float] | None = None) -> dict[str, Any]:
        self._ids += 1
        content, calls = text, []
        if body.get("tools") and body.get("tool_choice") != "none":
            content, calls = parse_tool_calls(text, call_id_prefix=f"call_{self.sample.index}_{self._ids}")
        self.tool_calls += len(calls)
        reason = "length" if finish.get("type") == "length" else "stop"
        if calls and reason == "stop":
            reason = "tool_calls"
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": reason, "logprobs": None}
        if body.get("logprobs"):
            choice["logprobs"] = {"content": [
                {"token": self.tok.decode([t], skip_special_tokens=False), "logprob": lp, "bytes": None,
                 "top_logprobs": []} for t, lp in zip(ids, logprobs or [], strict=True)]}
        return self._envelope(body, f"chatcmpl-{self.sample.index}-{self._ids}", "chat.completion", choice, ids,
                              prompt_ids)
