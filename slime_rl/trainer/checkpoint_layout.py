"""Where checkpoints live on disk and which of them are complete; readable without megatron or
torch.distributed (orchestration code prunes and inspects checkpoints with it).

Layout, as Megatron-LM's (so its tools can read it):

    <root>/latest_checkpointed_iteration.txt     "<step>"
    <root>/iter_<step:07d>/                      dist_checkpointing files (metadata.json, *.distcp)
    <root>/iter_<step:07d>/slime_rl_checkpoint.json   completion marker: step, extra, topology
    <root>/iter_<step:07d>/hf/                   config, tokenizer, generation config (no weights)

Atomic: every rank writes into `iter_<step>.tmp/`; after a barrier (every rank has finished its
shards), rank 0 writes the marker into it, renames it to `iter_<step>/` and updates the tracker
file (checkpoint.save_checkpoint). A save killed at any point leaves either a `.tmp` folder or no
marker, and `latest_checkpoint` takes only folders with the marker, so an interrupted save never
looks complete.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TRACKER_FILE = "latest_checkpointed_iteration.txt"
MARKER_FILE = "slime_rl_checkpoint.json"
DIST_CKPT_METADATA = "metadata.json"  # written by dist_checkpointing once its save is finished
TMP_SUFFIX = ".tmp"
HF_SUBDIR = "hf"  # config.json, tokenizer, generation_config of the model (no weights): for export
_HF_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf")
_HF_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
_TMP_RE = re.compile(r"^iter_(\d{7,})" + re.escape(TMP_SUFFIX) + "$")


@dataclass(frozen=True)
class CheckpointInfo:
    """What the completion marker of one checkpoint says (readable without megatron)."""

    path: Path
    step: int
    extra: dict[str, Any]
    contents: tuple[str, ...]  # subset of ("model", "optimizer", "lr_scheduler", "rng_state")
    topology: dict[str, int] = field(default_factory=dict)  # world, tp, pp, dp at save time
    optim_sharding: str | None = None


def iter_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def is_complete(path: str | Path) -> bool:
    """A finished checkpoint folder: final name, our marker and dist_checkpointing's metadata."""
    p = Path(path)
    return (bool(_ITER_RE.match(p.name)) and (p / MARKER_FILE).is_file()
            and (p / DIST_CKPT_METADATA).is_file())


