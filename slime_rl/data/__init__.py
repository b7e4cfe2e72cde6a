from slime_rl.data.dataset import (
    PromptDataset,
    PromptRow,
    TokenLimit,
    num_rollout_for_epochs,
    parse_chat_template_kwargs,
    render_prompt,
)
from slime_rl.data.readers import DataError, parse_data_spec, read_jsonl, read_records, write_records
from slime_rl.data.sample import Sample

__all__ = [
    "DataError",
    "PromptDataset",
    "PromptRow",
    "Sample",
    "TokenLimit",
    "num_rollout_for_epochs",
    "parse_chat_template_kwargs",
    "parse_data_spec",
    "read_jsonl",
    "read_records",
    "render_prompt",
    "write_records",
]
