"""What the EasyR1 section mappers (config/easyr1_sections.py, config/easyr1_worker.py) share: the
`Mapping` they fill and `EasyR1Context`, the file's keys with EasyR1's defaults, the values derived
from them once, and the helpers that turn one key into flag(s), a not-applicable line or an error."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn


@dataclass
class Mapping:
    """The result: flag keys (YAML spelling) -> values, and one report line per EasyR1 key."""

    flags: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)  # flag key -> the EasyR1 key it came from
    lines: list[str] = field(default_factory=list)

    def set(self, key: str, flag: str, value: Any, note: str = "") -> None:
        self.flags[flag] = value
        self.origin[flag] = key
        shown = json.dumps(value) if isinstance(value, (dict, list)) else value
        self.lines.append(f"  {key} -> --{flag.replace('_', '-')} {shown}{f'  ({note})' if note else ''}")

    def na(self, key: str, reason: str) -> None:
        self.lines.append(f"  {key}: not applicable ({reason})")


class EasyR1Context:
    """One EasyR1 file being mapped. `given`: its flattened keys; `cfg`: those over EasyR1's defaults;
    `m`: the Mapping being filled; `handled`: the keys some rule has claimed (the rest are errors);
    `where`: how errors name the file, raised as `error`. Derived once, before any section: `n`
    (worker.rollout.n), `estimator` (algorithm.adv_estimator) and `critic` (whether it is gae),
    `backend` (--rollout-backend, sglang unless the command line says otherwise), `save_freq` and
    `save_path` (trainer.save_checkpoint_path or EasyR1's checkpoints/<project>/<experiment>)."""

    def __init__(self, cfg: dict[str, Any], given: dict[str, Any], where: str, error: type[Exception],
                 backend: str | None) -> None:
        self.cfg = cfg
        self.given = given
        self.where = where
        self.error = error
        self.m = Mapping()
        self.n = int(self.get("worker.rollout.n"))
        self.estimator = str(self.get("algorithm.adv_estimator"))
        self.critic = self.estimator == "gae"
        self.backend = backend or "sglang"
        self.save_freq = int(self.get("trainer.save_freq", -1))
        self.save_path = self.get("trainer.save_checkpoint_path") or \
            f"checkpoints/{self.get('trainer.project_name', 'easy_r1')}/{self.get('trainer.experiment_name', 'demo')}"
        self.handled: set[str] = set()

    def fail(self, key: str, why: str) -> NoReturn:
        raise self.error(f"{self.where}: {key}: {why}")

    def get(self, key: str, default: Any = None) -> Any:
        value = self.cfg.get(key, default)
        return default if value is None else value

    def rule(self, key: str, fn: Callable[[Any], None]) -> None:
        """Claims `key`; calls `fn` with its value when the file or EasyR1's defaults have it."""
        self.handled.add(key)
        if key in self.cfg:
            fn(self.cfg[key])

    def to(self, key: str, flag: str, convert: Callable[[Any], Any] = lambda v: v, na_if_none: bool = True) -> None:
        """`key` -> `--flag convert(value)` (not applicable when the value is None and `na_if_none`)."""
        def apply(v: Any) -> None:
            if v is None and na_if_none:
                self.m.na(key, "unset")
            else:
                self.m.set(key, flag, convert(v), "EasyR1's default" if key not in self.given else "")
        self.rule(key, apply)

    def na(self, key: str, reason: str) -> None:
        """`key` is not applicable, for `reason` (listed when the file gives it)."""
        def apply(_: Any) -> None:
            if key in self.given:
                self.m.na(key, reason)
        self.rule(key, apply)

    def only(self, key: str, ok: Callable[[Any], bool], reason: str, why_not: str) -> None:
        """Not applicable when `ok(value)`, else an error."""
        def apply(v: Any) -> None:
            if not ok(v):
                self.fail(key, why_not)
            if key in self.given:
                self.m.na(key, reason)
        self.rule(key, apply)