def _complete_steps(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _ITER_RE.match(p.name)
        if m and is_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint of the highest step under `root`, or None (auto-resume).

    The tracker file is not trusted alone: a crash between the rename and the tracker update, or
    a tracker naming a folder since deleted, must not lose or invent a checkpoint."""
    steps = _complete_steps(Path(root))
    return steps[-1][1] if steps else None


def is_megatron_checkpoint(path: str | Path) -> bool:
    """True for a checkpoint root (tracker or complete iter_* folders) or one checkpoint folder
    (ours, or any dist_checkpointing folder with metadata.json); False for an HF folder."""
    p = Path(path)
    if not p.is_dir():
        return False
    if (p / DIST_CKPT_METADATA).is_file() and not (p / "config.json").is_file():
        return True
    return (p / TRACKER_FILE).is_file() or bool(_complete_steps(p))


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder from either a root (its latest complete checkpoint) or a folder."""
    p = Path(path)
    if is_complete(p) or ((p / DIST_CKPT_METADATA).is_file() and not _ITER_RE.match(p.name)
                          and not _TMP_RE.match(p.name)):
        return p
    latest = latest_checkpoint(p)
    if latest is None and (p / TRACKER_FILE).is_file():
        latest = _megatron_lm_folder(p)
    if latest is None:
        raise FileNotFoundError(f"--load {p}: no complete Megatron checkpoint there (need iter_XXXXXXX/ "
                                f"with {MARKER_FILE}; interrupted saves end in {TMP_SUFFIX} and are skipped)")
    return latest


def _megatron_lm_folder(root: Path) -> Path | None:
    """The folder a Megatron-LM root's tracker names (a step, or "release"), when it holds a
    dist_checkpointing save: Megatron-LM writes the tracker after the save, and writes no marker of
    ours (its checkpoints load as model weights only)."""
    step = (root / TRACKER_FILE).read_text().strip()
    if step == "release":
        folder = root / "release"
    elif step.isdigit():
        folder = iter_dir(root, int(step))
    else:
        return None
    return folder if (folder / DIST_CKPT_METADATA).is_file() and not (folder / MARKER_FILE).is_file() else None


def read_checkpoint_info(path: str | Path) -> CheckpointInfo:
    """The marker of a checkpoint folder, or of the latest one under a root."""
    p = resolve_checkpoint(path)
    marker = p / MARKER_FILE
    if not marker.is_file():
        raise FileNotFoundError(f"{p}: a dist_checkpointing folder without {MARKER_FILE} (not written by "
                                "slime_rl); its step and extra state are unknown")
    d = json.loads(marker.read_text())
    return CheckpointInfo(path=p, step=int(d["step"]), extra=d.get("extra", {}), contents=tuple(d["contents"]),
                          topology=d.get("topology", {}), optim_sharding=d.get("optim_sharding"))


def keep_last(root: str | Path, n: int) -> list[Path]:
    """Delete all but the newest `n` complete checkpoints, and stale `.tmp` folders older than the
    newest complete one (left by interrupted saves). Call on one rank, after a save returned.
    Returns the deleted folders."""
    if n < 1:
        raise ValueError(f"keep_last: n={n} must be >= 1 (it would delete the checkpoint just saved)")
    root = Path(root)
    steps = _complete_steps(root)
    doomed = [p for _, p in steps[:-n]]
    if steps:
        newest = steps[-1][0]
        for p in root.iterdir():
            m = _TMP_RE.match(p.name)
            if m and int(m.group(1)) <= newest:
                doomed.append(p)
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def remove_partial_saves(root: str | Path | None) -> list[Path]:
    """Delete every `iter_<step>.tmp` folder under `root` (saves that were cut short: a full disk, a
    killed rank, a stop signal) and return them; call when no rank writes there (before a run starts its
    ranks, after it stopped them). Complete checkpoints are never touched."""
    if root is None or not Path(root).is_dir():
        return []
    doomed = [p for p in Path(root).iterdir() if _TMP_RE.match(p.name) and p.is_dir()]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


# the disk errors a save can meet, named as the OS names them
DISK_ERRORS = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded",
               errno.EROFS: "Read-only file system"}
LOW_FREE_BYTES = 64 * 2**20  # a disk with less free than this after a failed save is taken as full


def disk_problem(root: str | Path, exc: BaseException | None = None) -> str | None:
    """Why a save under `root` failed when the disk is the cause: an ENOSPC / EDQUOT / EROFS in `exc`'s
    chain (or its text: torch's writers often lose the errno, e.g. "unexpected pos 704 vs 598"), or a disk
    left with under 64 MiB free, or a read-only one. None when the disk looks fine."""
    kind = None
    seen: set[int] = set()
    e = exc
    while e is not None and id(e) not in seen and kind is None:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_ERRORS:
            kind = DISK_ERRORS[e.errno]
        else:
            kind = next((name for name in DISK_ERRORS.values() if name in str(e)), None)
        e = e.__cause__ or e.__context__
    where = Path(root)
    while not where.exists() and where != where.parent:  # the disk the folder is (or would be) on
        where = where.parent
    usage = shutil.disk_usage(where)
    if kind is None and usage.free < LOW_FREE_BYTES:
        kind = DISK_ERRORS[errno.ENOSPC]
    if kind is None and os.statvfs(where).f_flag & os.ST_RDONLY:
        kind = DISK_ERRORS[errno.EROFS]
    if kind is None:
        return None
    return (f"{kind}: the disk holding {root} has {usage.free / 2**20:,.1f} MiB free of "
            f"{usage.total / 2**20:,.1f} MiB; free space there or give --save a folder on another disk, then resume")


def copy_hf_metadata(hf_dir: str | Path, dest: str | Path) -> Path:
    """Copy an HF folder's files except the weights (config.json, generation_config.json,
    tokenizer files, chat template) into `dest`; returns `dest`."""
    src, dest = Path(hf_dir), Path(dest)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src}: no config.json (expected an HF model folder)")
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(_HF_WEIGHT_SUFFIXES) and f.name not in _HF_WEIGHT_INDEXES:
            shutil.copy2(f, dest / f.name)
    return dest


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class CheckpointChoiceError(ValueError):
    """--load / --ckpt-step / --save name no checkpoint to resume from, or one whose resumption would
    overwrite checkpoints of another run; the message names the flag and the folders."""


