"""Weight sync through files (`--update-weight-transport disk`), slime's disk transport, for engines that
share a filesystem with the trainer but no collective (another cluster, a slow link).

Full mode: each sync writes a complete HF checkpoint folder `<disk dir>/v<N>/` (the trainer's HF tensors,
and the config and tokenizer files of `--hf-checkpoint`); every engine loads it through SGLang's
`/update_weights_from_disk`, or, with `--update-weight-local-checkpoint-dir`, from a copy that a puller on
its host made first. The previous version's folder is removed once every engine has the new one
(`--update-weight-disk-keep-files` keeps them).

Delta mode (`--update-weight-mode delta`): each sync writes only what changed since the one before: per
tensor, its bytes XORed with the previous ones (`--update-weight-delta-encoding xor`: an involution, applied
exactly once against its base) or the changed byte positions with their new bytes (`overwrite`: applying it
again changes nothing), zstd-compressed, with a checksum of the new bytes (`--update-weight-delta-checksum`).
The first base is `--hf-checkpoint`, which the engines started from (a tensor absent there, or in another
dtype, is based on zeros / the checkpoint's values cast to the trainer's dtype, on both sides alike). A
puller on each host of an engine (its Ray actor: SGLang 0.5.23 has no pull endpoint) applies every
version it has not applied, in order, into a full local checkpoint (`--update-weight-local-checkpoint-dir`,
built from `--hf-checkpoint` by the first pull), checks each tensor's checksum, and the engine then loads
that folder. Every version folder is kept: a fresh host rebuilds its checkpoint from the chain.

A version folder is complete when its `index.json` exists (written last, by global rank 0, after every
pipeline stage wrote its part). Layout of a delta version: `delta-pp<k>.safetensors` (each changed
tensor's compressed payload as a uint8 array, under the tensor's HF name), `index-pp<k>.json` (a stage's
part of the index) and `index.json`: {format, version, weight_version, mode, encoding, checksum,
compression, tensors: {name: {dtype, shape, checksum, changed_bytes, file}}}.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slime_rl.engines.dist_group import dtype_name
from slime_rl.trainer.checkpoint_layout import copy_hf_metadata, write_atomic
from slime_rl.trainer.hf_files import read_hf_tensors, read_indexed, safetensors_index
from slime_rl.weight_sync.broadcast import EngineControl, check_ok

FORMAT = "slime_rl.disk_weights/1"
ENCODINGS = ("xor", "overwrite")
CHECKSUMS = ("xxh3-128", "blake3", "adler32")
INDEX = "index.json"
LOCAL_STATE = "slime_rl_weights_version.json"  # in a local checkpoint: the last version applied to it


def checksum(algorithm: str, data: bytes | memoryview | np.ndarray) -> str:
    """The hex digest of `data` by one of CHECKSUMS (xxhash's XXH3-128, BLAKE3, zlib's Adler-32)."""
    buf = memoryview(np.ascontiguousarray(data)).cast("B") if isinstance(data, np.ndarray) else data
    if algorithm == "xxh3-128":
        import xxhash

        return xxhash.xxh3_128_hexdigest(buf)
    if algorithm == "blake3":
        import blake3

        return blake3.blake3(buf).hexdigest()
    if algorithm == "adler32":
        return f"{zlib.adler32(buf) & 0xFFFFFFFF:08x}"
    raise ValueError(f"checksum {algorithm!r}: expected one of {CHECKSUMS}")


def encode(encoding: str, old: np.ndarray, new: np.ndarray) -> tuple[bytes, int]:
    """(zstd-compressed payload, count of changed bytes) turning `old` into `new` (1-D uint8 arrays of one
    length). xor: new ^ old. overwrite: the changed positions (int64) then their new bytes."""
    import zstandard

    if old.shape != new.shape:
        raise ValueError(f"delta of {old.size} against {new.size} bytes")
    if encoding == "xor":
        diff = np.bitwise_xor(old, new)
        changed = int(np.count_nonzero(diff))
        raw = diff.tobytes()
    elif encoding == "overwrite":
        where = np.flatnonzero(old != new).astype(np.int64)
        changed = int(where.size)
        raw = np.int64(where.size).tobytes() + where.tobytes() + new[where].tobytes()
    else:
        raise ValueError(f"encoding {encoding!r}: expected one of {ENCODINGS}")
    return zstandard.ZstdCompressor(level=1).compress(raw), changed


def apply(encoding: str, base: np.ndarray, payload: bytes | np.ndarray) -> None:
    """Turn `base` (1-D uint8, writable; a memory map of the tensor's bytes in a checkpoint file) into the
    new bytes, in place."""
    import zstandard

    raw = zstandard.ZstdDecompressor().decompress(bytes(payload))
    if encoding == "xor":
        if len(raw) != base.size:
            raise ValueError(f"xor delta of {len(raw)} bytes for a tensor of {base.size}")
        np.bitwise_xor(base, np.frombuffer(raw, dtype=np.uint8), out=base)
    elif encoding == "overwrite":
        n = int(np.frombuffer(raw[:8], dtype=np.int64)[0])
        where = np.frombuffer(raw[8:8 + 8 * n], dtype=np.int64)
        values = np.frombuffer(raw[8 + 8 * n:], dtype=np.uint8)
        if values.size != n or (n and int(where.max()) >= base.size):
            raise ValueError(f"overwrite delta of {n} positions does not fit a tensor of {base.size} bytes")
        base[where] = values
    else:
        raise ValueError(f"encoding {encoding!r}: expected one of {ENCODINGS}")


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes as a 1-D uint8 array (a copy)."""
    return t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().copy()


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"v{version:08d}"


def _write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=1, sort_keys=True))


