"""slime's `--custom-config-path` (a YAML file whose keys slime sets on its `args` after parsing, over the
command line) and its mismatch helper (examples/train_infer_mismatch_helper: `--custom-tis-function-path
examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp` with the settings of its mis.yaml).

The helper's settings are this trainer's off-policy flags (algo/offpolicy.py), mapped here; with r = pi_old /
pi_engine per token, at the level of tis_level / rs_level (token: r; sequence: the product over the sample;
geometric: its geometric mean):
  use_tis                          --use-tis (false: the mismatch metrics alone, --get-mismatch-metrics, and
                                   no rejection: the helper returns before it)
  tis_mode truncate                --tis-mode truncate --tis-clip U --tis-clip-low 0   (w = clamp(r, 0, U))
  tis_mode clip                    --tis-mode truncate --tis-clip U --tis-clip-low L   (w = clamp(r, L, U))
  tis_mode mask                    --tis-mode mask --tis-clip U --tis-clip-low L       (w = 0 outside [L, U])
      U = tis_upper_bound; L = tis_lower_bound, or 1 / U when null
  use_rs, rs_level, rs bounds      --rollout-rs token_k1 | seq_sum_k1 | seq_mean_k1 with --rollout-rs-threshold
                                   (1/RU)_(1/RL): the k1 options bound pi_engine / pi_old, the helper bounds r;
                                   RL / RU default to L / U
  rs_veto_threshold T (with use_rs)   --rollout-rs-veto-threshold T (a sample with a token of r < T is rejected)
  tis_batch_normalize              --tis-batch-normalize (the weights over their mean in each micro-batch)
Any other key is a flag of ours under its own name (slime's `args` attribute), as --config reads it.
"""

from __future__ import annotations

from typing import Any

MIS_FUNCTION = "examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp"
MIS_KEYS = ("use_tis", "use_rs", "tis_level", "rs_level", "tis_mode", "tis_lower_bound", "tis_upper_bound",
            "rs_lower_bound", "rs_upper_bound", "rs_veto_threshold", "tis_batch_normalize")
_LEVELS = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}
_MODES = ("truncate", "clip", "mask")


def _number(data: dict[str, Any], key: str, where: str, error: type[Exception]) -> float | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise error(f"{where}key '{key}': expected a number, got {value!r:.40}")
    try:
        number = float(value)  # slime's mis.yaml notes that YAML reads 1e-4 (no dot) as a string
    except ValueError:
        raise error(f"{where}key '{key}': expected a number, got {value!r:.40}") from None
    if not number > 0:
        raise error(f"{where}key '{key}': must be > 0, got {value!r}")
    return number


def _switch(data: dict[str, Any], key: str, where: str, error: type[Exception]) -> bool:
    value = data.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise error(f"{where}key '{key}': expected true or false, got {value!r:.40}")
    return value


def _choice(data: dict[str, Any], key: str, choices: tuple[str, ...], default: str, where: str,
            error: type[Exception]) -> str:
    value = data.get(key)
    if value is None:
        return default
    if value not in choices:
        raise error(f"{where}key '{key}': {value!r} is not one of {list(choices)}")
    return value


def mis_flags(data: dict[str, Any], where: str, error: type[Exception]) -> tuple[dict[str, Any], str]:
    """The helper's keys of `data` (MIS_KEYS) -> ({flag dest: value}, the mapping in one line). `where`
    starts each error ("--custom-config-path FILE: "). Keys the helper reads and the file leaves out take
    the meaning mis.yaml's comments give them (levels token, mode truncate, no rejection, no normalization)."""
    use_tis, use_rs = _switch(data, "use_tis", where, error), _switch(data, "use_rs", where, error)
    batch_norm = _switch(data, "tis_batch_normalize", where, error)
    if not use_tis:  # the helper computes the mismatch metrics and returns before its weights and rejection
        return {"use_tis": False, "get_mismatch_metrics": True, "rollout_rs": None, "rollout_rs_threshold": None,
                "rollout_rs_veto_threshold": None, "tis_batch_normalize": False}, (
            "use_tis false -> --get-mismatch-metrics (the helper's weights and rejection are off without use_tis)")
    level = _choice(data, "tis_level", tuple(_LEVELS), "token", where, error)
    mode = _choice(data, "tis_mode", _MODES, "truncate", where, error)
    upper = _number(data, "tis_upper_bound", where, error)
    if upper is None:
        raise error(f"{where}key 'tis_upper_bound' is required with use_tis: the weights' upper bound (mis.yaml "
                    "has 2.0)")
    lower = _number(data, "tis_lower_bound", where, error)
    lower = 1.0 / upper if lower is None else lower
    if mode != "truncate" and not lower < upper:
        raise error(f"{where}tis_mode {mode}: tis_lower_bound {lower} must be below tis_upper_bound {upper}")
    if batch_norm and level == "geometric":
        raise error(f"{where}tis_batch_normalize with tis_level geometric: the helper normalizes token or sequence "
                    "weights only (it raises for geometric); drop one")
    flags: dict[str, Any] = {"use_tis": True, "tis_level": level, "tis_mode": "mask" if mode == "mask" else "truncate",
                             "tis_clip": upper, "tis_clip_low": 0.0 if mode == "truncate" else lower,
                             "tis_batch_normalize": batch_norm, "rollout_rs": None, "rollout_rs_threshold": None,
                             "rollout_rs_veto_threshold": None}
    said = [f"use_tis, tis_level {level}, tis_mode {mode} -> --use-tis --tis-level {level} --tis-mode "
            f"{flags['tis_mode']} --tis-clip {upper:g} --tis-clip-low {flags['tis_clip_low']:g}"]
    if use_rs:
        rs_level = _choice(data, "rs_level", tuple(_LEVELS), "token", where, error)
        rs_lower = _number(data, "rs_lower_bound", where, error)
        rs_upper = _number(data, "rs_upper_bound", where, error)
        rs_lower, rs_upper = lower if rs_lower is None else rs_lower, upper if rs_upper is None else rs_upper
        if not rs_lower < rs_upper:
            raise error(f"{where}rs_lower_bound {rs_lower} must be below rs_upper_bound {rs_upper}")
        flags["rollout_rs"] = _LEVELS[rs_level]
        flags["rollout_rs_threshold"] = f"{1.0 / rs_upper!r}_{1.0 / rs_lower!r}"
        said.append(f"use_rs, rs_level {rs_level}, r in [{rs_lower:g}, {rs_upper:g}] -> --rollout-rs "
                    f"{flags['rollout_rs']} --rollout-rs-threshold {flags['rollout_rs_threshold']}")
        veto = _number(data, "rs_veto_threshold", where, error)
        if veto is not None:
            flags["rollout_rs_veto_threshold"] = veto
            said.append(f"rs_veto_threshold {veto:g} -> --rollout-rs-veto-threshold {veto:g}")
    if batch_norm:
        said.append("tis_batch_normalize -> --tis-batch-normalize")
    return flags, "; ".join(said)
