"""A harness written with the `openai` client alone, as any agent framework calls a model (nothing of slime_rl
is imported): two turns, the second asking the model to check its answer; the reward is the digit task's
(1 when the first digit of the last answer is the label), computed here."""

from __future__ import annotations

import re


async def agent(client, sample) -> float:
    messages = [{"role": "user", "content": sample.prompt}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Check it."}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    digit = re.search(r"\d", second.choices[0].message.content or "")
    return float(digit is not None and digit.group() == str(sample.label))
