"""slime's `--eval-config` YAML: the eval sets with their own settings.

The file (slime/utils/eval_config.py's format) holds a mapping, optionally under `eval:`, with
`datasets` (a list of mappings with `name` and `path`, or a mapping from name to settings) and
`defaults` (settings every set takes unless it gives its own). A set's setting wins over `defaults`,
which win over the --eval-* flags (and theirs over the --rollout-* ones), as in slime. The settings
taken here are `SETTINGS`; slime's others (a set's own generate function, an app service, early stop,
message processors, ...) are refused naming the set and the key. slime resolves `${...}` interpolations
with OmegaConf; a file that uses them is refused (write the values out).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from slime_rl.config.parse import UniqueKeyLoader

# key -> (type check, what it must be); the values a set may set for itself
SETTINGS: dict[str, tuple[Any, str]] = {
    "n_samples_per_eval_prompt": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                                  "an integer >= 1"),
    "temperature": (lambda v: _number(v) and v >= 0, "a number >= 0"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: isinstance(v, int) and not isinstance(v, bool) and (v == -1 or v >= 1),
              "-1 or an integer >= 1"),
    "max_response_len": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an integer >= 1"),
    "rm_type": (lambda v: isinstance(v, str) and bool(v), "a reward type name"),
    "custom_rm_path": (lambda v: isinstance(v, str) and bool(v), "a dotted path"),
    "input_key": (lambda v: isinstance(v, str) and bool(v), "a column name"),
    "label_key": (lambda v: isinstance(v, str) and bool(v), "a column name"),
    "apply_chat_template": (lambda v: isinstance(v, bool), "true or false"),
    "stop": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "stop_token_ids": (lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool)
                                                             for x in v), "a list of token ids"),
}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class EvalConfigError(ValueError):
    """A --eval-config file that cannot be read as slime's eval YAML; the message names the file and key."""


def read_eval_config(path: str | Path) -> tuple[tuple[tuple[str, str], ...], dict[str, dict[str, Any]]]:
    """((name, path) of every set, in file order; {name: its settings, `defaults` merged in})."""
    where = f"--eval-config {path}"
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise EvalConfigError(f"{where}: cannot read it ({exc.strerror or exc})") from exc
    if "${" in text:
        raise EvalConfigError(f"{where}: it uses ${{...}} interpolation (slime resolves it with OmegaConf); "
                              "write the values out")
    try:  # a key given twice in one mapping is an error naming both lines (parse.UniqueKeyLoader)
        raw = yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        raise EvalConfigError(f"{where}: not YAML ({exc})") from exc
    if not isinstance(raw, dict):
        raise EvalConfigError(f"{where}: the file must hold a mapping (with `datasets`, under `eval:` or not)")
    root = raw.get("eval", raw)
    if not isinstance(root, dict):
        raise EvalConfigError(f"{where}: `eval` must be a mapping with `datasets` and optional `defaults`")
    unknown = set(root) - {"datasets", "defaults"}
    if unknown:
        raise EvalConfigError(f"{where}: unknown key(s) {sorted(unknown)} beside `datasets` and `defaults`")
    defaults = root.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise EvalConfigError(f"{where}: `defaults` must be a mapping of settings")
    _check_settings(defaults, f"{where}: defaults")
    entries = _dataset_list(root.get("datasets"), where)
    datasets: list[tuple[str, str]] = []
    settings: dict[str, dict[str, Any]] = {}
    for k, entry in enumerate(entries):
        name, data_path = entry.get("name"), entry.get("path")
        if not isinstance(name, str) or not name:
            raise EvalConfigError(f"{where}: datasets[{k}] needs a `name`")
        if name in settings:
            raise EvalConfigError(f"{where}: dataset {name!r} is given twice")
        if not isinstance(data_path, str) or not data_path:
            raise EvalConfigError(f"{where}: dataset {name!r} needs a `path` (its prompt file)")
        own = {key: value for key, value in entry.items() if key not in ("name", "path")}
        _check_settings(own, f"{where}: dataset {name!r}")
        datasets.append((name, data_path))
        settings[name] = {**defaults, **own}
    return tuple(datasets), settings


def _dataset_list(value: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(value, dict):  # slime's other form: name -> settings
        out = []
        for name, entry in value.items():
            if entry is not None and not isinstance(entry, dict):
                raise EvalConfigError(f"{where}: dataset {name!r} must be a mapping of settings")
            out.append({"name": name, **(entry or {})})
        return out
    if isinstance(value, list) and value:
        for k, entry in enumerate(value):
            if not isinstance(entry, dict):
                raise EvalConfigError(f"{where}: datasets[{k}] must be a mapping with `name` and `path`")
        return list(value)
    raise EvalConfigError(f"{where}: `datasets` must be a non-empty list (or a mapping from name to settings)")


def _check_settings(settings: dict[str, Any], where: str) -> None:
    for key, value in settings.items():
        if key not in SETTINGS:
            raise EvalConfigError(f"{where}: {key!r} is not a setting this trainer takes per eval set (it takes "
                                  f"{', '.join(sorted(SETTINGS))}); remove it or evaluate that set another way")
        check, what = SETTINGS[key]
        if not check(value):
            raise EvalConfigError(f"{where}: {key} must be {what}, got {value!r}")
