"""verl's rejection options for --rollout-rs / --rollout-rs-threshold, parsed at config time (the math that
applies them: slime_rl.algo.offpolicy.rejection_keep)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from slime_rl.config.flag_spec import RS_OPTIONS

__all__ = ["RS_OPTIONS", "RejectionRule", "parse_rejection"]


@dataclass(frozen=True)
class RejectionRule:
    option: str  # one of RS_OPTIONS
    upper: float
    lower: float | None = None  # k1 options only (a ratio bound, as upper)


@functools.lru_cache(maxsize=16)  # the trainer asks once per micro-batch: parse each setting once
def parse_rejection(options: str, threshold: str | float | None) -> tuple[RejectionRule, ...]:
    """verl's rollout_rs / rollout_rs_threshold: comma-separated options, and one threshold for all or one per
    option; a k1 option's threshold is "lower_upper" or "upper" (lower = 1 / upper), the others' one upper bound.
    Raises ValueError naming the flag."""
    names = list(dict.fromkeys(o.strip() for o in options.split(",") if o.strip()))
    if not names:
        raise ValueError("--rollout-rs names no option")
    for o in names:
        if o not in RS_OPTIONS:
            raise ValueError(f"--rollout-rs {o!r} is not an option (one of {', '.join(RS_OPTIONS)})")
    if threshold is None:
        raise ValueError(f"--rollout-rs {options} needs --rollout-rs-threshold (e.g. 0.5_2.0 for k1 options, "
                         "an upper bound such as 0.01 for k2 / k3)")
    specs = [s.strip() for s in str(threshold).split(",") if s.strip()]
    if len(specs) == 1:
        specs = specs * len(names)
    if len(specs) != len(names):
        raise ValueError(f"--rollout-rs-threshold gives {len(specs)} thresholds for {len(names)} --rollout-rs "
                         "options: give one for all or one per option")
    rules = []
    for o, spec in zip(names, specs, strict=True):
        try:
            if o.endswith("k1"):
                lo_s, _, up_s = spec.rpartition("_")
                upper = float(up_s)
                lower = float(lo_s) if lo_s else 1.0 / upper
            else:
                if "_" in spec:
                    raise ValueError
                upper, lower = float(spec), None
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"--rollout-rs-threshold {spec!r} for {o}: expected "
                             + ("'lower_upper' or 'upper' (ratio bounds)" if o.endswith("k1") else "one number")
                             ) from None
        if upper <= 0 or (lower is not None and not 0 < lower <= upper):
            raise ValueError(f"--rollout-rs-threshold {spec!r} for {o}: bounds must be positive, lower <= upper")
        rules.append(RejectionRule(o, upper, lower))
    return tuple(rules)
