"""weight_sync/disk.py: the delta encodings and checksums against independent references, the trainer's
versions applied on an engine host (a chain, a fresh host, another run's checkpoint, a damaged payload),
full mode's folders, and the built-in engine's /update_weights_from_disk."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from slime_rl.weight_sync import disk


def _changed(rng: np.random.Generator, old: np.ndarray, fraction: float) -> np.ndarray:
    new = old.copy()
    where = rng.choice(old.size, size=max(1, int(old.size * fraction)), replace=False)
    new[where] = rng.integers(0, 256, size=where.size, dtype=np.uint8)
    return new


@pytest.mark.parametrize("encoding", disk.ENCODINGS)
def test_a_delta_turns_the_old_bytes_into_the_new(encoding):
    rng = np.random.default_rng(0)
    old = rng.integers(0, 256, size=4099, dtype=np.uint8)
    new = _changed(rng, old, 0.05)
    payload, changed = disk.encode(encoding, old, new)
    assert changed == int(np.count_nonzero(old != new))  # the bytes that differ, counted by numpy
    base = old.copy()
    disk.apply(encoding, base, payload)
    assert np.array_equal(base, new)
    again = base.copy()
    disk.apply(encoding, again, payload)
    # overwrite is idempotent; xor is an involution: a second application gives the old bytes back
    assert np.array_equal(again, new if encoding == "overwrite" else old)
    same, none = disk.encode(encoding, new, new)
    assert none == 0
    kept = new.copy()
    disk.apply(encoding, kept, same)
    assert np.array_equal(kept, new)
    with pytest.raises(ValueError, match="bytes"):
        disk.apply(encoding, old[:100].copy(), payload)


def test_checksums_are_the_published_algorithms():
    # published test vectors: XXH3-128 and BLAKE3 of the empty input, Adler-32 of "Wikipedia"
    assert disk.checksum("xxh3-128", b"") == "99aa06d3014798d86001c324468d497f"
    assert disk.checksum("blake3", b"") == "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    assert disk.checksum("adler32", b"Wikipedia") == "11e60398"
    assert disk.checksum("adler32", np.frombuffer(b"Wikipedia", dtype=np.uint8)) == "11e60398"
    with pytest.raises(ValueError, match="expected one of"):
        disk.checksum("md5", b"")


def _checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """An HF folder in bf16 (the trainer below holds fp32) without `extra.bias` (a tensor the checkpoint lacks)
    and with `odd.weight` in another shape than the trainer's."""
    ckpt = tmp_path / "hf"
    ckpt.mkdir()
    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(8, 16, generator=g).bfloat16(), "b.weight": torch.randn(32, generator=g)
               .bfloat16(), "odd.weight": torch.randn(3, 3, generator=g).bfloat16()}
    save_file(tensors, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps({"model_type": "toy"}))
    (ckpt / "tokenizer.json").write_text("{}")
    g2 = torch.Generator().manual_seed(1)
    trainer = {"a.weight": tensors["a.weight"].float(), "b.weight": tensors["b.weight"].float(),
               "odd.weight": torch.randn(4, 4, generator=g2), "extra.bias": torch.randn(5, generator=g2)}
    return ckpt, trainer