def intact_checkpoints(root: Path, damaged: Path | None = None) -> str:
    """The complete checkpoints under `root` (but `damaged`), each with the --load that resumes from it."""
    steps = [(s, p) for s, p in _complete_steps(root) if damaged is None or p.resolve() != damaged.resolve()]
    if not steps:
        return f"no other complete checkpoint under {root}" if damaged else f"no complete checkpoint under {root}"
    return "intact checkpoints: " + "; ".join(f"{p.name} (--load {p})" for _, p in steps)


DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index (dist_checkpointing's torch_dist backend)
DCP_COMMON = "common.pt"  # dist_checkpointing's non-sharded state (torch.save, a zip file)


def check_shards(path: str | Path) -> None:
    """The files of a torch_dist checkpoint are all there and whole, read from its own index before any
    rank starts: torch.distributed.checkpoint's `.metadata` names the file and byte range of every saved
    item; a file that is missing or shorter than its last range, an index that does not unpickle or a
    `common.pt` that is no whole zip file is a checkpoint damaged after its save (a disk that filled, a
    copy cut short): an error naming the file, with the intact checkpoints beside it. Loading it would
    fail on the ranks that read that file only, deep inside torch. Bytes changed in place are not seen
    (the format keeps no checksums). A folder without `.metadata` (another backend) is not checked."""
    import zipfile

    folder = Path(path)
    index = folder / DCP_METADATA
    if not index.is_file():
        return

    def damaged(what: str) -> CheckpointChoiceError:
        others = intact_checkpoints(folder.parent, damaged=folder)
        return CheckpointChoiceError(f"--load {folder}: {what}: the checkpoint was damaged after its save (a disk "
                                     f"that filled, a copy cut short); {others}")

    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(folder)).read_metadata().storage_data
    except Exception as exc:  # noqa: BLE001  (any unpickling error: the index is damaged)
        raise damaged(f"{index} cannot be read ({type(exc).__name__}: {exc})") from None
    ends: dict[str, int] = {}
    for item in storage.values():
        ends[item.relative_path] = max(ends.get(item.relative_path, 0), item.offset + item.length)
    for name, end in sorted(ends.items()):
        file = folder / name
        if not file.is_file():
            raise damaged(f"{file} is missing ({index} places saved tensors in it)")
        size = file.stat().st_size
        if size < end:
            raise damaged(f"{file} is {size:,} bytes, but {index} places saved tensors up to byte {end:,} (truncated)")
    common = folder / DCP_COMMON
    if common.is_file():
        try:
            with zipfile.ZipFile(common) as z:
                bad = z.testzip()
        except (zipfile.BadZipFile, OSError) as exc:
            raise damaged(f"{common} is not a whole file ({exc})") from None
        if bad is not None:
            raise damaged(f"{common}: its entry {bad} fails its CRC check")


