"""Prompt datasets: rows from a jsonl file -> tokenized prompts, drawn in (shuffled) order.

The position (epoch, offset) is plain data so a checkpoint can save it and a resumed run can
continue where it stopped.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_rl.config import DataConfig


class DataError(ValueError):
    """Bad input data; the message names the file and the row."""


@dataclass
class PromptRow:
    prompt: str
    prompt_ids: list[int]
    label: Any
    metadata: dict[str, Any]


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a jsonl file; a line that is not a JSON object raises naming the file and line."""
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}: row {lineno}: not valid JSON: {exc}") from exc
            if not isinstance(row, dict):
                raise DataError(f"{path}: row {lineno}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def render_prompt(raw: Any, tokenizer, apply_chat_template: bool) -> str:
    """The prompt text the engine sees: the raw string, or the chat template applied to it."""
    if not apply_chat_template:
        if not isinstance(raw, str):
            raise TypeError("a message list needs --apply-chat-template")
        return raw
    messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class PromptDataset:
    """Tokenized prompts of one jsonl file, validated at load (before any actor starts)."""

    def __init__(self, cfg: DataConfig, tokenizer) -> None:
        self.cfg = cfg
        self.rows: list[PromptRow] = []
        self.filtered_too_long = 0
        for lineno, row in enumerate(read_jsonl(cfg.prompt_data), 1):
            for key in (cfg.input_key, cfg.label_key):
                if key not in row:
                    raise DataError(f"{cfg.prompt_data}: row {lineno}: missing key '{key}' "
                                    f"(--input-key/--label-key); keys present: {sorted(row)}")
            raw = row[cfg.input_key]
            if not isinstance(raw, (str, list)) or not raw:
                raise DataError(f"{cfg.prompt_data}: row {lineno}: '{cfg.input_key}' must be a non-empty "
                                "string or message list")
            try:
                text = render_prompt(raw, tokenizer, cfg.apply_chat_template)
            except TypeError as exc:
                raise DataError(f"{cfg.prompt_data}: row {lineno}: {exc}") from exc
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if cfg.rollout_max_prompt_len is not None and len(ids) > cfg.rollout_max_prompt_len:
                self.filtered_too_long += 1
                continue
            meta = {k: v for k, v in row.items() if k not in (cfg.input_key, cfg.label_key)}
            self.rows.append(PromptRow(text, ids, row[cfg.label_key], meta))
        if not self.rows:
            raise DataError(f"{cfg.prompt_data}: every row is longer than --rollout-max-prompt-len")
        self.epoch = 0
        self.offset = 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(len(self.rows)))
        if self.cfg.rollout_shuffle:
            random.Random(self.cfg.seed + self.epoch).shuffle(order)
        return order

    def __len__(self) -> int:
        return len(self.rows)

    def next_batch(self, n: int) -> list[PromptRow]:
        """The next n prompts, wrapping into a new (reshuffled) epoch when the data runs out."""
        out = []
        while len(out) < n:
            if self.offset == len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._make_order()
            out.append(self.rows[self._order[self.offset]])
            self.offset += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = self._make_order()
