"""verifiers environments as agents: `--agent-env verifiers:TASKSET_ID[:CONFIG_JSON]`.

A verifiers (PyPI `verifiers`, `verifiers.v1`) environment runs unchanged: its taskset, its `Env`
(`SingleAgentEnv` for a plain taskset, or the one the taskset exports), its harness program and its
interception server, its rewards and judges. Each sample is one episode of one task (`Env.run_episode`),
its model calls sent by verifiers' own client (`EvalClient`) to the sample's trajectory on the rollout's
endpoint (`endpoint.AgentEndpoint`), so the trajectory records them token for token as any agent's; the
sample's reward is the episode's trace reward (the weighted sum of the task's `@vf.reward`s and judges).

- `TASKSET_ID`: an installed verifiers taskset (a package exporting a `vf.Taskset`, as `vf eval` takes it), or a
  taskset module's file (`path/to/my_taskset.py`, not installed): it is imported as the module `my_taskset` in every
  process that plays episodes, and verifiers resolves that id to it.
- `CONFIG_JSON`: verifiers' `[env]` block as a JSON object (`EnvConfig` fields: `taskset` knobs, each
  role's `harness`, `runtime`, `max_turns`, `sampling`, ...), e.g.
  `verifiers:textarena:{"taskset":{"game":"Wordle-v0"}}`.
- Every role's harness runs in verifiers' `subprocess` runtime unless the JSON names another local one
  (docker, podman, apptainer); a remote sandbox (prime, modal, e2b) is refused: the rollout's endpoint is
  on this node.
- The task of a sample: the data row's `metadata["task_idx"]` (the taskset's position), else the sample's
  group index (modulo the taskset's size when it is finite), so every sample of a group plays one task.
- `--agent-turn-max-tokens` caps each answer (verifiers' `sampling.max_tokens`); the number of turns is the
  environment's (its roles' `max_turns`).
- An episode that ends with verifiers' errors (a harness that exited non-zero, a failed reward) fails its
  own sample, with verifiers' messages in `metadata["agent_error"]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import Iterator
from importlib import metadata
from typing import Any

from slime_rl.data import Sample

AGENT_ENV_FLAG = "--agent-env"
PREFIX = "verifiers:"
TASK_IDX = "task_idx"
API_KEY_VAR = "SLIME_RL_VERIFIERS_API_KEY"  # unset: verifiers sends "EMPTY"; the trajectory's key is in its URL


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """`verifiers:ID[:JSON]` -> (taskset id, the env config's other fields). An ID that is a `.py` file is imported
    as the module of its name (sys.modules), the id verifiers then resolves."""
    rest = spec[len(PREFIX):]
    taskset_id, sep, raw = rest.partition(":")
    if not taskset_id:
        raise ValueError(f"{AGENT_ENV_FLAG} {spec}: name a verifiers taskset, verifiers:TASKSET_ID[:CONFIG_JSON]")
    if taskset_id.endswith(".py"):
        taskset_id = _import_taskset_file(spec, taskset_id)
    overrides: dict[str, Any] = {}
    if sep:
        try:
            overrides = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{AGENT_ENV_FLAG} {spec}: the config after {PREFIX}{taskset_id}: is not JSON "
                             f"({exc})") from exc
        if not isinstance(overrides, dict):
            raise ValueError(f"{AGENT_ENV_FLAG} {spec}: the config must be a JSON object (verifiers' [env] block)")
    return taskset_id, overrides


def _import_taskset_file(spec: str, file: str) -> str:
    """Import a taskset module's file as the module of its stem (once per process); its stem, the taskset id."""
    import sys
    from pathlib import Path

    from slime_rl.config.dotted_path import import_file_as

    path = Path(file).resolve()
    name = path.stem
    if not path.is_file():
        raise ValueError(f"{AGENT_ENV_FLAG} {spec}: no such taskset file {file!r}")
    loaded = sys.modules.get(name)
    if loaded is not None:
        if Path(getattr(loaded, "__file__", "") or "").resolve() != path:
            raise ValueError(f"{AGENT_ENV_FLAG} {spec}: a module named {name!r} is already imported from "
                             f"{getattr(loaded, '__file__', None)}; rename the taskset file")
        return name
    try:
        import_file_as(path, name)
    except Exception as exc:
        raise ValueError(f"{AGENT_ENV_FLAG} {spec}: importing {path} failed: {type(exc).__name__}: {exc}") from exc
    return name


def _import_verifiers(spec: str) -> Any:
    try:
        openai_version = metadata.version("openai")
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ValueError(f"{AGENT_ENV_FLAG} {spec}: verifiers is not installed (pip install 'slime-rl[agent]', "
                         f"which pins verifiers==0.4.0): {exc}") from exc
    if int(openai_version.split(".")[0]) >= 3:
        raise ValueError(f"{AGENT_ENV_FLAG} {spec}: verifiers 0.4.0 needs openai<3, this environment has openai "
                         f"{openai_version} (pip install 'openai>=2.54,<3')")
    return vf


class VerifiersAgent:
    """The agent function `(client, sample) -> reward` that plays one verifiers episode per sample."""

    def __init__(self, spec: str, turn_max_tokens: int | None = None) -> None:
        vf = self.vf = _import_verifiers(spec)
        from verifiers.v1.configs.agent import agent_config_fields
        from verifiers.v1.runtimes import runtime_is_local

        self.spec, self.turn_max_tokens = spec, turn_max_tokens
        taskset_id, overrides = parse_spec(spec)
        taskset = dict(overrides.get("taskset") or {})
        if taskset.setdefault("id", taskset_id) != taskset_id:
            raise ValueError(f"{AGENT_ENV_FLAG} {spec}: the config's taskset.id {taskset['id']!r} is not "
                             f"{taskset_id!r}")
        try:
            config = vf.resolve_env_config({**overrides, "taskset": taskset})
            # a role whose runtime the config does not name runs in the subprocess runtime (verifiers' own
            # default is Prime's remote sandboxes)
            roles = agent_config_fields(config)
            for name, role in roles.items():
                if "runtime" not in role.model_fields_set:
                    setattr(config, name, role.model_copy(update={"runtime": vf.SubprocessConfig()}))
            for name, role in agent_config_fields(config).items():
                if not runtime_is_local(role.runtime):
                    raise ValueError(f"the role {name!r} runs in a remote sandbox (runtime "
                                     f"{getattr(role.runtime, 'type', type(role.runtime).__name__)!r}); the "
                                     "rollout's endpoint is on this node: name a local runtime (subprocess, docker, "
                                     "podman, apptainer)")
            self.env = vf.load_environment(config)
        except ValueError as exc:
            if str(exc).startswith(AGENT_ENV_FLAG):
                raise
            raise ValueError(f"{AGENT_ENV_FLAG} {spec}: {exc}") from exc
        except (ImportError, TypeError, AttributeError) as exc:
            raise ValueError(f"{AGENT_ENV_FLAG} {spec}: {type(exc).__name__}: {exc}") from exc
        self.config = config
        self.bounded = self.env.taskset.bounded
        self._tasks: list[Any] | None = None
        self._stream: Iterator[Any] | None = None
        self._seen: list[Any] = []
        # the env's serving resources (its interception server, shared tool servers), held by one task per event
        # loop, and the future that says they are up
        self._serving: dict[asyncio.AbstractEventLoop, tuple[asyncio.Task, asyncio.Future]] = {}
        self.__name__ = "verifiers_agent"
        try:  # the taskset loads (its data, what it downloads) here, before any sample
            self.task(0)
        except Exception as exc:
            if str(exc).startswith(AGENT_ENV_FLAG):
                raise
            raise ValueError(f"{AGENT_ENV_FLAG} {spec}: the taskset's first task does not load: "
                             f"{type(exc).__name__}: {' '.join(str(exc).replace('*', ' ').split())[:500]}") from exc

    def task(self, index: int) -> Any:
        """The taskset's task at `index` (modulo its size when it is finite)."""
        if self.bounded:
            if self._tasks is None:
                self._tasks = list(self.env.taskset)
                if not self._tasks:
                    raise ValueError(f"{AGENT_ENV_FLAG} {self.spec}: the taskset has no task")
            return self._tasks[index % len(self._tasks)]
        # an unbounded taskset (a generator, e.g. verifiers' seeded TextArena games) is iterated once: its tasks
        # are kept as far as the highest index asked (loading it again per sample loads its data each time)
        if self._stream is None:
            self._stream, self._seen = iter(self.env.taskset), []
        self._seen.extend(itertools.islice(self._stream, max(0, index + 1 - len(self._seen))))
        if index >= len(self._seen):
            raise ValueError(f"{AGENT_ENV_FLAG} {self.spec}: the taskset ended after {len(self._seen)} task(s) "
                             f"but says it is unbounded; task {index} was asked")
        return self._seen[index]

    @staticmethod
    def task_index(sample: Sample) -> int:
        idx = sample.metadata.get(TASK_IDX)
        return int(idx) if isinstance(idx, int) and not isinstance(idx, bool) else int(sample.group_index)

    async def _serve(self, ready: asyncio.Future) -> None:
        try:
            async with self.env.serving():
                ready.set_result(None)
                await asyncio.Event().wait()  # held until the loop ends (the task is cancelled then)
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise

    async def serving(self) -> None:
        """Bring the env's serving resources up on this event loop once."""
        loop = asyncio.get_running_loop()
        if loop not in self._serving:
            for closed in [other for other in self._serving if other.is_closed()]:
                del self._serving[closed]
            ready = loop.create_future()
            self._serving[loop] = (loop.create_task(self._serve(ready)), ready)
        await asyncio.shield(self._serving[loop][1])

    async def close(self) -> None:
        """Tear down this loop's serving resources (tests; a rollout keeps them for its process)."""
        task, _ = self._serving.pop(asyncio.get_running_loop(), (None, None))
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def __call__(self, client: Any, sample: Sample) -> float:
        vf = self.vf
        await self.serving()
        idx = self.task_index(sample)
        task = self.task(idx)
        sample.metadata["verifiers_task"] = {"idx": task.data.idx, "name": task.data.name, "key": task.key}
        sampling = vf.SamplingConfig(max_tokens=self.turn_max_tokens) if self.turn_max_tokens else vf.SamplingConfig()
        ctx = vf.ModelContext(model="policy", sampling=sampling,
                              client=vf.EvalClientConfig(base_url=str(client.base_url).rstrip("/"),
                                                         api_key_var=API_KEY_VAR))
        episode = await self.env.run_episode(task, ctx)
        errors = [*episode.errors, *(e for trace in episode.traces for e in trace.errors)]
        if not episode.ok or errors:
            why = "; ".join(f"{e.type}: {e.message}" for e in errors) or "the episode did not complete"
            raise RuntimeError(f"verifiers episode of task {idx}: {why}")
        if len(episode.traces) != 1:
            raise RuntimeError(f"verifiers episode of task {idx}: {len(episode.traces)} agent runs; one sample "
                               "records one conversation (a single-agent environment)")
        (trace,) = episode.traces
        sample.metadata["verifiers_rewards"] = {k: (r.score if r is not None else None)
                                                for k, r in trace.rewards.items()}
        return float(trace.reward)


def is_verifiers_spec(spec: str | None) -> bool:
    return bool(spec) and spec.startswith(PREFIX)


_AGENTS: dict[tuple[str, int | None], VerifiersAgent] = {}


def verifiers_agent(spec: str, turn_max_tokens: int | None = None) -> VerifiersAgent:
    """The process's one `VerifiersAgent` of `spec`: the rollout's generate function and its eval's (built at
    each eval) share one env and its serving resources."""
    key = (spec, turn_max_tokens)
    if key not in _AGENTS:
        _AGENTS[key] = VerifiersAgent(spec, turn_max_tokens)
    return _AGENTS[key]
