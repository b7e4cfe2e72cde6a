"""Prompt datasets: rows of a jsonl/json/parquet file -> tokenized prompts, drawn in (shuffled) order.

Every row is checked at load, before any actor starts: a missing `--input-key`/`--label-key`, a
prompt of the wrong type, an empty prompt or a malformed message list is reported with its row
place (line N of a jsonl file; all bad rows at once, the first few spelled out). Prompts longer than
`--rollout-max-prompt-len` tokens are dropped and counted (`filtered_too_long`). With a `TokenLimit`
(the model's context), a prompt the engine would refuse is a bad row too.

Rows with images (`--image-key`, vision-language models) are handled by `slime_rl.data.vl`: the
images are read, checked and resized at load too, and the prompt ids carry the expanded vision
tokens.

The position (epoch, offset) is plain data so a checkpoint can save it and a resumed run can
continue where it stopped.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slime_rl.config import DataConfig
from slime_rl.config.seeds import data_order_seed
from slime_rl.data.readers import DataError, Record, bad_rows_error, located_records, parse_data_spec, row_position
from slime_rl.data.vl import VisionRows

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenLimit:
    """The longest request an engine takes. SGLang (tokenizer_manager `_validate_one_request`, 0.5.23)
    refuses a request whose prompt has >= `context_len` tokens, or whose prompt plus `max_new_tokens`
    exceeds it; a prompt that would be refused when drawn is a bad row at load instead.
    `reserve`: the tokens a prompt must leave free: --rollout-max-response-len, or 1 where
    --rollout-max-context-len caps each request's max_new_tokens to what is left."""
    context_len: int
    reserve: int
    source: str  # where context_len comes from, for the message

    def problem(self, n_prompt: int) -> str | None:
        if n_prompt + self.reserve <= self.context_len:
            return None
        room = self.context_len - self.reserve
        return (f"the prompt has {n_prompt} tokens; with {self.reserve} for the response that exceeds the "
                f"context of {self.context_len} ({self.source}); drop such rows with --rollout-max-prompt-len "
                f"{room}" if room > 0 else f"the prompt has {n_prompt} tokens, more than the context of "
                f"{self.context_len} ({self.source}) leaves")


@dataclass
class PromptRow:
    prompt: str
    prompt_ids: list[int]
    label: Any
    metadata: dict[str, Any]
    # vision-language rows: PNG data URLs at their final size and one [t, h, w] patch grid per image;
    # prompt_ids hold grid_t*grid_h*grid_w/merge^2 <|image_pad|> ids per image (`prompt` holds one)
    images: list[str] = field(default_factory=list)
    image_grid_thw: list[list[int]] = field(default_factory=list)


def parse_chat_template_kwargs(value: str | dict[str, Any] | None) -> dict[str, Any]:
    """`--apply-chat-template-kwargs` (a JSON object, e.g. '{"enable_thinking": false}') -> a dict."""
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        return dict(value)
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise DataError(f"--apply-chat-template-kwargs {value!r}: not valid JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise DataError(f"--apply-chat-template-kwargs {value!r}: expected a JSON object")
    return parsed


def load_format_prompt(path: str | None) -> Any:
    """The compiled `--format-prompt` template, or None; a DataError names the flag and the file."""
    if not path:
        return None
    import jinja2

    try:
        source = Path(path).read_text(encoding="utf-8")
        return jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=False).from_string(source)
    except OSError as exc:
        raise DataError(f"--format-prompt {path}: cannot read it: {exc}") from exc
    except jinja2.TemplateError as exc:
        raise DataError(f"--format-prompt {path}: not a valid jinja2 template: {exc}") from exc


def apply_format_prompt(template: Any, raw: Any) -> Any:
    """A string prompt rendered as `content`; for a message list, its last user message's text."""
    import jinja2

    try:
        if isinstance(raw, str):
            return template.render(content=raw)
        last = max((i for i, m in enumerate(raw) if m.get("role") == "user" and isinstance(m.get("content"), str)),
                   default=None)
        if last is None:
            return raw
        return [dict(m, content=template.render(content=m["content"])) if i == last else m for i, m in enumerate(raw)]
    except jinja2.TemplateError as exc:
        raise ValueError(f"--format-prompt failed: {type(exc).__name__}: {exc}") from exc


