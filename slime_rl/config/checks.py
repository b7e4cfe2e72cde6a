"""Checks of the flags that need no file, and `ConfigError`, the user error they raise (its message
names the flag): each flag's own range check from the table (`_check_flags`), a required flag
(`_require`), the path templates of --save-hf and the debug dumps (`_check_path_template`) and what
--colocate supports (`_check_colocate`). `load.build_config` calls them; the checks that compare the
values it computes (batch sizes, the parallel layout, the critic's) stay inline there.
"""

from __future__ import annotations

import argparse
import os
import string
from typing import Any

from slime_rl.config.flags import FLAGS
from slime_rl.config.groups import ParallelConfig


class ConfigError(ValueError):
    """A user error in flags or the YAML file; the message names the flag."""


class ConfigNote(UserWarning):
    """A flag accepted that changes or ignores something the user may not expect; the command line
    prints it as one `slime-rl train: note: ...` line (train.py), whichever module raised it."""


def _require(args: argparse.Namespace, flag: str) -> Any:
    value = getattr(args, flag.lstrip("-").replace("-", "_"))
    if value is None or value == "":
        raise ConfigError(f"{flag} is required")
    return value


def _same_path(a: str, b: str | None) -> bool:
    return b is not None and os.path.abspath(os.path.expanduser(a)) == os.path.abspath(os.path.expanduser(b))


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _check_flags(a: argparse.Namespace) -> None:
    """Each flag's own range check from the table (flags.Flag.check); unset (None) flags skip it."""
    for f in FLAGS:
        value = getattr(a, f.key)
        if f.check is not None and value is not None:
            holds, must = f.check
            # a switch is only given or not: its value says nothing the message does not
            _check(holds(value), f"{f.name} {must}" + ("" if f.action else f", got {value}"))


def _check_path_template(flag: str, template: str | None, names: tuple[str, ...]) -> None:
    """A path template of `flag` (slime's str.format form) may hold only the placeholders `names`,
    each bare ({rollout_id}, not {rollout_id.x} or {0}); None (not given) passes."""
    if template is None:
        return
    placeholders = " and ".join(f"{{{n}}}" for n in names)
    allowed = f"the placeholders allowed are {placeholders}" if len(names) > 1 else \
        f"the only placeholder allowed is {placeholders}"
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:  # a lone { or }
        raise ConfigError(f"{flag} {template!r}: not a path template ({exc}); write a literal brace as {{{{ or }}}}; "
                          f"{allowed}") from exc
    bad = [f"{{{name}}}" for name in fields if name not in names]
    _check(not bad, f"{flag} {template!r}: placeholder {', '.join(bad)} is not allowed: {allowed}")
    try:
        template.format(**dict.fromkeys(names, 0))
    except (ValueError, TypeError, KeyError, IndexError) as exc:  # a format spec a number does not take
        raise ConfigError(f"{flag} {template!r}: not a path template for numbers ({exc!r}); {allowed}") from exc


def _check_fully_async(a: argparse.Namespace) -> None:
    """--fully-async and --max-staleness: what the streaming rollout (rollout/stream.py) supports."""
    _check(a.max_staleness is None or a.fully_async, "--max-staleness bounds --fully-async's staleness; add "
           "--fully-async (or drop it: without it every sample is at most one version old with --async, none with "
           "the synchronous loop)")
    if not a.fully_async:
        return
    for flag, given, why in (
            ("--async", a.async_mode, "--fully-async overlaps generation and training already, without the "
                                      "one-step bound; give one"),
            ("--colocate", a.colocate, "the engines must keep generating while the trainer trains, on devices "
                                       "of their own"),
            ("--use-fault-tolerance", a.use_fault_tolerance, "restarting an engine inside the never-stopping "
                                                             "rollout is not built yet"),
            ("--load-debug-rollout-data", a.load_debug_rollout_data is not None, "there is nothing to generate")):
        _check(not given, f"--fully-async with {flag}: {why}")


def _check_weight_transport(a: argparse.Namespace) -> None:
    """--update-weight-transport disk and --update-weight-mode delta: what they need (weight_sync/disk.py)."""
    if a.update_weight_transport != "disk":
        _check(a.update_weight_mode == "full", f"--update-weight-mode {a.update_weight_mode} goes through files: add "
               "--update-weight-transport disk and --update-weight-disk-dir (a broadcast sends every weight)")
        for flag, given in (("--update-weight-disk-dir", a.update_weight_disk_dir),
                            ("--update-weight-local-checkpoint-dir", a.update_weight_local_checkpoint_dir),
                            ("--update-weight-disk-keep-files", a.update_weight_disk_keep_files)):
            _check(not given, f"{flag} is for --update-weight-transport disk, and the transport is "
                              f"{a.update_weight_transport}: add --update-weight-transport disk or drop {flag}")
        return
    _check(a.update_weight_disk_dir is not None, "--update-weight-transport disk needs --update-weight-disk-dir: a "
           "folder the trainer and every engine host share")
    _check(not a.colocate, "--update-weight-transport disk with --colocate: colocated engines get the weights in "
           "place (CUDA IPC), not through files; drop one")
    if a.update_weight_mode == "delta":
        _check(a.update_weight_local_checkpoint_dir is not None, "--update-weight-mode delta needs "
               "--update-weight-local-checkpoint-dir: the folder on each engine host that the deltas are applied to")
        _check(not a.update_weight_disk_keep_files, "--update-weight-disk-keep-files is for full mode: delta mode "
               "keeps every version (a host rebuilds its checkpoint from the chain)")
    if a.update_weight_local_checkpoint_dir is not None:
        _check(not _same_path(a.update_weight_local_checkpoint_dir, a.update_weight_disk_dir),
               "--update-weight-local-checkpoint-dir must not be --update-weight-disk-dir: the versions are "
               "written to one and applied to the other")


def _check_colocate(a: argparse.Namespace, parallel: ParallelConfig) -> None:
    """--colocate: what the colocated loop supports (docs/colocate.md)."""
    _check(a.rollout_num_gpus <= parallel.world_size,
           f"--colocate: --rollout-num-gpus ({a.rollout_num_gpus}) must be at most the trainer's devices "
           f"--actor-num-nodes x --actor-num-gpus-per-node ({parallel.world_size}): engines use the trainer's devices")
    for flag, given in (("--async", a.async_mode), ("--use-fault-tolerance", a.use_fault_tolerance),
                        ("--use-sglang-router", a.use_sglang_router)):
        _check(not given, f"--colocate and {flag} exclude each other (engines sleep while the trainer trains)"
               if flag == "--async" else f"--colocate does not support {flag} yet")
    _check(a.update_weights_interval == 1,
           f"--colocate needs --update-weights-interval 1 (got {a.update_weights_interval}): the engines drop their "
           "weights during training and must get them back after every step")
