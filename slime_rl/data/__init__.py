from slime_rl.data.dataset import DataError, PromptDataset, PromptRow, read_jsonl
from slime_rl.data.sample import Sample

__all__ = ["DataError", "PromptDataset", "PromptRow", "Sample", "read_jsonl"]
