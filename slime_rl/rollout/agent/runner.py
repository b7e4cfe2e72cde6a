"""An agent function as the rollout's generate function.

    async def agent(client: openai.AsyncOpenAI, sample) -> float | None

`--custom-generate-function-path` naming a function of two parameters runs it this way: for each sample
the rollout opens a trajectory on the pool's OpenAI endpoint (`endpoint.AgentEndpoint`) and calls the
function with an `openai.AsyncOpenAI` client whose base URL is that trajectory's, and the sample (its
`prompt`: the data row's prompt, a string or a message list; `label`, `metadata`). The function talks to
the model only through the client, as any harness does, and returns the reward (a number), or None to have
the run's reward function (--rm-type / --custom-rm-path) score the trajectory. The sample is what the
trajectory recorded (`trajectory.Trajectory`): exact tokens, loss mask on the model's tokens.

A function that raises fails its own sample only: the sample keeps what it had, its loss mask goes to
zero (an environment's failure is not the model's), `finish_reason` "failed", its error in
`metadata["agent_error"]`, counted in `rollout/agent_failed_frac`. So does a run longer than
`--agent-timeout-s`: it is cancelled, with the request it was waiting on (aborted on its engine), and
counted in `rollout/agent_timeout_frac` too. A sample aborted by the rollout (over
sampling, a deadline) is started again from its prompt if it is continued: an agent run cannot be
resumed in the middle.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from slime_rl.data import Sample
from slime_rl.rollout.agent.endpoint import endpoint_of
from slime_rl.rollout.agent.trajectory import Trajectory
from slime_rl.rollout.partial import COMPLETED, STATUS
from slime_rl.rollout.routing import ClientPool

AgentFn = Callable[[Any, Sample], Awaitable[float | int | None]]


def _http_client() -> Any:
    """A trajectory's own connection to the endpoint: one pool shared by thousands of trajectories costs
    httpcore a scan of every connection per request (quadratic; 256 trajectories of two turns: 15 s on the
    2-core machine, most of it in that scan). Plain HTTP on loopback: no TLS context."""
    import httpx

    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(verify=False, retries=0),
                             timeout=httpx.Timeout(None))


class AgentGenerate:
    """`agent(client, sample)` in our generate convention `(sample, sampling_params, client_pool)`."""

    def __init__(self, fn: AgentFn, path: str, timeout_s: float | None = None, host: str = "127.0.0.1") -> None:
        self.fn, self.path, self.timeout_s, self.host = fn, path, timeout_s, host  # host: --agent-host
        self.__name__ = getattr(fn, "__name__", "agent")

    async def __call__(self, sample: Sample, sampling_params: dict[str, Any], client_pool: ClientPool) -> Sample:
        import openai

        endpoint = await endpoint_of(client_pool, self.host)
        trajectory = Trajectory(sample, sampling_params, client_pool)
        base_url = endpoint.register(trajectory)
        http = _http_client()
        client = openai.AsyncOpenAI(base_url=base_url, api_key="trajectory", max_retries=0, http_client=http)
        try:
            reward = await asyncio.wait_for(self.fn(client, sample), self.timeout_s)
        except TimeoutError:  # --agent-timeout-s: the run is cancelled, its request in flight too (close below)
            trajectory.close()
            if trajectory.cut:
                return sample
            sample.metadata["agent_timed_out"] = True
            return _failed(sample, f"{self.path}: the agent run took more than --agent-timeout-s {self.timeout_s:g}")
        except Exception as exc:  # the environment's failure fails this sample alone
            if trajectory.cut:  # not a failure: the rollout aborted it (continued, it starts over)
                return sample
            return _failed(sample, f"{type(exc).__name__}: {exc}"[:500])
        finally:
            trajectory.close()
            endpoint.unregister(trajectory)
            await http.aclose()
            sample.metadata.update({"agent_turns": trajectory.turns, "agent_tool_calls": trajectory.tool_calls})
        if trajectory.cut:  # the agent went on after the rollout aborted it: still aborted, not scored
            return sample
        if trajectory.turns == 0 and not trajectory.exhausted:
            return _failed(sample, f"{self.path}: the agent returned without asking the model anything")
        if reward is not None:
            if isinstance(reward, bool) or not isinstance(reward, (int, float)):
                return _failed(sample, f"{self.path}: returned {type(reward).__name__}; expected a number (the "
                                       "reward) or None")
            sample.reward = float(reward)
        return sample


def _failed(sample: Sample, why: str) -> Sample:
    sample.metadata["agent_error"] = why
    sample.metadata[STATUS] = COMPLETED
    sample.finish_reason = "failed"
    sample.loss_mask = [0] * len(sample.response_ids)
    if sample.reward is None:
        sample.reward = 0.0
    print(f"[slime_rl] agent: sample {sample.index} failed: {why}")
    return sample
