"""Agents through the OpenAI endpoint against a real built-in engine (in this process): a harness written
with the `openai` client only, three turns with a tool result and a user turn in between. The sample is
checked against what the engine answered and what the chat template renders, derived here: its tokens
are the first request's rendering, each answer's ids as the engine gave them, and only the template's
text between them; the loss mask is 1 exactly on the answers' ids; every rollout log-prob is the model's
(float64 reference over the whole trajectory), so each turn was generated from exactly these tokens."""

from __future__ import annotations

import asyncio
import json
import shutil

import openai
import pytest
import torch
from rollout_testlib import float64_model, reference_logprobs, start_server

from slime_rl.data import Sample
from slime_rl.engines.client import AsyncEngineClient
from slime_rl.rollout.agent.toolcalls import parse_tool_calls, template_messages
from slime_rl.rollout.agent.trajectory import _same_message, render
from slime_rl.rollout.custom import load_generate_function
from slime_rl.rollout.partial import COMPLETED, STATUS, TRUNCATED
from slime_rl.rollout.routing import ClientPool

# Qwen2.5's tool format (system block listing the tools in <tools>, assistant calls in <tool_call>, tool
# results as a user turn in <tool_response>), with a shorter preamble: the tiny model's context is the limit
QWEN_TOOL_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}{% for tool in tools %}{{ '\\n' }}"
    "{{ tool | tojson }}{% endfor %}{{ '\\n</tools><|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' or message.role == 'system' or (message.role == 'assistant' and not "
    "message.tool_calls) %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{% elif message.role == 'assistant' %}{{ '<|im_start|>assistant' }}{% if message.content %}"
    "{{ '\\n' + message.content }}{% endif %}{% for call in message.tool_calls %}"
    "{% if call.function is defined %}{% set call = call.function %}{% endif %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}{{ call.arguments | tojson }}"
    "{{ '}\\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% elif message.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{ '<|im_start|>user' }}{% endif %}{{ '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def tool_model(tiny_qwen2, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_qwen2_tools") / "model"
    shutil.copytree(tiny_qwen2, out)
    (out / "chat_template.jinja").write_text(QWEN_TOOL_TEMPLATE)  # transformers reads it before tokenizer_config's
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def server(tool_model):
    s = start_server(tool_model, random_seed=5, max_running_requests=64)
    yield s
    s.shutdown()


@pytest.fixture(scope="module")
def tok(tool_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tool_model)


def run_agents(server, tok, agent, samples, max_new_tokens=160, timeout_s=None):
    async def main():
        client = AsyncEngineClient(server.url, timeout=120)
        pool = ClientPool([client], tok, per_engine=64)
        gen = load_generate_function(f"{agent.__module__}:{agent.__name__}") if isinstance(agent, str) else None
        gen = gen or _as_generate(agent, timeout_s)
        params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": max_new_tokens}
        try:
            return await asyncio.gather(*(gen(s, params, pool) for s in samples))
        finally:
            await pool.aclose()
            await client.aclose()
    return asyncio.run(main())


def _as_generate(fn, timeout_s=None):
    from slime_rl.rollout.agent.runner import AgentGenerate

    return AgentGenerate(fn, fn.__name__, timeout_s)


def new_sample(i=0, prompt="add 2 and 3"):
    return Sample(index=i, group_index=i, prompt=prompt, prompt_ids=[])


