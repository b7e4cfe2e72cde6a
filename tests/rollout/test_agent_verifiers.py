"""--agent-env verifiers:ID: a verifiers environment (its taskset, its `Env`, its harness program, its
interception server and client, its rubric) runs unchanged against the built-in engine (in this process),
one episode per sample. The environment is `vf_two_turns.py` (a taskset and a two-turn `Env` written
against verifiers' API), played by verifiers' `null` harness: its chat program, run by verifiers in a
subprocess, talks to verifiers' interception server, whose client sends each request to the sample's
trajectory. Checked against what the engine answered (every /generate the trajectories sent, recorded
here) and what the chat template renders, derived here; the reward against verifiers' own reward function
applied to the answer the model gave. Needs verifiers (the agent extra) and `uv` (verifiers runs its
harness program as a uv script: the first run resolves its dependencies)."""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace

import pytest
from rollout_testlib import start_server

from slime_rl.data import Sample
from slime_rl.engines.client import AsyncEngineClient
from slime_rl.rollout.partial import COMPLETED, STATUS, TRUNCATED
from slime_rl.rollout.routing import ClientPool

vf = pytest.importorskip("verifiers.v1", reason="verifiers is not installed (the agent extra)")

SPEC = 'verifiers:vf_two_turns:{"agent":{"harness":{"id":"null"}}}'


@pytest.fixture(scope="module")
def server(tiny_qwen2):
    s = start_server(tiny_qwen2, random_seed=5, max_running_requests=64)
    yield s
    s.shutdown()


@pytest.fixture(scope="module")
def tok(tiny_qwen2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen2)


def run_episodes(server, tok, runs, max_new_tokens=200):
    """Each (generate function, sample) of `runs`, all at once; also every engine call the trajectories made,
    per sample index, in order."""
    calls: dict[int, list[tuple[list[int], dict]]] = {}

    async def main():
        client = AsyncEngineClient(server.url, timeout=120)
        pool = ClientPool([client], tok, per_engine=64)
        generate = pool.generate

        async def recorded(sample, input_ids, params):
            out = await generate(sample, input_ids, params)
            calls.setdefault(sample.index, []).append((list(input_ids), out))
            return out

        pool.generate = recorded
        params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": max_new_tokens}
        try:
            return await asyncio.gather(*(gen(s, params, pool) for gen, s in runs))
        finally:
            for gen in {id(gen): gen for gen, _ in runs}.values():
                await gen.fn.close()
            await pool.aclose()
            await client.aclose()

    return asyncio.run(main()), calls


