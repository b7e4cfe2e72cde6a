"""A verifiers taskset with its own two-turn `Env`, for tests/rollout/test_agent_verifiers.py: taskset id
`vf_two_turns` (verifiers imports a taskset by its id; this directory is on the tests' path). The model
answers the task's prompt, the environment asks once more as the user, the model answers again; the rubric,
one `@vf.reward` of weight 0.5, counts the words of the last answer. Two knobs of the taskset's config make
it fail: `fail_to_load` (its first task raises) and `reward_raises`."""

from __future__ import annotations

import verifiers.v1 as vf

WORDS = ["apple", "river", "stone"]


class TwoTurnsData(vf.TaskData):
    word: str
    reward_raises: bool = False


class TwoTurnsConfig(vf.TasksetConfig):
    fail_to_load: bool = False
    reward_raises: bool = False


class TwoTurnsTask(vf.Task[TwoTurnsData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=0.5)
    async def words(self, task: TwoTurnsData, trace: vf.Trace) -> float:
        if task.reward_raises:
            raise RuntimeError("the rubric failed")
        return float(len(trace.last_reply.split()))


class TwoTurnsTaskset(vf.Taskset[TwoTurnsTask, TwoTurnsConfig]):
    def load(self):
        if self.config.fail_to_load:
            raise LookupError("the data is not there")
        for word in WORDS:
            yield TwoTurnsTask(TwoTurnsData(name=word, prompt=f"say {word}", system_prompt="be brief", word=word,
                                            reward_raises=self.config.reward_raises), self.config.task)


class TwoTurnsEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class TwoTurnsEnv(vf.Env[TwoTurnsEnvConfig]):
    async def run(self, task: TwoTurnsTask, agents: vf.Agents) -> None:
        async with agents.agent.interaction(task) as interaction:
            segment = await interaction.turn()
            if not segment.terminated:
                await interaction.turn(f"again {task.data.word}")


__all__ = ["TwoTurnsConfig", "TwoTurnsData", "TwoTurnsEnv", "TwoTurnsEnvConfig", "TwoTurnsTask", "TwoTurnsTaskset"]