def _step(trainer: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """An update that moves some tensors and leaves b.weight alone."""
    g = torch.Generator().manual_seed(seed)
    return {n: (t if n == "b.weight" else t + 1e-3 * torch.randn(t.shape, generator=g)) for n, t in trainer.items()}


def _publish(root: Path, ckpt: Path, versions: list[dict[str, torch.Tensor]], encoding: str = "xor",
             algorithm: str = "xxh3-128", run: str = "run-a", mode: str = "delta") -> None:
    """Two pipeline stages write their halves of each version; rank 0 completes it."""
    writers = [disk.DiskWriter(str(root), mode, encoding, algorithm, str(ckpt), stage) for stage in (0, 1)]
    for v, weights in enumerate(versions, start=1):
        names = sorted(weights)
        for stage, w in enumerate(writers):
            w.write([(n, weights[n]) for n in names[stage::2]], v)
        disk.finish_version(str(root), v, str(v), mode, encoding, algorithm, 2, run)
        if mode == "full":
            disk.full_folder(str(root), v, str(ckpt))


@pytest.mark.parametrize("encoding, algorithm", [("xor", "xxh3-128"), ("overwrite", "blake3"), ("xor", "adler32")])
def test_an_engine_host_applies_the_chain_to_its_checkpoint(tmp_path, encoding, algorithm):
    ckpt, w0 = _checkpoint(tmp_path)
    versions = [_step(w0, 1)]
    versions.append(_step(versions[-1], 2))
    versions.append(_step(versions[-1], 3))
    root = tmp_path / "shared"
    _publish(root, ckpt, versions, encoding, algorithm)
    index = json.loads((root / "v00000002" / "index.json").read_text())
    assert index["tensors"]["b.weight"]["changed_bytes"] == 0 and "file" not in index["tensors"]["b.weight"]
    assert index["tensors"]["a.weight"]["changed_bytes"] > 0
    # a host that pulls each version in turn, and a fresh host that pulls the last one: both hold the last weights
    step_by_step, fresh = tmp_path / "host1", tmp_path / "host2"
    for v in (1, 2, 3):
        folder = disk.pull(str(root), v, str(step_by_step), str(ckpt))
        assert folder == str(step_by_step)
        got = load_file(str(step_by_step / "model.safetensors"))
        assert set(got) == set(versions[v - 1])
        for n, t in versions[v - 1].items():
            assert torch.equal(got[n], t), (v, n)
    disk.pull(str(root), 3, str(fresh), str(ckpt))
    assert load_file(str(fresh / "model.safetensors")).keys() == versions[2].keys()
    for n, t in load_file(str(fresh / "model.safetensors")).items():
        assert torch.equal(t, versions[2][n]), n
    assert (fresh / "config.json").read_text() == (ckpt / "config.json").read_text()
    assert json.loads((fresh / disk.LOCAL_STATE).read_text()) == {"run": "run-a", "version": 3}
    disk.pull(str(root), 3, str(fresh), str(ckpt))  # asked again: applied once, not twice (xor would revert)
    assert torch.equal(load_file(str(fresh / "model.safetensors"))["a.weight"], versions[2]["a.weight"])
    with pytest.raises(ValueError, match="at version 3, after the 2 asked for"):
        disk.pull(str(root), 2, str(fresh), str(ckpt))


def test_another_runs_checkpoint_is_rebuilt_and_a_damaged_delta_is_named(tmp_path):
    ckpt, w0 = _checkpoint(tmp_path)
    root, host = tmp_path / "shared", tmp_path / "host"
    _publish(root, ckpt, [_step(w0, 1), _step(_step(w0, 1), 2)], run="run-a")
    disk.pull(str(root), 2, str(host), str(ckpt))
    # a new run writes its own versions (its trainer restarted from the checkpoint): the host's copy, at version
    # 2 of run-a, is built again from the checkpoint before run-b's version 1
    import shutil

    shutil.rmtree(root)
    new = _step(w0, 7)
    _publish(root, ckpt, [new], run="run-b")
    disk.pull(str(root), 1, str(host), str(ckpt))
    for n, t in load_file(str(host / "model.safetensors")).items():
        assert torch.equal(t, new[n]), n
    # a version whose recorded checksum does not match what the delta gives: named, with the tensor
    _publish(root, ckpt, [new, _step(new, 8)], run="run-c")
    index_path = root / "v00000002" / "index.json"
    index = json.loads(index_path.read_text())
    index["tensors"]["a.weight"]["checksum"] = "0" * 32
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="a.weight after the delta has xxh3-128"):
        disk.pull(str(root), 2, str(tmp_path / "host3"), str(ckpt))


def test_full_mode_writes_views_of_one_storage_in_files_of_the_size_asked(tmp_path):
    """Tensors that are views into one fused parameter (the trainer's QKV split) are written as copies, in
    files of about `file_bytes` each."""
    ckpt, _ = _checkpoint(tmp_path)
    fused = torch.arange(96, dtype=torch.float32).reshape(12, 8)
    items = [("q.weight", fused[:4]), ("k.weight", fused[4:8]), ("v.weight", fused[8:], (4, 8))]
    writer = disk.DiskWriter(str(tmp_path / "shared"), "full", "xor", "xxh3-128", str(ckpt), 0, file_bytes=200)
    writer.write(items, 1)
    folder = disk.version_dir(tmp_path / "shared", 1)
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert files == ["model-pp000-00001.safetensors", "model-pp000-00002.safetensors"]  # q and k, then v
    got = {}
    for f in files:
        got |= load_file(str(folder / f))
    assert all(torch.equal(got[n], fused[4 * i:4 * i + 4]) for i, n in enumerate(["q.weight", "k.weight", "v.weight"]))


