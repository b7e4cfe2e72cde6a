"""slime's module paths for user functions written for slime, where slime itself is not installed.

A reward, generate or filter function written for slime imports slime's modules
(`from slime.utils.types import Sample`, `from slime.rollout.sglang_rollout import GenerateState`, ...)
and a script may name slime's own filter (`--dynamic-sampling-filter-path
slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std`). `install()` appends a
finder to the end of `sys.meta_path` that answers `slime` and `slime.*` with stand-in modules whose
names resolve, on first use, to this project's counterparts (`MODULES`: slime's name -> ours, by dotted
path, as a flag names a user function). Every extension point loads its function through
`dotted_path.load_by_path`, which calls `install()` first, so the finder is there in each process
that loads one (the driver's preflight, the RolloutManager actor) and stays for imports the function
makes later.

The real slime always wins: `install()` does nothing when another finder finds a `slime` package,
and the finder, last in `sys.meta_path`, is asked only after every other one found nothing; it
answers no submodule of a `slime` that is not its own. A slime module or name without a counterpart
fails with an ImportError that names it and says what to use instead (`NO_COUNTERPART`, and each
module's `instead`); attribute access raises it too, so `hasattr` on a stand-in raises for such a name
rather than answering False. docs/migration.md lists the table; no top-level `slime` package is shipped.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from dataclasses import dataclass, field
from typing import Any

SHIM = "__slime_rl_shim__"  # set on every stand-in module
DOC = "docs/migration.md"


@dataclass(frozen=True)
class StandIn:
    """A slime module's stand-in: {slime's name: 'slime_rl.module:attribute'}, and what to use for its
    other names (said by the ImportError of an unmapped name)."""

    names: dict[str, str] = field(default_factory=dict)
    instead: str = ""


_DATA, _ROLLOUT = "slime_rl.data.slime_compat", "slime_rl.rollout.slime_modules"
_REWARDS = "slime_rl.rewards.slime_rm_hub"
MODULES: dict[str, StandIn] = {
    "slime": StandIn(),
    "slime.utils": StandIn(),
    "slime.rollout": StandIn(),
    "slime.rollout.filter_hub": StandIn(),
    "slime.utils.types": StandIn({"Sample": f"{_DATA}:SlimeSample"}),
    "slime.utils.http_utils": StandIn(
        {"post": f"{_DATA}:post", "get": f"{_DATA}:get"},
        "the rest is slime's server plumbing: the rollout starts the engines and the endpoint that post() reaches"),
    "slime.utils.misc": StandIn({"load_function": f"{_DATA}:load_function",
                                 "SingletonMeta": f"{_ROLLOUT}:SingletonMeta"}),
    "slime.utils.async_utils": StandIn({"run": f"{_ROLLOUT}:run", "get_async_loop": f"{_ROLLOUT}:get_async_loop"}),
    "slime.utils.processing_utils": StandIn(
        {"load_tokenizer": f"{_ROLLOUT}:load_tokenizer", "load_processor": f"{_ROLLOUT}:load_processor"},
        "a slime generate function's samples carry text tokens only here (multimodal_train_inputs is not read)"),
    "slime.rollout.filter_hub.base_types": StandIn({"DynamicFilterOutput": f"{_DATA}:DynamicFilterOutput"}),
    "slime.rollout.filter_hub.dynamic_sampling_filters": StandIn(
        {"check_reward_nonzero_std": f"{_ROLLOUT}:check_reward_nonzero_std",
         "check_reward_nonzero_std_with_fallback": f"{_ROLLOUT}:check_reward_nonzero_std_with_fallback"}),
    "slime.rollout.sglang_rollout": StandIn(
        {"GenerateState": f"{_ROLLOUT}:GenerateState", "get_model_url": f"{_ROLLOUT}:get_model_url"},
        "the rollout loop and its default generate are this project's (the built-in generate runs unless "
        "--custom-generate-function-path names one)"),
    "slime.rollout.rm_hub": StandIn(
        {"async_rm": f"{_REWARDS}:async_rm", "batched_async_rm": f"{_REWARDS}:batched_async_rm",
         "remote_rm": f"{_REWARDS}:remote_rm", "grade_answer_verl": f"{_REWARDS}:grade_answer_verl",
         "extract_boxed_answer": f"{_REWARDS}:extract_answer", "compute_score_dapo": f"{_REWARDS}:compute_score",
         "get_deepscaler_rule_based_reward": f"{_REWARDS}:get_deepscaler_rule_based_reward"},
        "the rule rewards are --rm-type's (slime_rl.rewards.builtin), gpqa and ifbench among them"),
    "slime.rollout.rm_hub.math_utils": StandIn(
        {"extract_answer": f"{_REWARDS}:extract_answer", "grade_answer_verl": f"{_REWARDS}:grade_answer_verl"},
        "the math grader is slime_rl.rewards.math_grader (is_equivalent, last_boxed)"),
    "slime.rollout.rm_hub.math_dapo_utils": StandIn(
        {"compute_score": f"{_REWARDS}:compute_score"},
        "the math grader is slime_rl.rewards.math_grader (is_equivalent, last_boxed)"),
}
# slime modules with no counterpart (a prefix covers its submodules) -> what to use instead
NO_COUNTERPART: dict[str, str] = {
    "slime.agent": "slime's agent harness (sandboxes, model adapters, trajectories) is not part of slime_rl; "
                   "a custom generate function may run its own tools (slime_rl.rollout.examples.calculator)",
    "slime.backends": "slime's Megatron and SGLang back ends are internal; the trainer is slime_rl.trainer",
    "slime.ray": "slime's Ray actors are internal; slime_rl.orchestration places the run",
    "slime.rollout.sft_rollout": "a whole-rollout function is not supported; use --custom-generate-function-path",
    "slime.rollout.fully_async_rollout": "its rollout is --fully-async here (also what --rollout-function-path "
                                         "slime.rollout.fully_async_rollout.generate_rollout_fully_async gives); "
                                         "the module itself is not importable",
    "slime.rollout.on_policy_distillation": "on-policy distillation is not supported",
    "slime.utils.external_utils": "slime's Python launchers: run `slime-rl train` with the script's flags",
}


def _message_for_module(fullname: str) -> str:
    prefix = next((p for p in NO_COUNTERPART if fullname == p or fullname.startswith(p + ".")), None)
    why = NO_COUNTERPART[prefix] if prefix else \
        f"slime_rl stands in for {', '.join(m for m in MODULES if MODULES[m].names)} only"
    return f"No module named {fullname!r}: slime is not installed, and slime_rl has no counterpart ({why}; {DOC})"


class _StandInModule(types.ModuleType):
    """A stand-in: its names import their counterpart on first use."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        spec = MODULES[self.__name__]
        target = spec.names.get(name)
        if target is not None:
            module, _, attr = target.partition(":")
            value = getattr(importlib.import_module(module), attr)
            setattr(self, name, value)
            return value
        sub = f"{self.__name__}.{name}"
        if sub in MODULES or any(sub == p or sub.startswith(p + ".") for p in NO_COUNTERPART):
            return importlib.import_module(sub)  # `from slime.rollout import rm_hub`
        have = f"it has {', '.join(spec.names)}" if spec.names else "it has no names of its own"
        instead = f"; {spec.instead}" if spec.instead else ""
        # an ImportError (not AttributeError), so that `from slime.x import name` reports this message
        raise ImportError(f"cannot import name {name!r} from {self.__name__!r}: slime is not installed, and slime_rl's "
                          f"stand-in for {self.__name__} has no counterpart of it ({have}{instead}; {DOC})",
                          name=self.__name__)


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _StandInModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        spec = MODULES[module.__name__]
        module.__doc__ = f"slime_rl's stand-in for slime's {module.__name__} (slime_rl.config.slime_imports)"
        setattr(module, SHIM, True)
        module.__all__ = list(spec.names)


