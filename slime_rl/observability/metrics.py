"""Metric sinks. `<run_dir>/metrics.jsonl` always (one JSON object per step); wandb, tensorboard and
swanlab when asked. Only the driver writes, so there is one line per step. The optional packages are
imported only when their flag is set (preflight already checked they are installed)."""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from slime_rl.config import LoggingConfig
from slime_rl.observability.progress import format_duration

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


def _set_aside(path: Path, first_step: int) -> Path | None:
    """Keep the lines of `path` whose step is < first_step (first_step 0: none); the old file goes
    whole to `<name>.old-<n>` when a line is dropped. Returns that copy, or None."""
    old = path.read_bytes() if path.exists() else b""
    if not old:
        return None
    lines = old.decode("utf-8", errors="replace").splitlines()
    rows = _read_rows(lines)
    keep = [r for r in rows if first_step > 0 and r["step"] < first_step]
    if len(keep) == len(lines):
        return None
    n = 1
    while path.with_name(f"{path.name}.old-{n}").exists():
        n += 1
    backup = path.with_name(f"{path.name}.old-{n}")
    backup.write_bytes(old)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
    tmp.replace(path)
    print(f"[slime_rl] {path}: {len(rows) - len(keep)} lines of an earlier run set aside in "
          f"{backup.name} (this run starts at step {first_step})", flush=True)
    return backup


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
        self.generations_path = self.run_dir / "eval_generations.jsonl"  # --log-eval-generations
        self._generation_rows: list[list[Any]] = []  # the wandb table so far (wandb tables are immutable)
        self._file = None
        self._wandb = None
        self._tb = None
        if cfg.use_wandb:
            import wandb

            if cfg.wandb_key:  # slime's --wandb-key: the key for this process only (no ~/.netrc is written)
                os.environ["WANDB_API_KEY"] = cfg.wandb_key
            if cfg.wandb_host:  # slime's --wandb-host: a self-hosted server, for this process only
                os.environ["WANDB_BASE_URL"] = cfg.wandb_host
            self._wandb = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_team, group=cfg.wandb_group,
                                     mode=cfg.wandb_mode, dir=str(self.run_dir), config=run_config or {})
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
        that holds the old file whole, or None when nothing was set aside. eval_generations.jsonl
        gets the same treatment."""
        assert self._file is None, "start() is called once, before the first log()"
        _set_aside(self.generations_path, first_step)
        backup = _set_aside(self.path, first_step)
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

    def log_generations(self, step: int, samples: list[dict[str, Any]]) -> None:
        """--log-eval-generations: eval samples (dataset, prompt, response, label, reward) of the eval
        at `step`: one line each in eval_generations.jsonl, rows of the wandb table
        `eval/generations` (every eval so far), a text table in tensorboard and swanlab."""
        if not samples:
            return
        rows = [{"step": step, **{k: _jsonable(v) for k, v in x.items()}} for x in samples]
        with self.generations_path.open("a") as f:
            f.writelines(json.dumps(r, default=str) + "\n" for r in rows)
        if self._wandb is not None:
            import wandb

            self._generation_rows += [[r[c] if c in ("step", "reward") else str(r[c]) for c in GENERATION_COLUMNS]
                                      for r in rows]
            # a new table with every row so far: wandb keeps a logged table as it was
            table = wandb.Table(columns=list(GENERATION_COLUMNS), data=self._generation_rows)
            self._wandb.log({"eval/generations": table}, step=step)
        if self._tb is not None or self._swanlab is not None:
            text = generations_markdown(rows)
            if self._tb is not None:
                self._tb.add_text("eval/generations", text, step)
            if self._swanlab is not None:
                import swanlab

                self._swanlab.log({"eval/generations": swanlab.Text(text)}, step=step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()
        if self._swanlab is not None:
            self._swanlab.finish()


GENERATION_COLUMNS = ("step", "dataset", "prompt", "response", "label", "reward")


def generations_markdown(rows: list[dict[str, Any]]) -> str:
    """Eval samples as a markdown table (tensorboard and swanlab render it)."""
    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", "<br>")

    head = "| " + " | ".join(GENERATION_COLUMNS) + " |\n|" + "---|" * len(GENERATION_COLUMNS) + "\n"
    return head + "".join("| " + " | ".join(cell(r.get(c)) for c in GENERATION_COLUMNS) + " |\n" for r in rows)


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


def summary_line(row: dict[str, Any], total_steps: int | None = None, elapsed_s: float | None = None,
                 eta_s: float | None = None) -> str:
    """The one line per step printed by the driver. With `total_steps` it starts `step k/N`, k counted
    from 1 (metrics.jsonl's `step` is k - 1); with `elapsed_s` / `eta_s` it ends with the loop's
    elapsed time and the ETA of the remaining steps."""
    def f(key: str, fmt: str = ".3f") -> str:
        v = row.get(key)
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    if total_steps:
        head = f"step {row['step'] + 1:>{len(str(total_steps))}}/{total_steps}"
    else:
        head = f"step {row['step']:>4}"
    tail = ""
    if elapsed_s is not None:
        tail += f" | {format_duration(elapsed_s)} elapsed"
    if eta_s is not None:
        tail += f", ETA {format_duration(eta_s)}" if tail else f" | ETA {format_duration(eta_s)}"
    return (f"{head} | reward {f('rollout/reward_mean')} | len {f('rollout/response_len_mean', '.1f')}"
            f" | loss {f('train/loss', '.4f')} | kl {f('train/kl', '.2e')} | ent {f('train/entropy')}"
            f" | gnorm {f('train/grad_norm')} | lp_diff {f('train/rollout_logprob_abs_diff', '.1e')}"
            f" | {f('perf/step_s', '.2f')}s (rollout {f('perf/rollout_s', '.2f')}, train {f('perf/train_s', '.2f')},"
            f" sync {f('perf/weight_sync_s', '.2f')}){tail}")