def _materialize(items: Iterable[tuple]) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) from weight_sync items: (name, tensor) or (name, source, hf_shape)."""
    for item in items:
        name, t = item[0], item[1]
        yield name, (t.reshape(item[2]) if len(item) == 3 else t)


class DiskWriter:
    """The trainer's side, on a stage's source rank: writes its stage's part of each version."""

    def __init__(self, root: str, mode: str, encoding: str, checksum_algorithm: str, hf_checkpoint: str,
                 stage: int, file_bytes: int = 512 * 1024**2) -> None:
        self.root, self.mode, self.encoding, self.checksum = Path(root), mode, encoding, checksum_algorithm
        self.hf_checkpoint, self.stage, self.file_bytes = Path(hf_checkpoint), stage, file_bytes
        self._snapshot: dict[str, np.ndarray] | None = None  # delta: each tensor's bytes at the last version
        self._base: dict[str, Path] | None = None  # delta, until the first version: each tensor's --hf-checkpoint file

    def write(self, items: Iterable[tuple], version: int) -> dict[str, float]:
        """This stage's tensors of `version`; returns the bytes written and the seconds taken."""
        start = time.perf_counter()
        out = version_dir(self.root, version)
        out.mkdir(parents=True, exist_ok=True)
        if self.mode == "full":
            part, written = self._write_full(items, out)
        else:
            part, written = self._write_delta(items, out)
        _write_json(out / f"index-pp{self.stage:03d}.json", part)
        return {"weight_sync/bytes": float(written), "weight_sync/seconds": time.perf_counter() - start}

    def _write_full(self, items: Iterable[tuple], out: Path) -> tuple[dict, int]:
        """The stage's tensors in files of about `file_bytes` each (a stage's weights are never all in host
        memory at once); each tensor a copy (a view into a fused parameter shares its storage, which
        safetensors refuses)."""
        from safetensors.torch import save_file

        part: dict[str, dict] = {}
        written, chunk, size, k = 0, {}, 0, 0

        def flush() -> int:
            nonlocal chunk, size, k
            k += 1
            path = out / f"model-pp{self.stage:03d}-{k:05d}.safetensors"
            save_file(chunk, str(path), metadata={"format": "pt"})
            for n, t in chunk.items():
                part[n] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "file": path.name}
            chunk, size = {}, 0
            return path.stat().st_size

        for name, t in _materialize(items):
            chunk[name] = t.detach().to("cpu", copy=True).contiguous()
            size += chunk[name].numel() * chunk[name].element_size()
            if size >= self.file_bytes:
                written += flush()
        if chunk:
            written += flush()
        return part, written

    def _write_delta(self, items: Iterable[tuple], out: Path) -> tuple[dict, int]:
        from safetensors.numpy import save_file

        if self._snapshot is None:
            self._snapshot = {}
            self._base = safetensors_index(self.hf_checkpoint)
        payloads: dict[str, np.ndarray] = {}
        part: dict[str, dict] = {}
        path = out / f"delta-pp{self.stage:03d}.safetensors"
        for name, t in _materialize(items):
            new = tensor_bytes(t)
            old = self._snapshot.get(name)
            if old is None:  # the first version: its base is what the engines started from (this stage's
                # tensors of it only, read one at a time)
                old = _base_bytes(_read_one(self._base, name), t.dtype, tuple(t.shape))
            payload, changed = encode(self.encoding, old, new)
            entry = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "changed_bytes": changed}
            if changed:
                payloads[name] = np.frombuffer(payload, dtype=np.uint8)
                entry |= {"checksum": checksum(self.checksum, new), "file": path.name}
            part[name] = entry
            self._snapshot[name] = new
        self._base = None  # every later version is based on the one before
        if payloads:
            save_file(payloads, str(path))
        return part, sum(p.size for p in payloads.values())


