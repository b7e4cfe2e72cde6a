"""OpenAI's chat API for the agents of one rollout (one `AgentEndpoint` per `ClientPool`, started at the
first trajectory, closed with the pool), served by aiohttp on the rollout's event loop, on 127.0.0.1 or the
address --agent-host names (0.0.0.0: every interface, the URLs naming this node's address).

Each trajectory has its own base URL, `http://HOST:PORT/t/KEY/v1` (KEY: a random token, so one
agent's requests can never land in another's sample); the same routes answer at `/v1/...` with
`Authorization: Bearer KEY` for harnesses that keep their own base URL. Routes: `POST /chat/completions`,
`POST /completions` (the legacy text API: a prompt string or token ids; one trajectory uses one of the two),
`GET /models`. `stream: true` is served as OpenAI's server-sent chunks (`stream_chunks`), sent once the
turn is generated whole (the sample records whole turns). Errors are OpenAI's shape, `{"error": {"message",
"type", "param", "code"}}`: 400 for a request the trajectory cannot take (naming the field), 404 for an
unknown or finished trajectory, 503 when the rollout cut the request, 502 when the engines failed.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from slime_rl.engines.addresses import route_source, usable
from slime_rl.engines.client import EngineError
from slime_rl.rollout.agent.trajectory import RequestError, RolloutCut, Trajectory, TrajectoryClosed
from slime_rl.rollout.routing import ClientPool


def _error(status: int, message: str, kind: str, param: str | None = None) -> Any:
    from aiohttp import web

    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": None}},
                             status=status)


def advertised_host(host: str) -> str:
    """The address a trajectory's base URL names for an endpoint listening on `host`: itself, or for every
    interface (0.0.0.0, ::) the source address of this node's default route (what Ray calls the node's
    address; other nodes reach it by it), else 127.0.0.1."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    src = route_source()
    return src if src and usable(src) else "127.0.0.1"


class AgentEndpoint:
    def __init__(self, pool: ClientPool, model_name: str = "policy", host: str = "127.0.0.1") -> None:
        self.pool, self.model_name = pool, model_name
        self.listen, self.port = host, 0  # --agent-host
        self.host = advertised_host(host)
        self.trajectories: dict[str, Trajectory] = {}
        self._runner: Any = None

    async def start(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=64 << 20)
        for prefix in ("/t/{key}/v1", "/v1"):
            app.router.add_post(prefix + "/chat/completions", self._chat)
            app.router.add_post(prefix + "/completions", self._completions)
            app.router.add_get(prefix + "/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.listen or None, 0, backlog=4096)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    def register(self, trajectory: Trajectory) -> str:
        """A new trajectory's base URL (OpenAI's `base_url`)."""
        key = secrets.token_urlsafe(12)
        self.trajectories[key] = trajectory
        trajectory.key = key
        return f"http://{self.host}:{self.port}/t/{key}/v1"

    def unregister(self, trajectory: Trajectory) -> None:
        self.trajectories.pop(getattr(trajectory, "key", ""), None)

    def _trajectory(self, request: Any) -> Trajectory | None:
        key = request.match_info.get("key")
        if key is None:
            scheme, _, key = (request.headers.get("Authorization") or "").partition(" ")
            if scheme.lower() != "bearer":
                return None
        return self.trajectories.get(key)

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        if self._trajectory(request) is None:
            return _error(404, "no such trajectory (finished, or a wrong key)", "not_found_error")
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "slime_rl"}]})

    async def _chat(self, request: Any) -> Any:
        return await self._serve(request, "chat")

    async def _completions(self, request: Any) -> Any:
        return await self._serve(request, "complete")

    async def _serve(self, request: Any, method: str) -> Any:
        from aiohttp import web

        trajectory = self._trajectory(request)
        if trajectory is None:
            return _error(404, "no such trajectory (finished, or a wrong key)", "not_found_error")
        try:
            body = await request.json()
        except ValueError as exc:
            return _error(400, f"the body is not JSON: {exc}", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object", "invalid_request_error")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            return _error(400, "'stream' must be true or false", "invalid_request_error", "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            return _error(400, "'stream_options' must be an object", "invalid_request_error", "stream_options")
        try:
            answer = await getattr(trajectory, method)(body)
        except RequestError as exc:
            return _error(400, str(exc), "invalid_request_error", exc.param)
        except TrajectoryClosed as exc:
            return _error(404, str(exc), "not_found_error")
        except RolloutCut as exc:
            return _error(503, str(exc), "rollout_cut")
        except EngineError as exc:
            return _error(502, exc.message, "engine_error")
        if not stream:
            return web.json_response(answer)
        # the answer is whole by now (the sample records whole turns): it goes out as OpenAI's chunks at once
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for chunk in stream_chunks(answer, bool(options.get("include_usage"))):
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def stream_chunks(answer: dict[str, Any], include_usage: bool = False) -> list[dict[str, Any]]:
    """A whole answer (`chat.completion` or `text_completion`) as the chunks OpenAI's `stream: true` sends:
    the content (chat: with the role; and the tool calls, each with its index), then the finish reason, then
    with `stream_options.include_usage` a chunk of no choices with the usage. Joined by the client, the chunks
    give back the answer."""
    chat = answer["object"] == "chat.completion"
    base = {"id": answer["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": answer["created"], "model": answer["model"]}
    choice = answer["choices"][0]
    if chat:
        message = choice["message"]
        first: dict[str, Any] = {"index": 0, "delta": {"role": "assistant", "content": message.get("content") or ""},
                                 "logprobs": choice.get("logprobs"), "finish_reason": None}
    else:
        first = {"index": 0, "text": choice["text"], "logprobs": choice.get("logprobs"), "finish_reason": None}
    if "token_ids" in choice:  # vLLM's extension, as it streams it
        first["token_ids"] = choice["token_ids"]
    head = dict(base, choices=[first])
    if "prompt_token_ids" in answer:
        head["prompt_token_ids"] = answer["prompt_token_ids"]
    chunks = [head]
    if chat and choice["message"].get("tool_calls"):
        calls = [{"index": i, **call} for i, call in enumerate(choice["message"]["tool_calls"])]
        chunks.append(dict(base, choices=[{"index": 0, "delta": {"tool_calls": calls}, "logprobs": None,
                                           "finish_reason": None}]))
    last = {"index": 0, "delta": {}} if chat else {"index": 0, "text": ""}
    chunks.append(dict(base, choices=[last | {"logprobs": None, "finish_reason": choice["finish_reason"]}]))
    if include_usage:
        chunks.append(dict(base, choices=[], usage=answer["usage"]))
    return chunks


async def endpoint_of(pool: ClientPool, host: str = "127.0.0.1") -> AgentEndpoint:
    """The pool's `AgentEndpoint` (listening on `host`, --agent-host), started on first use and closed by
    `pool.aclose()`."""
    return await pool.attach("agent_endpoint", lambda: AgentEndpoint(pool, host=host))