def test_three_turns_are_recorded_token_for_token(server, tok, tool_model):
    answers, conversations = [], []

    async def agent(client, sample):  # only the openai client: what any harness does
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": sample.prompt}]
        for turn in range(3):
            conversations.append([dict(m) for m in messages])
            r = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=12,
                                                     logprobs=True, extra_body={"return_token_ids": True})
            answers.append(r)
            messages.append(r.choices[0].message.model_dump(exclude_none=True))  # the harness's echo
            if turn == 0:
                messages.append({"role": "tool", "tool_call_id": "call_0", "content": "5"})
            else:
                messages.append({"role": "user", "content": "and now?"})
        return 0.5

    (sample,) = run_agents(server, tok, agent, [new_sample()])
    assert sample.reward == 0.5 and sample.metadata["agent_turns"] == 3 and "agent_error" not in sample.metadata
    turns = [a.choices[0].token_ids for a in answers]
    assert all(turns)
    # the prompt: the first request rendered by the template with the generation prompt, tokenized
    first = tok.apply_chat_template(conversations[0], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert sample.prompt_ids == tok.encode(first, add_special_tokens=False)
    # between two answers: the template's text of the longer conversation after the shorter one and the answer
    # (the answer's raw text; the template's end of turn after it), tokenized; nothing else
    expected, mask = [], []
    for k, ids in enumerate(turns):
        expected += ids
        mask += [1] * len(ids)
        if k + 1 < len(turns):
            before = tok.apply_chat_template(conversations[k], tools=TOOLS, tokenize=False, add_generation_prompt=True)
            raw = tok.decode(ids, skip_special_tokens=False)
            after = tok.apply_chat_template(_with_raw_answer(conversations[k + 1], raw), tools=TOOLS, tokenize=False,
                                            add_generation_prompt=True)
            assert after.startswith(before + raw.removesuffix("<|im_end|>"))
            env = tok.encode(after[len(before) + len(raw):], add_special_tokens=False)
            expected += env
            mask += [0] * len(env)
    assert sample.response_ids == expected
    assert sample.loss_mask == mask
    # each answer's ids were generated from exactly the sample's tokens before them: its log-probs are the
    # model's in that context (float64 reference over the whole trajectory)
    ref = reference_logprobs(float64_model(tool_model), sample.prompt_ids, sample.response_ids)
    got = torch.tensor(sample.rollout_logprobs, dtype=torch.float64)
    on = torch.tensor(mask, dtype=torch.bool)
    assert torch.allclose(got[on], ref[on], atol=1e-4), (got[on] - ref[on]).abs().max()
    assert (got[~on] == 0).all()
    # and the log-probs the harness was given are those
    given = [lp.logprob for a in answers for lp in a.choices[0].logprobs.content]
    assert given == got[on].tolist()
    assert sample.metadata[STATUS] in (COMPLETED, TRUNCATED)


def _with_raw_answer(conversation, raw):
    """`conversation` (the next request's) with the previous answer's content replaced by its raw sampled text
    (what the model wrote, up to the end-of-turn token), as the template would render the true history."""
    out = [dict(m) for m in conversation]
    k = max(i for i, m in enumerate(out) if m["role"] == "assistant")
    out[k] = {"role": "assistant", "content": raw.removesuffix("<|im_end|>")}
    return out


def test_an_edited_history_branches_and_the_sample_keeps_its_exact_part(server, tok):
    seen = {}

    async def agent(client, sample):
        messages = [{"role": "user", "content": "count to three"}]
        r = await client.chat.completions.create(model="p", messages=messages, max_tokens=6)
        seen["after_first"] = (list(sample.prompt_ids), list(sample.response_ids))
        # the harness rewrites its own first message: what the engine saw is no longer this conversation
        messages = [{"role": "user", "content": "count to four"}, r.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": "go on"}]
        r2 = await client.chat.completions.create(model="p", messages=messages, max_tokens=6)
        assert r2.choices[0].finish_reason in ("stop", "length")  # answered all the same
        return 1.0

    (sample,) = run_agents(server, tok, agent, [new_sample()])
    assert sample.metadata["agent_branched"] is True
    assert (sample.prompt_ids, sample.response_ids) == seen["after_first"]  # nothing of the branch recorded
    assert sample.reward == 1.0 and sample.loss_mask == [1] * len(sample.response_ids)


def test_the_budget_covers_model_and_environment_tokens(server, tok):
    """--rollout-max-response-len 10: a long tool result cannot fit; the sample is cut there, truncated, and
    the next answer is "length" with no content."""
    finishes = []

    async def agent(client, sample):
        messages = [{"role": "user", "content": "hi"}]
        for _ in range(3):
            r = await client.chat.completions.create(model="p", messages=messages, max_tokens=4)
            finishes.append((r.choices[0].finish_reason, r.choices[0].message.content))
            messages += [r.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "a long answer from the environment " * 3}]
        return 0.0

    (sample,) = run_agents(server, tok, agent, [new_sample()], max_new_tokens=10)
    assert len(sample.response_ids) == 10 and sample.metadata[STATUS] == TRUNCATED
    assert sample.finish_reason == "length"
    assert finishes[1:] == [("length", ""), ("length", "")]  # the environment's text filled the budget


def test_256_trajectories_none_lost_none_mixed_failures_alone(server, tok):
    """256 agents at once, two turns each; every tenth raises after its first turn. Each sample holds its own
    conversation (the prompt names the sample), the failed ones fail alone."""
    async def agent(client, sample):
        messages = [{"role": "user", "content": f"task {sample.index}"}]
        r = await client.chat.completions.create(model="p", messages=messages, max_tokens=3)
        if sample.index % 10 == 3:
            raise RuntimeError(f"environment {sample.index} broke")
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        await client.chat.completions.create(model="p", messages=messages, max_tokens=3)
        return float(sample.index)

    samples = run_agents(server, tok, agent, [new_sample(i, prompt=f"task {i}") for i in range(256)])
    assert [s.index for s in samples] == list(range(256))
    for s in samples:
        assert tok.decode(s.prompt_ids).endswith(f"task {s.index}<|im_end|>\n<|im_start|>assistant\n")
        if s.index % 10 == 3:
            assert s.metadata["agent_error"] == f"RuntimeError: environment {s.index} broke"
            assert s.finish_reason == "failed" and s.loss_mask == [0] * len(s.response_ids) and s.reward == 0.0
        else:
            assert "agent_error" not in s.metadata and s.reward == float(s.index)
            assert s.metadata["agent_turns"] == 2 and 1 in s.loss_mask and 0 in s.loss_mask
            assert "more<|im_end|>" in tok.decode(s.response_ids, skip_special_tokens=False)


def test_endpoint_errors_are_openai_errors(server, tok):
    """Unknown trajectory 404; a body it cannot take 400 naming the field; the harness's own exception
    (openai's error classes) carries them."""
    async def agent(client, sample):
        import httpx

        base = str(client.base_url).rstrip("/")
        async with httpx.AsyncClient() as http:
            wrong = await http.post(base.replace(base.split("/")[-2], "nope") + "/chat/completions", json={})
            assert wrong.status_code == 404 and wrong.json()["error"]["type"] == "not_found_error"
            models = await http.get(base + "/models")
            assert models.json()["data"][0]["id"] == "policy"
        for bad, param in (({"messages": []}, "messages"), ({"n": 2}, "n"), ({"stop": 3}, "stop"),
                           ({"max_tokens": 0}, "max_tokens"), ({"stream": "yes"}, "stream"),
                           ({"stream_options": 1}, "stream_options")):
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}],
                                                     extra_body=bad)
            assert err.value.param == param, err.value.body
        r = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        return float(len(r.choices[0].message.content or "") >= 0)

    (sample,) = run_agents(server, tok, agent, [new_sample()])
    assert sample.reward == 1.0 and sample.metadata["agent_turns"] == 1