def test_full_mode_folders_load_as_checkpoints(tmp_path):
    ckpt, w0 = _checkpoint(tmp_path)
    root = tmp_path / "shared"
    versions = [_step(w0, 1), _step(_step(w0, 1), 2)]
    _publish(root, ckpt, versions, mode="full")
    folder = Path(disk.pull(str(root), 2, None, str(ckpt)))
    assert folder == root / "v00000002"
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    got = {}
    for f in sorted(set(weight_map.values())):
        got |= load_file(str(folder / f))
    assert got.keys() == versions[1].keys() and all(torch.equal(got[n], versions[1][n]) for n in got)
    assert (folder / "config.json").exists() and (folder / "tokenizer.json").exists()
    local = Path(disk.pull(str(root), 2, str(tmp_path / "local"), str(ckpt)))
    assert sorted(p.name for p in local.glob("*.safetensors")) == sorted(set(weight_map.values()))
    disk.remove_versions_before(str(root), 2)
    assert sorted(p.name for p in root.iterdir()) == ["v00000002"]


def test_the_builtin_engine_loads_a_folder_from_disk(tiny_qwen2, tmp_path):
    """/update_weights_from_disk as SGLang 0.5.23 answers it (UpdateWeightFromDiskReqOutput's fields): every
    tensor of the folder in the model, cast to its dtype; a tensor that does not fit loads nothing."""
    from slime_rl.engines.client import EngineClient
    from tests.engines.engine_testlib import start_server

    server = start_server(tiny_qwen2)
    try:
        weights = load_file(str(tiny_qwen2 / "model.safetensors"))
        moved = {n: (t.float() + 0.5).to(torch.bfloat16) for n, t in weights.items()}
        (tmp_path / "v").mkdir()
        save_file(moved, str(tmp_path / "v" / "model.safetensors"))
        with EngineClient(server.url) as client:  # over HTTP, the payload the trainer's updater sends
            body = client.update_weights_from_disk(str(tmp_path / "v"), "4")
            assert client.get_model_info()["weight_version"] == "4"
        assert body == {"success": True, "message": "Succeeded to update model weights. Weight version updated "
                        "to 4.", "num_paused_requests": 0}
        for n, t in moved.items():
            assert torch.equal(server.weights.params[n].detach(), t.to(server.weights.params[n].dtype)), n
        name = "model.norm.weight"
        bad = dict(moved) | {name: torch.zeros(3)}
        save_file(bad, str(tmp_path / "v" / "model.safetensors"))
        before = server.weights.params["model.embed_tokens.weight"].detach().clone()
        code, body = server.route("POST", "/update_weights_from_disk", {"model_path": str(tmp_path / "v")})
        assert code == 400 and body["success"] is False and f"{name}: shape [3] does not match" in body["message"]
        assert torch.equal(server.weights.params["model.embed_tokens.weight"].detach(), before)
        code, body = server.route("POST", "/update_weights_from_disk", {"model_path": str(tmp_path / "none")})
        assert code == 400 and "no *.safetensors files" in body["message"]
    finally:
        server.shutdown()


CONFIG = ["--hf-checkpoint", "m", "--prompt-data", "d.jsonl", "--rollout-batch-size", "4", "--num-rollout", "2",
          "--rm-type", "digit", "--micro-batch-size", "1"]
DISK = ["--update-weight-transport", "disk", "--update-weight-disk-dir", "/shared/sync"]


def test_disk_flags_land_in_the_config_as_slime_names_them():
    from slime_rl.config import build_config

    ws = build_config(CONFIG + DISK + ["--update-weight-mode", "delta", "--update-weight-local-checkpoint-dir",
                                       "/nvme/ckpt", "--update-weight-delta-encoding", "overwrite",
                                       "--update-weight-delta-checksum", "blake3"], check_paths=False).weight_sync
    assert (ws.update_weight_transport, ws.update_weight_mode, ws.update_weight_disk_dir,
            ws.update_weight_local_checkpoint_dir, ws.update_weight_delta_encoding,
            ws.update_weight_delta_checksum) == ("disk", "delta", "/shared/sync", "/nvme/ckpt", "overwrite", "blake3")
    plain = build_config(CONFIG, check_paths=False).weight_sync
    assert (plain.update_weight_transport, plain.update_weight_mode, plain.update_weight_delta_encoding,
            plain.update_weight_delta_checksum) == ("nccl", "full", "xor", "xxh3-128")