class SlimeFinder(importlib.abc.MetaPathFinder):
    """Answers `slime` and `slime.*` with stand-ins (see the module docstring)."""

    loader = _Loader()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "slime" and not fullname.startswith("slime."):
            return None
        if fullname != "slime" and not getattr(sys.modules.get("slime"), SHIM, False):
            return None  # a submodule of a real slime (or of none yet): not ours to answer
        if fullname not in MODULES:
            raise ModuleNotFoundError(_message_for_module(fullname), name=fullname)
        package = any(m.startswith(fullname + ".") for m in MODULES)
        return importlib.util.spec_from_loader(fullname, self.loader, is_package=package)


FINDER = SlimeFinder()


def real_slime_spec() -> importlib.machinery.ModuleSpec | None:
    """The spec of a real `slime` package, as the finders before ours see it; None when there is none."""
    for finder in sys.meta_path:
        if finder is FINDER or not hasattr(finder, "find_spec"):
            continue
        try:
            spec = finder.find_spec("slime", None)
        except (ImportError, ValueError):
            continue
        if spec is not None:
            return spec
    return None


def install() -> bool:
    """Append the finder to `sys.meta_path` unless a real slime is importable or it is there already;
    whether the stand-ins answer slime's imports in this process now."""
    if FINDER in sys.meta_path:
        return not _real_loaded()
    if real_slime_spec() is not None:
        return False
    sys.meta_path.append(FINDER)
    return True


def _real_loaded() -> bool:
    module = sys.modules.get("slime")
    return module is not None and not getattr(module, SHIM, False)


def uninstall() -> None:
    """Remove the finder and every stand-in module (tests)."""
    if FINDER in sys.meta_path:
        sys.meta_path.remove(FINDER)
    for name in [n for n, m in sys.modules.items() if n.split(".")[0] == "slime" and getattr(m, SHIM, False)]:
        del sys.modules[name]
