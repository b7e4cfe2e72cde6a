"""Text environments as agents: a Gymnasium-style protocol, and TextArena's games through it.

    class MyEnv:                                   # sync or async methods
        def reset(self) -> str: ...                # the first observation
        def step(self, action: str) -> tuple[str, float, bool]: ...   # observation, reward, done

`--agent-env module:factory` names `factory(sample) -> env` (a class works); `--agent-env textarena:GAME`
plays TextArena's single-player game GAME (e.g. `GuessTheNumber-v0`, `Wordle-v0`). Each sample is one
episode, driven through the rollout's OpenAI endpoint like any agent (`runner.AgentGenerate`): the
observation is the user turn, the model's answer (its content) is the action, the next observation the
next user turn, for at most `--agent-max-turns` answers of at most `--agent-turn-max-tokens` each; the
reward is the sum of the step rewards.
Every sample of a group plays the same episode: TextArena games are reset with the seed of the sample's
data row (`metadata["seed"]`) or else its group index. A synchronous environment runs on the rollout's
event loop (TextArena seeds Python's global `random` in `reset`, so its games must not run on threads);
give a slow one async methods.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol

from slime_rl.config.dotted_path import load_by_path
from slime_rl.data import Sample

AGENT_ENV_FLAG = "--agent-env"


class TextEnv(Protocol):
    def reset(self) -> Any: ...  # str, or an awaitable of it

    def step(self, action: str) -> Any: ...  # (observation, reward, done), or an awaitable of it


async def _call(fn: Callable, *args: Any) -> Any:
    out = fn(*args)
    return await out if inspect.isawaitable(out) else out


class TextArenaEnv:
    """A TextArena single-player game as a `TextEnv`. Observations are the game's messages since the last
    action, the player's own action left out (it is the assistant turn already)."""

    def __init__(self, game: str, seed: int) -> None:
        import textarena as ta

        # the "-raw" variant: the game's messages as (source, text, kind), not one growing prompt string
        raw = game if game.endswith("-raw") else f"{game}-raw"
        self.env = ta.make(env_id=raw if raw in ta.envs.registration.ENV_REGISTRY else game)
        self.seed, self.player = seed, 0

    def _observation(self) -> str:
        self.player, messages = self.env.get_observation()
        return "\n".join(text for source, text, *_ in messages if source != self.player)

    def reset(self) -> str:
        self.env.reset(num_players=1, seed=self.seed)
        return self._observation()

    def step(self, action: str) -> tuple[str, float, bool]:
        done, _ = self.env.step(action=action)
        if done:
            rewards, _ = self.env.close()
            return "", float((rewards or {}).get(self.player, 0.0)), True
        return self._observation(), 0.0, False


def episode_seed(sample: Sample) -> int:
    seed = sample.metadata.get("seed")
    return int(seed) if isinstance(seed, int) and not isinstance(seed, bool) else int(sample.group_index)


def load_env_factory(spec: str) -> Callable[[Sample], TextEnv]:
    """`--agent-env`'s factory: `textarena:GAME` or a dotted path to `factory(sample) -> env`; errors name
    the flag (a TextArena game that does not exist, or textarena not installed, fail here, before any actor)."""
    if spec.startswith("textarena:"):
        game = spec.split(":", 1)[1]
        try:
            import textarena as ta
        except ImportError as exc:
            raise ValueError(f"{AGENT_ENV_FLAG} {spec}: textarena is not installed (pip install textarena)") from exc
        if game not in ta.envs.registration.ENV_REGISTRY:
            raise ValueError(f"{AGENT_ENV_FLAG} {spec}: TextArena has no game {game!r} (e.g. GuessTheNumber-v0)")
        return lambda sample: TextArenaEnv(game, episode_seed(sample))
    factory = load_by_path(spec, AGENT_ENV_FLAG)
    if not callable(factory):
        raise ValueError(f"{AGENT_ENV_FLAG} {spec}: {factory!r} is not callable (factory(sample) -> env)")
    return factory


def env_agent(factory: Callable[[Sample], TextEnv], max_turns: int, turn_max_tokens: int | None = None) -> Callable:
    """The agent function that plays one episode of `factory(sample)` through the OpenAI client; each answer
    at most `turn_max_tokens` (None: what is left of the response budget)."""
    async def agent(client: Any, sample: Sample) -> float:
        env = factory(sample)
        for name in ("reset", "step"):
            if not callable(getattr(env, name, None)):
                raise TypeError(f"{AGENT_ENV_FLAG}: the environment {type(env).__name__} has no {name}()")
        if isinstance(getattr(env, "seed", None), int):
            sample.metadata["agent_env_seed"] = env.seed
        observation = await _call(env.reset)
        messages = [{"role": "user", "content": str(observation)}]
        total, done = 0.0, False
        for _ in range(max_turns):
            answer = await client.chat.completions.create(model="policy", messages=messages,
                                                          max_tokens=turn_max_tokens)
            action = answer.choices[0].message.content or ""
            if answer.choices[0].finish_reason == "length" and not action:  # the response budget is spent
                break
            observation, reward, done = await _call(env.step, action)
            total += float(reward)
            if done:
                break
            messages += [{"role": "assistant", "content": action}, {"role": "user", "content": str(observation)}]
        sample.metadata["agent_env_done"] = bool(done)
        return total

    agent.__name__ = "env_agent"
    return agent
