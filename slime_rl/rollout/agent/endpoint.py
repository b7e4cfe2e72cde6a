"""OpenAI's chat API on 127.0.0.1 for the agents of one rollout (one `AgentEndpoint` per `ClientPool`,
started at the first trajectory, closed with the pool), served by aiohttp on the rollout's event loop.

Each trajectory has its own base URL, `http://127.0.0.1:PORT/t/KEY/v1` (KEY: a random token, so one
agent's requests can never land in another's sample); the same routes answer at `/v1/...` with
`Authorization: Bearer KEY` for harnesses that keep their own base URL. Routes: `POST /chat/completions`,
`POST /completions` (the legacy text API: a prompt string or token ids; one trajectory uses one of the two),
`GET /models`. Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a
request the trajectory cannot take (naming the field), 404 for an unknown or finished trajectory, 503 when
the rollout cut the request, 502 when the engines failed.
"""

from __future__ import annotations

import secrets
from typing import Any

from slime_rl.engines.client import EngineError
from slime_rl.rollout.agent.trajectory import RequestError, RolloutCut, Trajectory
from slime_rl.rollout.routing import ClientPool


def _error(status: int, message: str, kind: str, param: str | None = None) -> Any:
    from aiohttp import web

    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": None}},
                             status=status)


class AgentEndpoint:
    def __init__(self, pool: ClientPool, model_name: str = "policy") -> None:
        self.pool, self.model_name = pool, model_name
        self.host, self.port = "127.0.0.1", 0
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
        site = web.TCPSite(self._runner, self.host, 0, backlog=4096)
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
        if body.get("stream"):
            return _error(400, "streaming is not served (stream: false)", "invalid_request_error", "stream")
        try:
            return web.json_response(await getattr(trajectory, method)(body))
        except RequestError as exc:
            return _error(400, str(exc), "invalid_request_error", exc.param)
        except RolloutCut as exc:
            return _error(503, str(exc), "rollout_cut")
        except EngineError as exc:
            return _error(502, exc.message, "engine_error")

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


async def endpoint_of(pool: ClientPool) -> AgentEndpoint:
    """The pool's `AgentEndpoint`, started on first use and closed by `pool.aclose()`."""
    return await pool.attach("agent_endpoint", lambda: AgentEndpoint(pool))