def test_tool_calls_in_qwen_syntax_become_openai_tool_calls_and_back():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    content, calls = parse_tool_calls(text, "c")
    assert content == "Let me add."
    assert calls == [{"id": "c_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]
    # two calls, arguments written as a JSON string, and a broken block that stays text
    text = ('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call><tool_call>{oops}</tool_call>'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "<tool_call>{oops}</tool_call>"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("a", {"x": 1}),
                                                                                                ("b", {})]
    assert parse_tool_calls("no calls") == ("no calls", [])
    # OpenAI's wire form (arguments as a string) -> the template's (an object); content None -> ''
    wire = {"role": "assistant", "content": None, "tool_calls": calls[:1]}
    assert template_messages([wire])[0] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "a", "arguments": {"x": 1}}}]}
    # the harness's echo is the same message whatever the arguments' spacing or the ids
    echo = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "other", "type": "function", "function": {"name": "a", "arguments": '{"x":1}'}}]}
    assert _same_message(echo, wire)
    assert not _same_message({**echo, "content": "edited"}, wire)
    assert not _same_message({"role": "assistant", "content": ""}, wire)


def test_render_uses_the_tools(tok):
    with_tools = render(tok, [{"role": "user", "content": "x"}], TOOLS, True)
    assert with_tools.startswith("<|im_start|>system\n# Tools\n<tools>\n{") and '"name": "add"' in with_tools
    assert render(tok, [{"role": "user", "content": "x"}], None, True) == "<|im_start|>user\nx<|im_end|>\n" \
        "<|im_start|>assistant\n"


