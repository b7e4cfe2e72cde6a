"""Metric sinks. `<run_dir>/metrics.jsonl` always (one JSON object per step); wandb, tensorboard and
swanlab when asked. Only the driver writes, so there is one line per step. The optional packages are
imported only when their flag is set (preflight already checked they are installed)."""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from slime_rl.config import LoggingConfig

# The keys every step's line must have (ARCHITECTURE.md, contracts).
REQUIRED_KEYS = (
    "step", "rollout/reward_mean", "rollout/response_len_mean", "train/loss", "train/kl", "train/entropy",
    "train/grad_norm", "train/rollout_logprob_abs_diff", "perf/step_s", "perf/rollout_s", "perf/train_s",
    "perf/weight_sync_s", "perf/weight_sync_GBps",
)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep the fact visible
    return value


def _read_rows(lines: list[str]) -> list[dict]:
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a crash mid-write: not a step that happened
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


class MetricsLogger:
    """metrics.jsonl (one line per step) plus optional wandb / tensorboard / swanlab.

    The file holds one run's history: `start(first_step)` keeps the lines of the steps before
    `first_step` (a resumed run continues its own curve) and sets the rest aside, so a fresh run in
    an old run dir does not draw two runs as one curve. Nothing is deleted: a file that loses lines
    is first copied to `metrics.jsonl.old-<n>`."""

    def __init__(self, cfg: LoggingConfig, run_config: dict[str, Any] | None = None) -> None:
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = None
        self._wandb = None
        self._tb = None
        if cfg.use_wandb:
            import wandb

            self._wandb = wandb.init(project=cfg.wandb_project, group=cfg.wandb_group, mode=cfg.wandb_mode,
                                     dir=str(self.run_dir), config=run_config or {})
        if cfg.use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        self._swanlab = None
        if cfg.use_swanlab:
            import swanlab

            self._swanlab = swanlab.init(project=cfg.swanlab_project, mode=cfg.swanlab_mode,
                                         log_dir=str(self.run_dir / "swanlog"), config=run_config or {})

    def start(self, first_step: int) -> Path | None:
        """Open the file for a run whose first step is `first_step` (0: a fresh run). Lines of steps
        >= first_step (and the step -1 eval line of a fresh run) are set aside; returns the copy
        that holds the old file whole, or None when nothing was set aside."""
        assert self._file is None, "start() is called once, before the first log()"
        backup = None
        old = self.path.read_bytes() if self.path.exists() else b""
        if old:
            lines = old.decode("utf-8", errors="replace").splitlines()
            rows = _read_rows(lines)
            keep = [r for r in rows if first_step > 0 and r["step"] < first_step]
            if len(keep) != len(lines):
                n = 1
                while (self.run_dir / f"metrics.jsonl.old-{n}").exists():
                    n += 1
                backup = self.run_dir / f"metrics.jsonl.old-{n}"
                backup.write_bytes(old)
                tmp = self.path.with_suffix(".jsonl.tmp")
                tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
                tmp.replace(self.path)
                print(f"[slime_rl] {self.path}: {len(rows) - len(keep)} lines of an earlier run set aside in "
                      f"{backup.name} (this run starts at step {first_step})", flush=True)
        self._file = self.path.open("a")
        return backup

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        if self._file is None:
            self.start(0)
        row = {"step": step, **{k: _jsonable(v) for k, v in sorted(metrics.items())}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k != "step"}, step=step)
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)
        if self._swanlab is not None:
            self._swanlab.log({k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))},
                              step=step)
        return row

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()
        if self._swanlab is not None:
            self._swanlab.finish()


class Timer:
    """Named wall-clock sections: `with timer("rollout"): ...` then `timer.pop()` -> {"perf/rollout_s": s}."""

    def __init__(self) -> None:
        self._times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self._times[name] = self._times.get(name, 0.0) + time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        out = {f"perf/{k}_s": v for k, v in self._times.items()}
        self._times = {}
        return out


def summary_line(row: dict[str, Any]) -> str:
    """The one line per step printed by the driver."""
    def f(key: str, fmt: str = ".3f") -> str:
        v = row.get(key)
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    return (f"step {row['step']:>4} | reward {f('rollout/reward_mean')} | len {f('rollout/response_len_mean', '.1f')}"
            f" | loss {f('train/loss', '.4f')} | kl {f('train/kl', '.2e')} | ent {f('train/entropy')}"
            f" | gnorm {f('train/grad_norm')} | lp_diff {f('train/rollout_logprob_abs_diff', '.1e')}"
            f" | {f('perf/step_s', '.2f')}s (rollout {f('perf/rollout_s', '.2f')}, train {f('perf/train_s', '.2f')},"
            f" sync {f('perf/weight_sync_s', '.2f')})")