def render_prompt(raw: Any, tokenizer: Any, apply_chat_template: bool, tools: list[dict] | None = None,
                  chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text the engine sees: the raw string, or the chat template applied to it.

    A string becomes one user message. `tools` and `chat_template_kwargs` (e.g. `enable_thinking`)
    go to the tokenizer's `apply_chat_template`, so the template decides how they are rendered.
    """
    if not apply_chat_template:
        if not isinstance(raw, str):
            raise TypeError("a message list needs --apply-chat-template")
        return raw
    messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
    kwargs = dict(chat_template_kwargs or {})
    if tools is not None:
        kwargs["tools"] = tools
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def _message_problem(messages: list[Any]) -> str | None:
    """Why a message list is unusable, or None when it is fine."""
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            return f"message {i} must be an object with 'role' and 'content', got {msg!r:.80}"
        if not isinstance(msg["role"], str) or not isinstance(msg["content"], (str, list)):
            return f"message {i}: 'role' must be a string and 'content' a string or list"
    if all(isinstance(m["content"], str) and not m["content"].strip() for m in messages):
        return "every message has empty content"
    return None


def _json_field(value: Any, want: type, what: str) -> Any:
    """A dict/list column, or the same stored as a JSON string (common in parquet files)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what} is a string that is not valid JSON: {exc}") from exc
    if not isinstance(value, want):
        raise ValueError(f"{what} must be a {want.__name__}, got {type(value).__name__}")
    return value