class CountingEnv:
    """A Gymnasium-style text environment written here: asks for the next number three times; reward 1 per
    step whose answer contains a digit, done after the third step."""

    def __init__(self, sample):
        self.steps, self.sample = 0, sample

    def reset(self):
        return f"count from {self.sample.index}"

    async def step(self, action):  # async and sync methods both work
        self.steps += 1
        reward = float(any(c.isdigit() for c in action))
        return f"next {self.steps}", reward, self.steps == 3


def test_a_text_environment_plays_through_the_endpoint(server, tok):
    from slime_rl.rollout.agent.envs import env_agent

    agent = env_agent(CountingEnv, max_turns=5, turn_max_tokens=8)
    samples = run_agents(server, tok, agent, [new_sample(i) for i in range(4)], max_new_tokens=200)
    for s in samples:
        text = tok.decode(s.tokens, skip_special_tokens=False)
        assert tok.decode(tok.encode(f"count from {s.index}")) in text  # the first observation is the prompt
        assert s.metadata["agent_turns"] == 3 and s.metadata["agent_env_done"] is True  # done after 3 steps
        assert [tok.decode(tok.encode(f"next {k}")) in text for k in (1, 2, 3)] == [True, True, False]
        assert 0.0 <= s.reward <= 3.0 and s.reward == int(s.reward)
    # max_turns caps an episode that never ends
    capped = env_agent(lambda sample: CountingEnv(sample), max_turns=2, turn_max_tokens=8)
    (s,) = run_agents(server, tok, capped, [new_sample(9)], max_new_tokens=200)
    assert s.metadata["agent_turns"] == 2 and s.metadata["agent_env_done"] is False