def _read_one(where: dict[str, Path], name: str) -> torch.Tensor | None:
    """The tensor `name` of a checkpoint (`where`: hf_files.safetensors_index's map), None if it has none (an expert's
    tensor of a checkpoint that stores them fused: its slice, hf_files.read_indexed)."""
    return read_indexed(where, [name], missing_ok=True).get(name)


def _base_bytes(base: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """The bytes a tensor's first delta is based on: the checkpoint's tensor in the trainer's dtype, or zeros
    where the checkpoint has none of that shape."""
    if base is None or tuple(base.shape) != shape:
        return np.zeros(int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size(),
                        dtype=np.uint8)
    return tensor_bytes(base.to(dtype))


def finish_version(root: str, version: int, weight_version: str, mode: str, encoding: str,
                   checksum_algorithm: str, stages: int, run: str) -> dict:
    """Global rank 0, after every stage wrote its part: the version's index.json (it completes the folder;
    full mode's HF files come next, `full_folder`)."""
    out = version_dir(root, version)
    tensors: dict[str, dict] = {}
    for k in range(stages):
        tensors.update(json.loads((out / f"index-pp{k:03d}.json").read_text()))
    index = {"format": FORMAT, "run": run, "version": version, "weight_version": weight_version, "mode": mode,
             "tensors": tensors}
    if mode == "delta":
        index |= {"encoding": encoding, "checksum": checksum_algorithm, "compression": "zstd"}
    _write_json(out / INDEX, index)
    return index


def full_folder(root: str, version: int, hf_checkpoint: str) -> Path:
    """Global rank 0, full mode: make the version folder loadable as an HF checkpoint (its config and
    tokenizer files, and model.safetensors.index.json naming each tensor's file)."""
    out = version_dir(root, version)
    copy_hf_metadata(hf_checkpoint, out)
    index = json.loads((out / INDEX).read_text())
    _write_json(out / "model.safetensors.index.json",
                {"metadata": {}, "weight_map": {n: e["file"] for n, e in index["tensors"].items()}})
    return out


def remove_versions_before(root: str, version: int) -> None:
    """Full mode: the folders of the versions before `version` (every engine has loaded `version`)."""
    for d in Path(root).glob("v*"):
        if d.is_dir() and len(d.name) == 9 and d.name[1:].isdigit() and int(d.name[1:]) < version:
            shutil.rmtree(d, ignore_errors=True)


# ---- the engine host's side


def _safetensors_layout(path: Path) -> tuple[int, dict[str, dict]]:
    """(offset of the data, {name: {dtype, shape, data_offsets}}) from a safetensors file's header: 8 bytes of
    little-endian header length, then the JSON header (the format's specification)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def pull(root: str, version: int, local_dir: str | None, hf_checkpoint: str) -> str:
    """On an engine's host: bring the local checkpoint to `version` and return the folder the engine loads.
    Full mode without a local folder: the version folder itself. Full mode with one: a copy of it there.
    Delta mode: every version after the local checkpoint's applied to it in order (built from
    `hf_checkpoint` first), each tensor's checksum checked."""
    folder = version_dir(root, version)
    index = json.loads((folder / INDEX).read_text())
    if index["mode"] == "full":
        if local_dir is None:
            return str(folder)
        local = Path(local_dir)
        local.mkdir(parents=True, exist_ok=True)
        for f in local.glob("*.safetensors"):
            f.unlink()
        for f in folder.iterdir():
            if f.is_file() and not f.name.startswith("index"):
                shutil.copy2(f, local / f.name)
        _write_json(local / LOCAL_STATE, {"run": index["run"], "version": version})
        return str(local)
    if local_dir is None:
        raise ValueError("--update-weight-mode delta needs --update-weight-local-checkpoint-dir")
    local = Path(local_dir)
    state = local / LOCAL_STATE
    held = json.loads(state.read_text()) if state.exists() else {}
    # another run's checkpoint (or none): built again from --hf-checkpoint, the base of this run's first version
    at = held["version"] if held.get("run") == index["run"] else None
    if at is not None and at > version:
        raise ValueError(f"{local}: its checkpoint is at version {at}, after the {version} asked for")
    first = 1 if at is None else at + 1
    if at is None:  # every tensor of the first version (later ones leave out a frozen vision tower)
        _build_local(local, Path(hf_checkpoint), json.loads((version_dir(root, 1) / INDEX).read_text()))
    for v in range(first, version + 1):
        _apply_version(local, version_dir(root, v))
        _write_json(state, {"run": index["run"], "version": v})
    return str(local)