@pytest.mark.parametrize(("extra", "message"), [
    (["--update-weight-mode", "delta"], "--update-weight-mode delta goes through files: add --update-weight-transport "
                                        "disk"),
    (["--update-weight-disk-dir", "/x"], "--update-weight-disk-dir is for --update-weight-transport disk"),
    (["--update-weight-transport", "disk"], "--update-weight-transport disk needs --update-weight-disk-dir"),
    (DISK + ["--colocate"], "--update-weight-transport disk with --colocate"),
    (DISK + ["--update-weight-mode", "delta"], "--update-weight-mode delta needs --update-weight-local-checkpoint-dir"),
    (DISK + ["--update-weight-mode", "delta", "--update-weight-local-checkpoint-dir", "/y",
             "--update-weight-disk-keep-files"], "--update-weight-disk-keep-files is for full mode"),
    (DISK + ["--update-weight-local-checkpoint-dir", "/shared/sync/"], "must not be --update-weight-disk-dir"),
])
def test_disk_combinations_that_cannot_work_are_refused_naming_the_flags(extra, message):
    from slime_rl.config import ConfigError, build_config

    with pytest.raises(ConfigError, match=message):
        build_config(CONFIG + extra, check_paths=False)


def test_the_first_delta_of_a_fused_experts_checkpoint_is_based_on_each_experts_slice(tmp_path):
    """A checkpoint that stores a layer's experts fused (Qwen3.5-MoE: mlp.experts.gate_up_proj [experts, 2 x width,
    hidden], each expert's gate rows then its up rows; mlp.experts.down_proj [experts, hidden, width]) while the
    trainer sends them per expert: the first version's base of expert e's gate / up / down is that slice, so an
    expert the step left alone changes no byte, and a host builds its checkpoint from the same slices."""
    ckpt = tmp_path / "hf"
    ckpt.mkdir()
    g = torch.Generator().manual_seed(0)
    head = "model.language_model.layers.0.mlp.experts."
    gate_up, down = torch.randn(2, 6, 4, generator=g).bfloat16(), torch.randn(2, 4, 3, generator=g).bfloat16()
    save_file({head + "gate_up_proj": gate_up, head + "down_proj": down}, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps({"model_type": "toy"}))
    sent = {f"{head}{e}.{kind}_proj.weight": t for e in range(2)
            for kind, t in (("gate", gate_up[e, :3]), ("up", gate_up[e, 3:]), ("down", down[e]))}
    sent[head + "1.up_proj.weight"] = sent[head + "1.up_proj.weight"] + 1.0  # the one tensor the step moved
    root = tmp_path / "shared"
    _publish(root, ckpt, [sent])
    index = json.loads((root / "v00000001" / "index.json").read_text())
    assert {n for n, e in index["tensors"].items() if e["changed_bytes"]} == {head + "1.up_proj.weight"}
    host = tmp_path / "host"
    disk.pull(str(root), 1, str(host), str(ckpt))
    got = load_file(str(host / "model.safetensors"))
    assert set(got) == set(sent) and all(torch.equal(got[n], t) for n, t in sent.items())


def test_the_builtin_engine_takes_and_drops_the_draft_models_tensors(tiny_glm4_moe_lite_mtp):
    """A checkpoint with a multi-token-prediction layer (num_nextn_predict_layers 1): its tensors model.layers.4.*
    belong to SGLang's speculative draft model, which the target model skips and the draft loads
    (tests/contract/test_sglang_mtp_weights.py); the built-in engine has no draft, so an update that holds them (weight
    sync under --mtp-num-layers) succeeds and loads the rest."""
    from tests.engines.engine_testlib import start_server

    server = start_server(tiny_glm4_moe_lite_mtp)
    try:
        assert not any(n.startswith("model.layers.4.") for n in server.weights.params)
        code, body = server.route("POST", "/update_weights_from_disk", {"model_path": str(tiny_glm4_moe_lite_mtp)})
        assert code == 200 and body["success"] is True, body
    finally:
        server.shutdown()