def test_textarena_games_are_one_episode_per_sample_the_same_for_a_group(server, tok):
    """--agent-env textarena:GuessTheNumber-v0: the game's prompt is the first user turn, its hints the next
    ones; the samples of a group play the same number (reset with the group's seed), other groups others."""
    from types import SimpleNamespace

    from slime_rl.rollout.agent.envs import TextArenaEnv
    from slime_rl.rollout.custom import rollout_generate_function

    gen = rollout_generate_function(SimpleNamespace(agent_env="textarena:GuessTheNumber-v0", agent_max_turns=3,
                                                    agent_turn_max_tokens=8, custom_generate_function_path=None))
    samples = [Sample(index=i, group_index=i // 2, prompt="", prompt_ids=[]) for i in range(4)]

    async def main():
        client = AsyncEngineClient(server.url, timeout=120)
        pool = ClientPool([client], tok, per_engine=64)
        params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 400}
        try:
            return await asyncio.gather(*(gen(s, params, pool) for s in samples))
        finally:
            await pool.aclose()
            await client.aclose()

    samples = asyncio.run(main())
    prompt = tok.decode(tok.encode("You are Player 0. You are playing Guess The Number."))
    for s in samples:
        assert prompt in tok.decode(s.prompt_ids) and "agent_error" not in s.metadata
        assert 1 <= s.metadata["agent_turns"] <= 3 and 0.0 <= s.reward <= 1.0
    assert [s.metadata["agent_env_seed"] for s in samples] == [0, 0, 1, 1]  # a group's seed: its index

    def number(seed):  # the number TextArena draws for a seed: the same every time, another for another seed
        env = TextArenaEnv("GuessTheNumber-v0", seed)
        env.reset()
        return env.env.game_number
    assert number(0) == number(0) != number(1)



def test_agent_env_flags_are_checked_before_anything_starts(tmp_path):
    from slime_rl.config import ConfigError, build_config
    from slime_rl.rollout.custom import rollout_generate_function

    base = ["--hf-checkpoint", str(tmp_path), "--prompt-data", str(tmp_path / "d.jsonl"), "--rollout-batch-size", "2",
            "--num-rollout", "1"]
    with pytest.raises(ConfigError, match="--agent-env textarena:X and --custom-generate-function-path m:f both"):
        build_config(base + ["--agent-env", "textarena:X", "--custom-generate-function-path", "m:f"],
                     check_paths=False)
    cfg = build_config(base + ["--agent-env", "textarena:NoSuchGame-v0"], check_paths=False)  # no reward flag needed
    with pytest.raises(ValueError, match="--agent-env textarena:NoSuchGame-v0: TextArena has no game"):
        rollout_generate_function(cfg.rollout)
    with pytest.raises(ConfigError, match="--agent-max-turns"):
        build_config(base + ["--agent-env", "textarena:X", "--agent-max-turns", "0"], check_paths=False)
    with pytest.raises(ConfigError, match="--agent-timeout-s"):
        build_config(base + ["--agent-env", "textarena:X", "--agent-timeout-s", "0"], check_paths=False)
    # the timeout reaches the runner, for an --agent-env episode and for an agent function alike
    timed = build_config(base + ["--agent-env", "textarena:GuessTheNumber-v0", "--agent-timeout-s", "90"],
                         check_paths=False)
    assert rollout_generate_function(timed.rollout).timeout_s == 90.0
    timed = build_config(base + ["--custom-generate-function-path", "tests.plugins.openai_agent:agent",
                                 "--agent-timeout-s", "30", "--rm-type", "digit"], check_paths=False)
    assert rollout_generate_function(timed.rollout).timeout_s == 30.0


def test_a_trajectory_the_rollout_stops_is_aborted_not_failed(server, tok):
    """The rollout stops the pool after the first answer (its batch is full): the agent's next request gets
    openai's 503 error; whether the agent raises or carries on, the sample is ABORTED with its first turn (a
    partial rollout would start it again), neither failed nor scored."""
    from slime_rl.rollout.partial import ABORTED
    pools = []

    async def agent(client, sample):
        r = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "a"}], max_tokens=3)
        pools[0].stop()
        messages = [{"role": "user", "content": "a"}, r.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": "b"}]
        try:
            await client.chat.completions.create(model="p", messages=messages, max_tokens=3)
        except openai.APIStatusError as exc:
            assert exc.status_code == 503
            if sample.index == 0:
                raise
        return 1.0

    async def main():
        client = AsyncEngineClient(server.url, timeout=120)
        gen = _as_generate(agent)
        params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 50}
        out = []
        try:
            for i in range(2):  # the agent raises (0) or carries on (1); a pool of its own each
                pools[:] = [ClientPool([client], tok, per_engine=64)]
                out.append(await gen(new_sample(i), params, pools[0]))
                await pools[0].aclose()
            return out
        finally:
            await client.aclose()

    for s in asyncio.run(main()):
        assert s.metadata[STATUS] == ABORTED and s.reward is None and "agent_error" not in s.metadata
        # its one answer (trained) and the user turn of the request that was cut (not)
        assert s.metadata["agent_turns"] == 1 and s.loss_mask[0] == 1 and s.loss_mask[-1] == 0


def test_completions_api_turns_are_recorded_token_for_token(server, tok, tool_model):
    """/v1/completions (OpenAI's legacy text API, with the openai client): a text prompt, then the same text with
    the answer and new text; then token ids that extend the sample. The sample is the first prompt tokenized, each
    answer's ids as the engine gave them, and only the new text (or ids) between them (loss mask 0); every answer
    log-prob is the model's over the whole trajectory (float64), and the harness got those log-probs."""
    seen = {}

    async def agent(client, sample):
        first = "<|im_start|>user\nadd 2 and 3<|im_end|>\n<|im_start|>assistant\n"
        r1 = await client.completions.create(model="policy", prompt=first, max_tokens=6, logprobs=1,
                                             extra_body={"return_token_ids": True})
        second = first + r1.choices[0].text + "\nagain: "
        r2 = await client.completions.create(model="policy", prompt=second, max_tokens=5, logprobs=1,
                                             extra_body={"return_token_ids": True})
        ids = r2.model_extra["prompt_token_ids"] + r2.choices[0].token_ids + [7, 11]
        r3 = await client.completions.create(model="policy", prompt=ids, max_tokens=4, logprobs=1,
                                             extra_body={"return_token_ids": True})
        seen.update(first=first, answers=[r1, r2, r3])
        return 1.0

    (sample,) = run_agents(server, tok, agent, [new_sample()])
    assert sample.reward == 1.0 and "agent_branched" not in sample.metadata, sample.metadata
    r1, r2, r3 = seen["answers"]
    assert sample.prompt_ids == tok.encode(seen["first"])
    a1, a2, a3 = (r.choices[0].token_ids for r in (r1, r2, r3))
    env1 = tok.encode("\nagain: ", add_special_tokens=False)
    assert sample.response_ids == a1 + env1 + a2 + [7, 11] + a3
    assert sample.loss_mask == [1] * len(a1) + [0] * len(env1) + [1] * len(a2) + [0, 0] + [1] * len(a3)
    assert r3.model_extra["prompt_token_ids"] == sample.prompt_ids + a1 + env1 + a2 + [7, 11]
    ref = reference_logprobs(float64_model(tool_model), sample.prompt_ids, sample.response_ids)
    got = torch.tensor(sample.rollout_logprobs, dtype=torch.float64)
    on = torch.tensor(sample.loss_mask, dtype=torch.bool)
    assert torch.allclose(got[on], ref[on], atol=1e-4), (got[on] - ref[on]).abs().max()
    assert [x for r in (r1, r2, r3) for x in r.choices[0].logprobs.token_logprobs] == got[on].tolist()
    assert r1.object == "text_completion" and r1.choices[0].finish_reason in ("stop", "length")


