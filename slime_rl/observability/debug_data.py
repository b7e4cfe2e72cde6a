"""slime's debug dumps (--save-debug-rollout-data, --save-debug-train-data): one torch.save file per
rollout (and per data-parallel rank for the train data), a dict of plain Python values (ints, floats,
strings, lists, dicts), so `torch.load(path)` reads it with its default weights_only=True as long as
the samples' metadata and labels hold plain values too. What the files hold: docs/flags.md (the
flags' help) and the writers, orchestration.rollout_manager.debug_rollout_data and
trainer.debug_data.train_data."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def save_debug_data(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """torch.save `payload` to `path` (parent folders made), atomically: a reader never sees half a
    file, and a rerun replaces the old one. Returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        torch.save(payload, tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