def test_a_verifiers_environment_plays_through_the_endpoint(server, tok):
    """Three samples, two groups: each sample is one episode of one task (a group's samples share it); two
    model turns with the environment's user turn between; the sample's tokens are the first request's
    rendering, each answer's ids as the engine sampled them, the template's text between; loss mask 1
    exactly on the sampled ids; the reward is the task's `@vf.reward` (weight 0.5) on the last answer."""
    import vf_two_turns

    from slime_rl.rollout.custom import rollout_generate_function

    def generate(spec):
        return rollout_generate_function(SimpleNamespace(agent_env=spec, agent_max_turns=16, agent_turn_max_tokens=8,
                                                         custom_generate_function_path=None))

    gen = generate(SPEC)
    # beside them, an episode whose rubric raises: verifiers records the error, the sample fails alone
    failing = generate('verifiers:vf_two_turns:{"agent":{"harness":{"id":"null"}},"taskset":{"reward_raises":true}}')
    runs = [(gen, Sample(index=i, group_index=i // 2, prompt="", prompt_ids=[])) for i in range(3)]
    results, calls = run_episodes(server, tok, runs + [(failing, Sample(index=9, group_index=0, prompt="",
                                                                        prompt_ids=[]))])
    *samples, failed = results
    assert failed.finish_reason == "failed" and failed.reward == 0.0 and set(failed.loss_mask) == {0}
    assert "the rubric failed" in failed.metadata["agent_error"] and failed.metadata["agent_turns"] == 2
    for s in samples:
        word = vf_two_turns.WORDS[s.group_index]
        assert "agent_error" not in s.metadata, s.metadata.get("agent_error")
        assert s.metadata["verifiers_task"]["name"] == word and s.metadata["agent_turns"] == 2
        # the first request: the task's system prompt and prompt, rendered with the generation prompt
        first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"say {word}"}]
        before = tok.apply_chat_template(first, tokenize=False, add_generation_prompt=True)
        assert s.prompt_ids == tok.encode(before, add_special_tokens=False)
        (in0, out0), (in1, out1) = calls[s.index]
        ids0 = [int(e[1]) for e in out0["meta_info"]["output_token_logprobs"]]
        ids1 = [int(e[1]) for e in out1["meta_info"]["output_token_logprobs"]]
        assert in0 == s.prompt_ids and 0 < len(ids0) <= 8 and 0 < len(ids1) <= 8  # --agent-turn-max-tokens
        # between the answers: the template's end of the first answer and the environment's user turn
        raw0 = tok.decode(ids0, skip_special_tokens=False)
        after = tok.apply_chat_template(first + [{"role": "assistant", "content": raw0.removesuffix("<|im_end|>")},
                                                 {"role": "user", "content": f"again {word}"}],
                                        tokenize=False, add_generation_prompt=True)
        assert after.startswith(before + raw0.removesuffix("<|im_end|>"))
        env = tok.encode(after[len(before) + len(raw0):], add_special_tokens=False)
        assert s.response_ids == ids0 + env + ids1
        assert s.loss_mask == [1] * len(ids0) + [0] * len(env) + [1] * len(ids1)
        assert in1 == s.prompt_ids + ids0 + env  # the second answer was sampled after exactly those tokens
        assert s.rollout_logprobs == ([float(e[0]) for e in out0["meta_info"]["output_token_logprobs"]]
                                      + [0.0] * len(env)
                                      + [float(e[0]) for e in out1["meta_info"]["output_token_logprobs"]])
        # the reward: verifiers' reward function of the task, on the last answer the model gave (the engine's
        # text, which the endpoint served as its content), times the reward's weight
        task = vf_two_turns.TwoTurnsTask(vf_two_turns.TwoTurnsData(name=word, prompt=f"say {word}", word=word))
        score = asyncio.run(task.words(task.data, SimpleNamespace(last_reply=(out1.get("text") or "").strip())))
        weight = vf_two_turns.TwoTurnsTask.words._vf_weight
        assert weight == 0.5 and s.metadata["verifiers_rewards"] == {"words": score}
        assert s.reward == score * weight
        assert s.metadata[STATUS] in (COMPLETED, TRUNCATED)
    keys = [s.metadata["verifiers_task"]["key"] for s in samples]
    assert keys[0] == keys[1] != keys[2]  # a group plays one task, another group another


def test_a_data_rows_task_idx_names_the_task():
    from slime_rl.rollout.custom import rollout_generate_function

    def generate():
        return rollout_generate_function(SimpleNamespace(agent_env=SPEC, agent_max_turns=16, agent_turn_max_tokens=8,
                                                         custom_generate_function_path=None))

    agent = generate().fn
    assert generate().fn is agent  # the rollout's and each eval's generate function share one env
    by_group = Sample(index=0, group_index=4, prompt="", prompt_ids=[])
    by_row = Sample(index=0, group_index=4, prompt="", prompt_ids=[], metadata={"task_idx": 2})
    assert agent.task(agent.task_index(by_group)).data.name == "river"  # 4 % 3 tasks
    assert agent.task(agent.task_index(by_row)).data.name == "stone"


def test_verifiers_specs_are_checked_before_anything_starts(tmp_path, monkeypatch):
    from slime_rl.config import build_config
    from slime_rl.rollout.agent import verifiers_env
    from slime_rl.rollout.custom import rollout_generate_function

    base = ["--hf-checkpoint", str(tmp_path), "--prompt-data", str(tmp_path / "d.jsonl"), "--rollout-batch-size", "2",
            "--num-rollout", "1"]
    cfg = build_config(base + ["--agent-env", "verifiers:no_such_taskset"], check_paths=False)  # no reward flag
    with pytest.raises(ValueError, match="--agent-env verifiers:no_such_taskset: .*taskset 'no_such_taskset' not "
                                         "found"):
        rollout_generate_function(cfg.rollout)

    def refused(spec, match):
        with pytest.raises(ValueError, match=match):
            verifiers_env.VerifiersAgent(spec)

    refused("verifiers:", "--agent-env verifiers:: name a verifiers taskset")
    refused("verifiers:vf_two_turns:{oops", "--agent-env verifiers:vf_two_turns:{oops: the config after "
                                            "verifiers:vf_two_turns: is not JSON")
    refused("verifiers:vf_two_turns:[1]", "must be a JSON object")
    refused('verifiers:vf_two_turns:{"taskset":{"id":"other"}}', "the config's taskset.id 'other' is not "
                                                                  "'vf_two_turns'")
    refused('verifiers:vf_two_turns:{"taskset":{"fail_to_load":true}}',
            "the taskset's first task does not load: LookupError: the data is not there")
    refused('verifiers:vf_two_turns:{"taskset":{"no_such_knob":1}}',
            "--agent-env verifiers:vf_two_turns:.*no_such_knob")
    refused('verifiers:vf_two_turns:{"agent":{"harness":{"id":"no_such_harness"}}}',
            "--agent-env verifiers:vf_two_turns.*harness 'no_such_harness' not found")
    # a harness in a remote sandbox cannot reach the rollout's endpoint: refused
    refused('verifiers:vf_two_turns:{"agent":{"runtime":{"type":"prime"}}}',
            "the role 'agent' runs in a remote sandbox \\(runtime 'prime'\\)")
    # a role whose runtime is not named runs in the subprocess runtime
    agent = verifiers_env.VerifiersAgent(SPEC)
    assert isinstance(agent.config.agent.runtime, vf.SubprocessConfig)
    # verifiers 0.4.0 needs openai<3; without verifiers, the flag says what to install
    monkeypatch.setattr(verifiers_env.metadata, "version", lambda name: "3.63.0")
    refused(SPEC, "verifiers 0.4.0 needs openai<3, this environment has openai 3.63.0")
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    refused(SPEC, "--agent-env .*: verifiers is not installed")


def test_a_taskset_file_is_imported_under_its_name(tmp_path):
    """verifiers:path/to/my_taskset.py: the file is the module `my_taskset` (the id verifiers resolves); a missing
    file, or a module of that name already imported from elsewhere, is named."""
    import sys

    from slime_rl.rollout.agent.verifiers_env import parse_spec

    f = tmp_path / "my_taskset_for_test.py"
    f.write_text("MARK = 7\n")
    try:
        assert parse_spec(f"verifiers:{f}:{{}}") == ("my_taskset_for_test", {})
        assert sys.modules["my_taskset_for_test"].MARK == 7
        assert parse_spec(f"verifiers:{f}")[0] == "my_taskset_for_test"  # once per process
        other = tmp_path / "other"
        other.mkdir()
        (other / "my_taskset_for_test.py").write_text("MARK = 8\n")
        with pytest.raises(ValueError, match="a module named 'my_taskset_for_test' is already imported from"):
            parse_spec(f"verifiers:{other / 'my_taskset_for_test.py'}")
    finally:
        sys.modules.pop("my_taskset_for_test", None)
    with pytest.raises(ValueError, match=r"--agent-env verifiers:.*nope\.py: no such taskset file"):
        parse_spec(f"verifiers:{tmp_path / 'nope.py'}")


def test_an_unbounded_taskset_is_loaded_once():
    """An unbounded taskset (a generator, as verifiers' seeded TextArena games: each load makes the game) is iterated
    once: task i is the generator's i-th, however the indices come, and a generator that ends is named."""
    from slime_rl.rollout.agent.verifiers_env import VerifiersAgent

    class Generated:
        bounded = False
        loads = 0

        def __iter__(self):
            Generated.loads += 1
            return iter(range(100, 110))

    agent = object.__new__(VerifiersAgent)
    agent.spec, agent.bounded, agent._tasks, agent._stream, agent._seen = "verifiers:gen", False, None, None, []
    agent.env = SimpleNamespace(taskset=Generated())
    assert [agent.task(i) for i in (0, 3, 1, 3, 9, 2)] == [100, 103, 101, 103, 109, 102]
    assert Generated.loads == 1
    with pytest.raises(ValueError, match=r"verifiers:gen: the taskset ended after 10 task\(s\) .* task 10 was asked"):
        agent.task(10)
