"""`--rm-type ifbench`: IFBench's strict instruction-following check (allenai/IFBench), slime's `ifbench` reward.

A row's metadata holds what IFBench's own test file holds per prompt (the field names slime's data uses):
`instruction_id_list` (the instructions the response must follow, IFBench's registry ids), `kwargs` (one dict
of arguments per instruction; a single dict is used for every instruction, a short list is padded with copies
of its last entry, a long one cut, a missing one is empty arguments), `prompt_text` (the prompt as IFBench
wrote it; some instructions check the response against it) and `record_id`.

The reward is 1.0 when the response follows every instruction and 0.0 otherwise, as slime scores it (a row
without instructions scores 0.0, as in slime; a prompt file's rows are checked for them up front). Each instruction is
checked as IFBench's `test_instruction_following_strict` checks it (written here from its behaviour): the
instruction class of the id is built, its arguments given without their None values, its prompt given too
where its arguments name one, and it is followed when the response is not blank and `check_following` says so.

The instruction classes are IFBench's own: the `ifbench` package (IFBench 0.2's `pip install
git+https://github.com/allenai/IFBench`, with its nltk / spacy requirements; slime clones the repository at
run time instead). Without it the run refuses before any actor starts; a dry run for another cluster
(--cluster) lists it as not checked here.
"""

from __future__ import annotations

import functools
from typing import Any

from slime_rl.data import Sample

INSTALL = "pip install 'git+https://github.com/allenai/IFBench'"


class IFBenchMissing(ImportError):
    """IFBench's package is not importable here (`absent_module` lets a --cluster dry run list it)."""

    absent_module = "ifbench"


@functools.cache
def registry() -> dict[str, Any]:
    """IFBench's instruction classes by id (its `ifbench.instructions_registry.INSTRUCTION_DICT`)."""
    try:
        from ifbench import instructions_registry
    except ImportError as exc:
        raise IFBenchMissing(f"--rm-type ifbench needs IFBench's instruction checks, the `ifbench` package, which "
                             f"is not importable here ({exc}): {INSTALL}") from exc
    return dict(instructions_registry.INSTRUCTION_DICT)


def require() -> None:
    """Raise IFBenchMissing unless IFBench's package imports."""
    registry()


def instruction_ids(metadata: Any) -> list[str]:
    """The row's instruction ids, as strings, blanks and None dropped (slime does the same)."""
    raw = metadata.get("instruction_id_list") if isinstance(metadata, dict) else None
    return [str(x).strip() for x in raw or [] if x is not None and str(x).strip()]


def instruction_kwargs(raw: Any, n: int) -> list[dict[str, Any]]:
    """One argument dict per instruction from a row's `kwargs` (module docstring), None values dropped."""
    if isinstance(raw, list):
        out = [dict(x) if isinstance(x, dict) else {} for x in raw]
    elif isinstance(raw, dict):
        out = [dict(raw) for _ in range(n)]
    else:
        out = [{} for _ in range(n)]
    out = out[:n] + [dict(out[-1] if out else {}) for _ in range(n - len(out))]
    return [{k: v for k, v in d.items() if v is not None} for d in out]


def followed(response: str, ids: list[str], kwargs: list[dict[str, Any]], prompt: str) -> list[bool]:
    """Per instruction, whether the response follows it (IFBench's strict check)."""
    classes = registry()
    out = []
    for iid, kw in zip(ids, kwargs, strict=True):
        instruction = classes[iid](iid)
        instruction.build_description(**kw)
        args = instruction.get_instruction_args()
        if args and "prompt" in args:
            instruction.build_description(prompt=prompt)
        out.append(bool(response and response.strip() and instruction.check_following(response)))
    return out


def ifbench_reward(sample: Sample) -> float:
    """1.0 when the response follows every instruction of the row, else 0.0 (module docstring)."""
    meta = sample.metadata if isinstance(sample.metadata, dict) else {}
    ids = instruction_ids(meta)
    if not ids:
        return 0.0
    prompt = "" if meta.get("prompt_text") is None else str(meta["prompt_text"])
    return float(all(followed(sample.response or "", ids, instruction_kwargs(meta.get("kwargs"), len(ids)), prompt)))


def check_rows(metadata_rows: list[dict[str, Any]], labels: list[Any]) -> None:
    """Load-time check of a prompt file: every row names instructions, each one IFBench's registry has."""
    known = registry()
    for i, meta in enumerate(metadata_rows):
        ids = instruction_ids(meta)
        if not ids:
            raise ValueError(f"row {i}: metadata['instruction_id_list'] is missing or empty (IFBench's rows list the "
                             "instructions a response must follow)")
        unknown = [x for x in ids if x not in known]
        if unknown:
            raise ValueError(f"row {i}: instruction ids {unknown} are not in IFBench's registry (the installed "
                             f"ifbench package has {len(known)})")
