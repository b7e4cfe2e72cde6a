"""Loading a user function named by a flag: 'pkg.module:function', 'pkg.module.function' or
'dir/file.py:function'. Every extension point uses it (--custom-rm-path, --custom-generate-function-path,
--dynamic-sampling-filter-path); it lives in the top room so that each room that has a flag of this
kind imports it downward. Errors name the flag and the path. Where slime is not installed, slime's
module paths (a function written for slime imports them; a flag may name one) resolve to this
project's counterparts from the first load on, in whichever process loads (config/slime_imports.py)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slime_rl.config import slime_imports


class PluginLoadError(ValueError):
    """The function a flag names could not be found or imported; the message names the flag."""


# libraries the functions of other trainers' recipes import, and the extra of this package that installs them
# (EasyR1's examples/reward_function/math.py imports mathruler, which needs pylatexenc)
EXTRA_OF = {"mathruler": "easyr1", "pylatexenc": "easyr1", "verifiers": "agent", "textarena": "agent",
            "openai": "agent", "reasoning_gym": "real"}


def _install_hint(exc: BaseException) -> str:
    """' (pip install ...)' when `exc` is a missing library one of this package's extras installs, else ''."""
    name = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    extra = EXTRA_OF.get((name or "").split(".")[0])
    return f" (pip install 'slime-rl[{extra}]' installs it)" if extra else ""


def import_file_as(path: Path, name: str) -> Any:
    """The Python file `path` imported as the module `name` (registered in sys.modules, removed again when the
    file raises, whose exception propagates)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _load_file_module(file: str, flag: str, spec_text: str, error: type[Exception]) -> Any:
    path = Path(file).resolve()
    if not path.is_file():
        raise error(f"{flag} {spec_text!r}: no such file {file!r}")
    name = f"slime_rl_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    try:
        return import_file_as(path, name)
    except Exception as exc:  # the user's module raised while importing; say which file
        raise error(f"{flag} {spec_text!r}: importing {file} failed: {type(exc).__name__}: {exc}"
                    f"{_install_hint(exc)}") from exc


def load_by_path(path: str, flag: str, error: type[Exception] = PluginLoadError) -> Callable:
    """'pkg.module:function', 'pkg.module.function' or 'dir/file.py:function' -> the function.
    `flag`: the flag that named it, in every error; `error`: the exception raised (a room may
    raise its own, e.g. rewards' RewardError for --custom-rm-path)."""
    slime_imports.install()  # slime's module paths, unless slime itself is importable
    module_name, _, attr = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise error(f"{flag} {path!r}: expected 'module:function', 'module.function' or 'file.py:function'")
    if module_name.endswith(".py") or "/" in module_name:
        module = _load_file_module(module_name, flag, path, error)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            err = error(f"{flag} {path!r}: cannot import module {module_name!r}: {exc}{_install_hint(exc)}")
            missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
            # the named module itself (or a package above it) is not on this machine's path, as opposed to a
            # module it imports: a dry run for another cluster says so instead of refusing (absent_module)
            if missing and (module_name == missing or module_name.startswith(missing + ".")):
                err.absent_module = module_name  # type: ignore[attr-defined]
            raise err from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise error(f"{flag} {path!r}: module {module_name!r} has no function {attr!r}")
    return fn


def absent_module(exc: BaseException) -> str | None:
    """The user module a flag names that is not importable on this machine (the module itself missing, not one
    it imports), from a load error or any error raised from one; None otherwise."""
    while exc is not None:
        name = getattr(exc, "absent_module", None)
        if name:
            return name
        exc = exc.__cause__  # type: ignore[assignment]
    return None


def json_kwargs(value: str | dict[str, Any] | None, flag: str,
                error: type[Exception] = ValueError) -> dict[str, Any]:
    """Keyword arguments for a user function, given to `flag` as a JSON object (or a dict from a YAML
    config); None gives none. Errors (of type `error`) name the flag."""
    if value is None:
        return {}
    parsed = value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise error(f"{flag} {value!r}: not JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise error(f"{flag} {value!r}: expected a JSON object of keyword arguments")
    return dict(parsed)


def accepts_positional(fn: Callable, n: int) -> bool:
    """Whether `fn` can be called with exactly `n` positional arguments (keyword-only parameters
    with defaults and **kwargs are fine)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: let the call decide
        return True
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if any(p.kind == p.KEYWORD_ONLY and p.default is p.empty for p in params):
        return False
    star = any(p.kind == p.VAR_POSITIONAL for p in params)
    return len(required) <= n and (star or n <= len(positional))


def first_param_name(fn: Callable) -> str | None:
    """The name of `fn`'s first positional parameter (None when it has none or no signature)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    return next((p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)), None)


def choose_form(fn: Callable, flag: str, path: str, forms: dict[str, tuple[int, str]],
                error: type[Exception] = PluginLoadError) -> str:
    """Which calling convention a user function follows, decided once from its signature.

    `forms`: {name: (positional arguments it is called with, the signature as documented)}, one of them
    possibly "slime" (slime's `args` first). When only one form's argument count fits, that one; when
    several do, "slime" if the first parameter is named `args` (as slime's docs and examples spell it),
    else the first other one that fits. Neither: `error` naming the flag and both documented signatures."""
    fits = [name for name, (n, _) in forms.items() if accepts_positional(fn, n)]
    if len(fits) == 1:
        return fits[0]
    if len(fits) > 1:
        if "slime" in fits:
            return "slime" if first_param_name(fn) == "args" else next(f for f in fits if f != "slime")
        return fits[0]
    try:
        got = f"{getattr(fn, '__name__', fn)}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        got = repr(fn)
    wanted = " or ".join(f"`{sig}` ({name})" for name, (_, sig) in forms.items())
    raise error(f"{flag} {path!r}: {got} fits no supported form; expected {wanted}")