class PromptDataset:
    """Tokenized prompts of one data file, validated at load (before any actor starts).

    `cfg.prompt_data` may carry a row slice (`train.parquet@[:1000]`). Keyword arguments add what
    `DataConfig` does not hold: `metadata_key` (a dict column merged into each row's metadata),
    `tool_key` (a list of tool schemas passed to the chat template, also kept as metadata["tools"]),
    `chat_template_kwargs` (a dict or JSON string for `apply_chat_template`) and `image_processor`
    (for rows with images; default: the one saved next to the tokenizer). `label_check` (label ->
    what is wrong, or None; `rewards.labels.label_problem`) makes a label the reward cannot use a bad row.
    """

    def __init__(self, cfg: DataConfig, tokenizer: Any, metadata_key: str | None = None, tool_key: str | None = None,
                 chat_template_kwargs: dict[str, Any] | str | None = None, image_processor: Any = None,
                 token_limit: TokenLimit | None = None, label_check: Callable[[Any], str | None] | None = None) -> None:
        self.cfg = cfg
        # the flags (--metadata-key, --tool-key, --apply-chat-template-kwargs) unless given here
        self.metadata_key = metadata_key or cfg.metadata_key
        self.tool_key = tool_key or cfg.tool_key
        self.chat_template_kwargs = parse_chat_template_kwargs(chat_template_kwargs or cfg.chat_template_kwargs)
        self.format_prompt = load_format_prompt(cfg.format_prompt)
        self.rows: list[PromptRow] = []
        self.filtered_too_long = 0
        errors: list[str] = []
        structural: list[str] = []  # lines that are no record: reported with the other rows' errors, at once
        records = located_records(cfg.prompt_data, bad=structural)
        # image paths are relative to the data file; the image processor comes from the tokenizer's
        # checkpoint folder unless given (only looked up when some row has images)
        self.vision = VisionRows(cfg, tokenizer, Path(parse_data_spec(cfg.prompt_data)[0]).parent, image_processor)
        for where, record in records:
            try:
                row = self._make_row(record, tokenizer)
            except ValueError as exc:
                errors.append(f"{where}: {exc}")
                continue
            if cfg.rollout_max_prompt_len is not None and len(row.prompt_ids) > cfg.rollout_max_prompt_len:
                self.filtered_too_long += 1
                continue
            problem = token_limit.problem(len(row.prompt_ids)) if token_limit is not None else None
            if problem is None and label_check is not None:  # the reward type decides what a label must be
                label_problem = label_check(row.label)
                problem = None if label_problem is None else f"'{cfg.label_key}' (--label-key) {label_problem}"
            if problem is not None:
                errors.append(f"{where}: {problem}")
                continue
            self.rows.append(row)
        if errors or structural:
            raise bad_rows_error(cfg.prompt_data, sorted(structural + errors, key=row_position),
                                 len(records) + len(structural))
        if self.filtered_too_long:
            logger.info("%s: dropped %d of %d prompts longer than --rollout-max-prompt-len=%s", cfg.prompt_data,
                        self.filtered_too_long, len(records), cfg.rollout_max_prompt_len)
        if not self.rows:
            raise DataError(f"{cfg.prompt_data}: every row is longer than --rollout-max-prompt-len")
        self.epoch = 0
        self.offset = 0
        self._order = self._make_order()

    def _make_row(self, record: Record, tokenizer: Any) -> PromptRow:
        """One validated, rendered, tokenized row; a ValueError says what is wrong with it."""
        cfg = self.cfg
        for key, flag in ((cfg.input_key, "--input-key"), (cfg.label_key, "--label-key")):
            if key not in record:
                raise ValueError(f"missing key '{key}' ({flag}); keys present: {sorted(record)}")
        raw = record[cfg.input_key]
        if isinstance(raw, str):
            if not raw.strip():
                raise ValueError(f"'{cfg.input_key}' is an empty prompt")
        elif isinstance(raw, list):
            if not raw:
                raise ValueError(f"'{cfg.input_key}' is an empty message list")
            problem = _message_problem(raw)
            if problem is not None:
                raise ValueError(f"'{cfg.input_key}': {problem}")
            if not cfg.apply_chat_template:
                raise ValueError(f"'{cfg.input_key}' is a message list, which needs --apply-chat-template")
        else:
            raise ValueError(f"'{cfg.input_key}' must be a string or a message list, got {type(raw).__name__}")

        skip = {cfg.input_key, cfg.label_key, self.metadata_key, self.tool_key, cfg.image_key}
        metadata = {k: v for k, v in record.items() if k not in skip}
        if self.metadata_key is not None and record.get(self.metadata_key) is not None:
            metadata.update(_json_field(record[self.metadata_key], dict, f"'{self.metadata_key}' (--metadata-key)"))
        tools = None
        if self.tool_key is not None and record.get(self.tool_key) is not None:
            tools = _json_field(record[self.tool_key], list, f"'{self.tool_key}' (--tool-key)")
            metadata["tools"] = tools
        if self.format_prompt is not None:
            raw = apply_format_prompt(self.format_prompt, raw)
        images = self.vision.images_of(record, raw)
        if images:
            raw = self.vision.with_image_parts(raw, cfg.apply_chat_template)
        try:
            text = render_prompt(raw, tokenizer, cfg.apply_chat_template, tools, self.chat_template_kwargs)
        except Exception as exc:  # template engines raise their own types (jinja2.TemplateError, ...)
            raise ValueError(f"the chat template failed: {type(exc).__name__}: {exc}") from exc
        if images:
            ids = self.vision.expand(text, images)
            return PromptRow(text, ids, record[cfg.label_key], metadata, [b for b, _ in images],
                             [g for _, g in images])
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        return PromptRow(text, ids, record[cfg.label_key], metadata)

    def _make_order(self) -> list[int]:
        order = list(range(len(self.rows)))
        if self.cfg.rollout_shuffle:
            # a fresh permutation every epoch, reproducible from (run seed, epoch) alone for resumes
            random.Random(data_order_seed(self.cfg.seed, self.epoch)).shuffle(order)
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


def num_rollout_for_epochs(n_prompts: int, rollout_batch_size: int, num_epoch: int) -> int:
    """`--num-epoch` -> `--num-rollout`: the steps that draw every (kept) prompt `num_epoch` times.

    Floor division, as slime does: a trailing partial batch would start the next epoch, so it is
    left out. Raises when not even one step fits, naming the flags.
    """
    if n_prompts < 0 or rollout_batch_size < 1 or num_epoch < 1:
        raise ValueError(f"num_rollout_for_epochs: need n_prompts >= 0, --rollout-batch-size >= 1 and "
                         f"--num-epoch >= 1; got {n_prompts}, {rollout_batch_size}, {num_epoch}")
    steps = num_epoch * n_prompts // rollout_batch_size
    if steps < 1:
        raise ValueError(f"--num-epoch {num_epoch} over {n_prompts} prompts gives no full batch of "
                         f"--rollout-batch-size {rollout_batch_size}")
    return steps