def test_completions_that_do_not_extend_branch_and_apis_do_not_mix(server, tok):
    seen = {}

    async def agent(client, sample):
        r = await client.completions.create(model="p", prompt="count: 1", max_tokens=4)
        seen["kept"] = list(sample.response_ids)
        await client.completions.create(model="p", prompt="count: 2", max_tokens=4)  # another text: a branch
        try:
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        except openai.BadRequestError as exc:
            seen["mixed"] = str(exc)
        return float(len(r.choices[0].text) >= 0)

    (sample,) = run_agents(server, tok, agent, [new_sample()])
    assert sample.metadata["agent_branched"] is True and sample.response_ids == seen["kept"]
    assert "one trajectory uses one of the two APIs" in seen["mixed"]


def test_streamed_answers_join_to_the_recorded_turns(server, tok, tool_model):
    """stream: true, chat and completions: the chunks, joined by the openai SDK's own stream accumulator,
    give the content, token ids and log-probs the sample recorded for that turn; usage comes last when asked."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    streamed = {}

    async def chat_agent(client, sample):
        state, usage, chunks = ChatCompletionStreamState(), None, []
        stream = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": sample.prompt}], max_tokens=10, stream=True,
            logprobs=True, stream_options={"include_usage": True}, extra_body={"return_token_ids": True})
        async for chunk in stream:
            chunks.append(chunk)
            if chunk.choices:
                state.handle_chunk(chunk)
            usage = chunk.usage or usage
        # the snapshot: get_final_completion refuses a "length" finish (the tiny model rarely ends a turn itself)
        streamed["chat"] = (state.current_completion_snapshot, usage, chunks)
        return 1.0

    async def text_agent(client, sample):
        stream = await client.completions.create(model="policy", prompt=sample.prompt, max_tokens=10, stream=True,
                                                 logprobs=1)
        streamed["text"] = [chunk async for chunk in stream]
        return 1.0

    chat_sample, text_sample = run_agents(server, tok, chat_agent, [new_sample(0)]) + run_agents(
        server, tok, text_agent, [new_sample(1, "count: 1 2 3")])
    final, usage, chunks = streamed["chat"]
    n = len(chat_sample.response_ids)
    assert n > 0 and chat_sample.loss_mask == [1] * n
    assert final.choices[0].message.content == tok.decode(chat_sample.response_ids, skip_special_tokens=True)
    assert [c.logprob for c in final.choices[0].logprobs.content] == pytest.approx(chat_sample.rollout_logprobs)
    assert chunks[0].choices[0].model_extra["token_ids"] == chat_sample.response_ids
    assert final.choices[0].finish_reason in ("stop", "length")
    assert usage.completion_tokens == n and usage.prompt_tokens == len(chat_sample.prompt_ids)
    assert chunks[-1].choices == [] and chunks[-2].choices[0].finish_reason == final.choices[0].finish_reason
    text = streamed["text"]
    m = len(text_sample.response_ids)
    assert m > 0 and "".join(c.choices[0].text for c in text) == tok.decode(text_sample.response_ids,
                                                                            skip_special_tokens=True)
    assert [lp for c in text if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs] == \
        pytest.approx(text_sample.rollout_logprobs)
    assert text[-1].choices[0].finish_reason in ("stop", "length") and text[0].choices[0].finish_reason is None


def test_streamed_tool_calls_are_rebuilt_by_the_sdk():
    """A chat answer with tool calls as chunks (`stream_chunks`): the openai SDK's accumulator gives back the
    same message, tool calls (ids, names, arguments) and finish reason."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    from slime_rl.rollout.agent.endpoint import stream_chunks

    calls = [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
             {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 5, "b": 1}'}}]
    answer = {"id": "chatcmpl-1", "object": "chat.completion", "created": 7, "model": "policy",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "adding", "tool_calls": calls},
                           "finish_reason": "tool_calls", "logprobs": None}],
              "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}}
    state = ChatCompletionStreamState()
    for chunk in stream_chunks(answer):
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    final = state.get_final_completion()
    message = final.choices[0].message
    assert message.content == "adding" and final.choices[0].finish_reason == "tool_calls"
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls] == [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_an_agent_over_its_timeout_fails_alone_and_its_request_is_aborted(server, tok):
    """--agent-timeout-s: an agent whose request the engine does not answer in time (generation paused in place,
    so the request waits in the engine's queue) fails its own sample, with nothing of that turn recorded, and
    the engine is told to drop the request; the next agent, in time, is trained as usual."""
    async def agent(client, sample):
        r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": sample.prompt}],
                                                 max_tokens=6)
        return float(r.choices[0].finish_reason in ("stop", "length"))

    aborted = server.engine.stats["requests_aborted"]
    server.engine.pause("in_place")
    try:
        (late,) = run_agents(server, tok, agent, [new_sample(0)], timeout_s=1.0)
        assert server.engine.load()["num_waiting_reqs"] == 0  # the abort reached the engine before the pool closed
    finally:
        server.engine.resume()
    assert server.engine.stats["requests_aborted"] == aborted + 1
    assert late.finish_reason == "failed" and late.metadata["agent_timed_out"] is True
    assert "--agent-timeout-s 1" in late.metadata["agent_error"]
    assert late.response_ids == [] and late.loss_mask == [] and late.reward == 0.0
    (ok,) = run_agents(server, tok, agent, [new_sample(1)], timeout_s=60.0)
    assert ok.reward == 1.0 and "agent_error" not in ok.metadata and ok.loss_mask == [1] * len(ok.response_ids)