def _build_local(local: Path, hf_checkpoint: Path, index: dict) -> None:
    """The base of the first delta, as one file: each tensor of the index from --hf-checkpoint in the
    index's dtype (zeros where it has none of that shape), with the checkpoint's other files."""
    from safetensors.torch import save_file

    local.mkdir(parents=True, exist_ok=True)
    for f in local.glob("*.safetensors"):
        f.unlink()
    base = read_hf_tensors(hf_checkpoint, list(index["tensors"]), missing_ok=True)
    tensors = {}
    for name, e in index["tensors"].items():
        dtype, shape = getattr(torch, e["dtype"]), tuple(e["shape"])
        t = base.get(name)
        tensors[name] = (t.to(dtype).contiguous() if t is not None and tuple(t.shape) == shape
                         else torch.zeros(shape, dtype=dtype))
    copy_hf_metadata(hf_checkpoint, local)
    save_file(tensors, str(local / "model.safetensors"), metadata={"format": "pt"})


def _apply_version(local: Path, folder: Path) -> None:
    from safetensors.numpy import load_file

    index = json.loads((folder / INDEX).read_text())
    target = local / "model.safetensors"
    offset, layout = _safetensors_layout(target)
    missing = sorted(set(index["tensors"]) - set(layout))
    if missing:
        raise ValueError(f"{folder}: tensors {missing[:5]} are not in {target} (a checkpoint of another model?)")
    payloads: dict[str, np.ndarray] = {}
    for name in sorted({e["file"] for e in index["tensors"].values() if e.get("file")}):
        payloads.update(load_file(str(folder / name)))
    data = np.memmap(target, dtype=np.uint8, mode="r+")
    try:
        for name, e in index["tensors"].items():
            if not e["changed_bytes"]:
                continue
            lo, hi = layout[name]["data_offsets"]
            view = data[offset + lo:offset + hi]
            apply(index["encoding"], view, payloads[name])
            got = checksum(index["checksum"], view)
            if got != e["checksum"]:
                raise ValueError(f"{folder}: {name} after the delta has {index['checksum']} {got}, expected "
                                 f"{e['checksum']} (a version skipped or applied twice?)")
        data.flush()
    finally:
        del data



# ---- the trainer's updater


