"""INSTRUCTION_DICT as IFBench's registry exposes it (id -> instruction class), with two test instructions."""

from __future__ import annotations


class KeywordTimes:
    """The response holds `keyword` exactly `times` times (keyword-only arguments: an unexpected one raises,
    as IFBench's classes do)."""

    def __init__(self, instruction_id: str) -> None:
        self.id = instruction_id
        self.keyword, self.times = None, None

    def build_description(self, *, keyword: str | None = None, times: int | None = None) -> str:
        self.keyword, self.times = keyword, 1 if times is None else times
        return f"Use {keyword} {self.times} times."

    def get_instruction_args(self) -> dict:
        return {"keyword": self.keyword, "times": self.times}

    def check_following(self, value: str) -> bool:
        return value.split().count(self.keyword) == self.times


class RepeatPrompt:
    """The response starts with the prompt (IFBench's repeat instructions take the prompt the same way: an
    argument named `prompt`, given by the evaluation after the row's own arguments)."""

    def __init__(self, instruction_id: str) -> None:
        self.id = instruction_id
        self.prompt = None

    def build_description(self, *, prompt: str | None = None) -> str:
        self.prompt = prompt
        return "Repeat the request first."

    def get_instruction_args(self) -> dict:
        return {"prompt": self.prompt}

    def check_following(self, value: str) -> bool:
        return self.prompt is not None and value.strip().startswith(self.prompt.strip())


INSTRUCTION_DICT = {"test:keyword_times": KeywordTimes, "test:repeat_prompt": RepeatPrompt}