@pytest.mark.parametrize("host", ["0.0.0.0", "127.0.0.1"])
def test_the_endpoint_listens_where_agent_host_says(server, tok, host):
    """--agent-host 0.0.0.0: the endpoint takes connections on every interface and each base URL names this
    node's address (a harness on another node reaches it); the default 127.0.0.1 stays on loopback: the same
    request to the node's address is refused."""
    import ipaddress
    from urllib.parse import urlparse

    import httpx
    import ray

    from slime_rl.rollout.agent.endpoint import endpoint_of
    from slime_rl.rollout.agent.trajectory import Trajectory

    node = ray.util.get_node_ip_address()  # the node's address as Ray finds it, independently of ours
    assert not ipaddress.ip_address(node).is_loopback  # the machine has an address another node could use

    async def main():
        client = AsyncEngineClient(server.url, timeout=120)
        pool = ClientPool([client], tok, per_engine=4)
        try:
            endpoint = await endpoint_of(pool, host)
            url = endpoint.register(Trajectory(new_sample(), {"max_new_tokens": 4}, pool))
            assert urlparse(url).hostname == (node if host == "0.0.0.0" else "127.0.0.1")
            on_node = url.replace(f"//{urlparse(url).hostname}:", f"//{node}:")
            async with httpx.AsyncClient(timeout=30) as h:
                if host == "0.0.0.0":
                    r = await h.get(on_node + "/models")
                    assert r.status_code == 200 and r.json()["data"][0]["id"] == "policy"
                else:
                    with pytest.raises(httpx.ConnectError):
                        await h.get(on_node + "/models")
                    assert (await h.get(url + "/models")).status_code == 200
        finally:
            await pool.aclose()
            await client.aclose()
    asyncio.run(main())