class DiskUpdater(EngineControl):
    """One per trainer rank in place of the broadcaster (`--update-weight-transport disk`). Every rank runs
    `sync()` (the TP gathers are collective); a stage's source writes its part of the version; then global
    rank 0 `publish()`es it: the index, each engine host's pull (its Ray actor), each engine's
    /update_weights_from_disk. No weight-update session: SGLang 0.5.23's disk load needs none."""

    def __init__(self, engines: Sequence[Any], cfg: Any, is_source: bool, is_rank0: bool, stage: int, stages: int,
                 hf_checkpoint: str) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.cfg, self.is_source, self.is_rank0, self.stages = cfg, is_source, is_rank0, stages
        self.hf_checkpoint = hf_checkpoint
        self.root = cfg.update_weight_disk_dir
        self.mode = cfg.update_weight_mode
        self.writer = DiskWriter(self.root, self.mode, cfg.update_weight_delta_encoding,
                                 cfg.update_weight_delta_checksum, hf_checkpoint, stage,
                                 cfg.update_weight_buffer_size) if is_source else None
        self.version = 0  # the number of the last version written (every rank counts alike)
        self._pool = ThreadPoolExecutor(max_workers=4) if is_rank0 else None
        self._clients: list = []
        self.engines: list = []
        self.set_engines(engines)
        self.run = uuid.uuid4().hex  # names this run's versions (a local checkpoint of another run is rebuilt)
        if is_rank0:  # the versions of an earlier run are based on other weights (only version folders go)
            Path(self.root).mkdir(parents=True, exist_ok=True)
            remove_versions_before(self.root, 10**8)

    def set_engines(self, engines: Sequence[Any]) -> None:
        """The engines (EngineTarget: url, key, the Ray actors of its hosts); again after a restart."""
        from slime_rl.engines.client import KeepAliveEngineClient

        for c in self._clients:
            c.close()
        self.engines = list(engines)
        self._clients = [KeepAliveEngineClient(e.url, api_key=e.api_key) for e in self.engines] if self.is_rank0 \
            else []

    def begin_update(self) -> None:  # no session for a load from disk (pause / continue: EngineControl's)
        pass

    def end_update(self, quiet: bool = False) -> None:
        pass

    def sync(self, named_weights: Iterable[tuple], version: str, own_session: bool = False) -> dict[str, float]:
        """This rank's part of the next version (a source writes its stage's tensors)."""
        self.version += 1
        if self.writer is None:
            for _ in named_weights:  # take part in the TP/PP gathers that produce the tensors
                pass
            return {}
        return self.writer.write(named_weights, self.version)

    def publish(self, weight_version: str, pull_on_hosts: Callable[[Any, tuple], list[str]]) -> dict[str, float]:
        """Global rank 0, after every stage wrote: complete the version, have every host of every engine pull
        it (`pull_on_hosts(target, pull's arguments)`: the folder its engine loads, from each host's actor;
        the orchestration's, which holds them), and every engine load it. Returns the pull and load seconds."""

        start = time.perf_counter()
        cfg = self.cfg
        finish_version(self.root, self.version, weight_version, self.mode, cfg.update_weight_delta_encoding,
                       cfg.update_weight_delta_checksum, self.stages, self.run)
        if self.mode == "full":
            full_folder(self.root, self.version, self.hf_checkpoint)
        local = cfg.update_weight_local_checkpoint_dir
        args = (self.root, self.version, local, self.hf_checkpoint)
        folders = [pull_on_hosts(e, args)[0] if e.pullers else pull(*args) for e in self.engines]
        pulled = time.perf_counter()
        futures = [self._pool.submit(c.update_weights_from_disk, folder, weight_version)
                   for c, folder in zip(self._clients, folders, strict=True)]
        for f in futures:
            check_ok(f.result(), "update_weights_from_disk")
        if self.mode == "full" and not cfg.update_weight_disk_keep_files:
            remove_versions_before(self.root, self.version)
        end = time.perf_counter()
        return {"weight_sync/pull_seconds": pulled - start, "weight_sync/load_seconds": end - pulled}

    def destroy(self) -> None:
        self.close()

    def close(self) -> None:
        self._close_clients()
