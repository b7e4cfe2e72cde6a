"""Loading a user function named by a flag: 'pkg.module:function', 'pkg.module.function' or
'dir/file.py:function'. Every extension point uses it (--custom-rm-path, --custom-generate-function-path,
--dynamic-sampling-filter-path); it lives in the top room so that each room that has a flag of this
kind imports it downward. Errors name the flag and the path."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


class PluginLoadError(ValueError):
    """The function a flag names could not be found or imported; the message names the flag."""


def _load_file_module(file: str, flag: str, spec_text: str, error: type[Exception]) -> Any:
    path = Path(file).resolve()
    if not path.is_file():
        raise error(f"{flag} {spec_text!r}: no such file {file!r}")
    name = f"slime_rl_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's module raised while importing; say which file
        del sys.modules[name]
        raise error(f"{flag} {spec_text!r}: importing {file} failed: {type(exc).__name__}: {exc}") from exc
    return module


def load_by_path(path: str, flag: str, error: type[Exception] = PluginLoadError) -> Callable:
    """'pkg.module:function', 'pkg.module.function' or 'dir/file.py:function' -> the function.
    `flag`: the flag that named it, in every error; `error`: the exception raised (a room may
    raise its own, e.g. rewards' RewardError for --custom-rm-path)."""
    module_name, _, attr = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise error(f"{flag} {path!r}: expected 'module:function', 'module.function' or 'file.py:function'")
    if module_name.endswith(".py") or "/" in module_name:
        module = _load_file_module(module_name, flag, path, error)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise error(f"{flag} {path!r}: cannot import module {module_name!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise error(f"{flag} {path!r}: module {module_name!r} has no function {attr!r}")
    return fn