def marker_step(path: Path) -> int:
    """The step in a complete checkpoint's marker; a marker that is not what a save writes is an error
    naming the file, with the other checkpoints to resume from."""
    marker = path / MARKER_FILE
    try:
        d = json.loads(marker.read_text())
        step = int(d["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointChoiceError(
            f"--load: {marker} is not a complete checkpoint marker ({type(exc).__name__}: {exc}); the save that "
            f"wrote it was cut short or the file was changed. {intact_checkpoints(path.parent)}") from None
    extra = d.get("extra") if isinstance(d, dict) else None
    if not isinstance(extra, dict) or "rollout_id" not in extra or "rollout" not in extra:
        raise CheckpointChoiceError(
            f"--load {path}: {marker} holds no training position (extra.rollout_id, extra.rollout): a model-only "
            "checkpoint (tools/convert_hf_to_megatron.py writes these), which --ref-load takes; a run starts from "
            "--hf-checkpoint without --load")
    return step


def later_checkpoints(root: str | Path, step: int | None) -> list[Path]:
    """The complete checkpoints under `root` after `step` (None: every one)."""
    return [p for s, p in _complete_steps(Path(root)) if step is None or s > step]


def choose_checkpoint(load: str | Path | None, ckpt_step: int | None = None) -> Path | None:
    """The checkpoint folder a run resumes from (None: a fresh start).

    `load` is a save root (its newest complete checkpoint, or iteration `ckpt_step` of it) or one
    complete iteration folder (exactly that one). A missing folder, or one holding no checkpoint at
    all, is a fresh start (the first run of `--load X --save X`). A path that names a checkpoint that is
    not there or not complete is an error: a run never starts fresh over one a user pointed at."""
    if load is None:
        if ckpt_step is not None:
            raise CheckpointChoiceError(f"--ckpt-step {ckpt_step} needs --load (the save folder to take it from)")
        return None
    p = Path(load)
    if _ITER_RE.match(p.name) or _TMP_RE.match(p.name):  # one iteration folder
        if ckpt_step is not None:
            raise CheckpointChoiceError(f"--ckpt-step {ckpt_step} with --load {p}: --load already names one "
                                        f"checkpoint; give the save folder ({p.parent}) with --ckpt-step, or drop it")
        if not is_complete(p):
            what = "does not exist" if not p.exists() else "is not a complete checkpoint (an interrupted save: no " \
                f"{MARKER_FILE} or {DIST_CKPT_METADATA})"
            raise CheckpointChoiceError(f"--load {p} {what}; {intact_checkpoints(p.parent)}")
        return _resumable(p)
    if not p.is_dir():
        if ckpt_step is not None:
            raise CheckpointChoiceError(f"--ckpt-step {ckpt_step}: --load {p} does not exist")
        return None
    if ckpt_step is not None:
        folder = iter_dir(p, ckpt_step)
        if not is_complete(folder):
            raise CheckpointChoiceError(f"--ckpt-step {ckpt_step}: {folder} is not a complete checkpoint; "
                                        f"{intact_checkpoints(p)}")
        return _resumable(folder)
    latest = latest_checkpoint(p)
    if latest is None and (p / TRACKER_FILE).is_file():
        latest = _megatron_lm_folder(p)  # Megatron-LM's own save (weights only)
        if latest is not None:
            check_shards(latest)
            return latest
    if latest is None:
        if any(_ITER_RE.match(c.name) for c in p.iterdir()):
            raise CheckpointChoiceError(f"--load {p}: it holds iteration folders but none is complete (interrupted "
                                        "saves); nothing to resume from, and starting fresh there would mix two runs")
        return None
    return _resumable(latest)


def _resumable(folder: Path) -> Path:
    """`folder`, once its marker holds a run position and its files are whole (errors name what is not)."""
    marker_step(folder)
    check_shards(folder)
    return folder


def check_save_folder(save: str | Path | None, resume_from: Path | None) -> None:
    """A run writes iter_<step> folders into --save from the step after `resume_from` (None: from step 0
    on): refuse before anything starts when --save already holds complete checkpoints that this run
    would overwrite or mix with (those of another run, or later ones than the one resumed)."""
    if save is None:
        return
    root = Path(save)
    steps = _complete_steps(root)
    if not steps:
        return
    if resume_from is None:
        newest = steps[-1][1]
        raise CheckpointChoiceError(
            f"--save {root} already holds checkpoints of a run (newest: {newest.name}); this run would start "
            f"fresh and overwrite them. To continue that run: --load {root}; to start another: another --save folder")
    if resume_from.parent.resolve() != root.resolve():
        raise CheckpointChoiceError(
            f"--save {root} already holds checkpoints of another run (newest: {steps[-1][1].name}) than --load "
            f"{resume_from}; this run would mix its checkpoints with them. Save into another folder")
    # a Megatron-LM folder (no marker of ours) gives the weights only: the run counts from step 0
    step = marker_step(resume_from) if (resume_from / MARKER_FILE).is_file() else -1
    later = later_checkpoints(root, step)
    if later:
        names = ", ".join(p.name for p in later)
        raise CheckpointChoiceError(
            f"--load {resume_from} resumes at step {step + 1}, but --save {root} already holds later checkpoints "
            f"({names}) that this run would overwrite. Save into another folder (e.g. --save {root}-from-{step}), or "
            f"move those folders out of {root} first")
