"""The calculator example of --custom-generate-function-path, loaded by dotted path and run against a
real embedded engine. The tiny model is random, so its first turn is scripted (it "writes"
`<calc>2+3</calc>`); the environment's `<result>5</result>` and the model's second turn are real,
and the response's tokens, loss mask and log-probs are checked exactly, the second turn's log-probs
against a float64 forward over prompt + call + result (so the engine saw that context)."""

from __future__ import annotations

import pytest
import torch
from rollout_testlib import float64_model, start_server, with_clients

from slime_rl.config import RolloutConfig
from slime_rl.config.dotted_path import PluginLoadError
from slime_rl.data import PromptRow
from slime_rl.rollout.custom import generate_default, load_filter, load_generate_function
from slime_rl.rollout.examples import calculator
from slime_rl.rollout.generate import generate_groups
from slime_rl.rollout.options import RolloutOptions
from slime_rl.rollout.partial import TRUNCATED, status, token_versions
from slime_rl.rollout.routing import ClientPool

PATH = "slime_rl.rollout.examples.calculator.generate"
ATOL = 1e-5  # float32 engine vs float64 reference on a short sequence (see tests/engines)
SCRIPTED_LP = -0.25


@pytest.fixture(scope="module")
def server(calc_model):
    s = start_server(calc_model, random_seed=5, max_running_requests=8)
    yield s
    s.shutdown()


class ScriptedFirstTurn(ClientPool):
    """The first /generate answers a scripted model turn ending in a tool call; later ones go to the
    engine. Records every request's input_ids and sampling_params."""

    def __init__(self, clients, tokenizer, call_ids: list[int]) -> None:
        super().__init__(clients, tokenizer)
        self.call_ids, self.requests, self.answers = call_ids, [], []

    async def generate(self, sample, input_ids, sampling_params):
        self.requests.append((list(input_ids), dict(sampling_params)))
        if len(self.requests) == 1:
            out = {"text": "<calc>2+3", "output_ids": self.call_ids, "meta_info": {
                "finish_reason": {"type": "stop", "matched": "</calc>"}, "weight_version": "default",
                "output_token_logprobs": [[SCRIPTED_LP, t, None] for t in self.call_ids]}}
        else:
            out = await super().generate(sample, input_ids, sampling_params)
        self.answers.append(out)
        return out


def test_calculate_is_arithmetic_only():
    assert [calculator.calculate(e) for e in ("2+3", "7*6", " 9 - 4 ", "8/2", "7/2", "-3*2", "7//2")] == \
        ["5", "42", "5", "4", "3.5", "-6", "3"]
    for bad in ("1/0", "__import__('os')", "x+1", "2**8", "", "1;2"):
        assert calculator.calculate(bad) == "error", bad
    stop = {"type": "stop", "matched": "</calc>"}
    assert calculator.pending_call("so <calc>1+1</calc> then <calc>2+3</calc>", stop) == "2+3"
    assert calculator.pending_call("<calc>2+3</calc>", {"type": "length"}) is None
    assert calculator.pending_call("<calc>2+3</calc>", {"type": "stop", "matched": 61}) is None  # EOS


def test_loaded_by_dotted_path():
    assert load_generate_function(PATH) is calculator.generate
    assert load_generate_function(None) is generate_default
    with pytest.raises(ValueError, match="--custom-generate-function-path .* must be an `async def`"):
        load_generate_function("slime_rl.rollout.examples.calculator.calculate")
    with pytest.raises(PluginLoadError, match="--custom-generate-function-path .*cannot import module"):
        load_generate_function("slime_rl.rollout.examples.nowhere.generate")
    with pytest.raises(PluginLoadError, match="--dynamic-sampling-filter-path .*has no function 'nope'"):
        load_filter("slime_rl.rollout.examples.calculator:nope")


def test_tool_call_turns_bookkeeping(server, calc_model):
    tok = server.tokenizer
    call = tok.encode("<calc>2+3</calc>", add_special_tokens=False)
    result = tok.encode("<result>5</result>", add_special_tokens=False)
    assert tok.decode(call) == "<calc>2+3</calc>" and tok.decode(result) == "<result>5</result>"
    prompt = tok.encode("The answer is", add_special_tokens=False)
    budget = 24
    cfg = RolloutConfig(n_samples_per_prompt=1, max_response_len=budget, temperature=0.0)
    opts = RolloutOptions.from_config(cfg, custom_generate_function_path=PATH,
                                      extra_sampling_params={"ignore_eos": True})

    async def body(clients):
        pool = ScriptedFirstTurn(clients, tok, call)
        groups = await generate_groups(clients, [PromptRow("The answer is", prompt, "5", {})], cfg,
                                       lambda s: float("<result>5</result>" in s.response), tok,
                                       progress=False, options=opts, pool=pool)
        return groups[0][0], pool

    s, pool = with_clients([server.url], body)
    assert len(pool.requests) == 2  # scripted call turn, then one real turn that runs out of budget
    second_input, second_params = pool.requests[1]
    assert second_input == prompt + call + result
    assert second_params["max_new_tokens"] == budget - len(call) - len(result)
    assert "</calc>" in second_params["stop"] and second_params["temperature"] == 0.0
    turn2 = pool.answers[1]["output_ids"]
    assert len(turn2) == budget - len(call) - len(result)  # ignore_eos: the turn fills the budget

    assert s.response_ids == call + result + turn2 and s.response_length == budget
    assert s.loss_mask == [1] * len(call) + [0] * len(result) + [1] * len(turn2)
    lp2 = [e[0] for e in pool.answers[1]["meta_info"]["output_token_logprobs"]]
    assert s.rollout_logprobs == [SCRIPTED_LP] * len(call) + [0.0] * len(result) + lp2
    assert token_versions(s) == ["default"] * len(call) + [None] * len(result) + ["default"] * len(turn2)
    assert s.metadata["tool_calls"] == 1 and status(s) == TRUNCATED and s.reward == 1.0
    assert s.response.startswith("<calc>2+3</calc><result>5</result>")

    ref = reference_turn(float64_model(calc_model), prompt + call + result, turn2)
    torch.testing.assert_close(torch.tensor(lp2, dtype=torch.float64), ref, atol=ATOL, rtol=0)


def reference_turn(model64, context: list[int], turn: list[int]) -> torch.Tensor:
    """Greedy (temperature 0 = softmax at T=1): log-probs of `turn` after `context`, and each token
    must be the argmax, or the engine continued from a different context."""
    ids = torch.tensor([context + turn])
    with torch.no_grad():
        logits = model64(input_ids=ids).logits[0, len(context) - 1:-1].double()
    assert logits.argmax(-1).tolist() == turn
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(turn)[:, None]).squeeze(1)


def test_env_output_cut_to_the_budget(server):
    tok = server.tokenizer
    call = tok.encode("<calc>7*6</calc>", add_special_tokens=False)
    result = tok.encode("<result>42</result>", add_special_tokens=False)
    budget = len(call) + 3  # room for 3 of the result's tokens and nothing after

    async def body(clients):
        pool = ScriptedFirstTurn(clients, tok, call)
        groups = await generate_groups(clients, [PromptRow("p", [5, 6], None, {})],
                                       RolloutConfig(max_response_len=budget), lambda s: 0.0, tok, progress=False,
                                       generate_fn=calculator.generate, pool=pool)
        return groups[0][0], pool

    s, pool = with_clients([server.url], body)
    assert len(pool.requests) == 1  # no room for another model turn
    assert s.response_ids == call + result[:3] and s.loss_mask == [1] * len(call) + [0] * 3
    assert status(s) == TRUNCATED and s.finish_reason == "length"
