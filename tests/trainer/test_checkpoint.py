"""Megatron distributed checkpoints: exact resume, interrupted saves, TP resharding, pruning.

The multi-rank parts run in spawned gloo processes (checkpoint_scenarios.py), one scenario per
phase, so that a resume starts from fresh processes with nothing left in memory:
  save   (TP=2, world 2): train 2 steps, save at step 2, train 2 more (the reference);
         then a save of step 4 whose writer dies after every shard is on disk;
  resume (TP=2, world 2): latest_checkpoint, load, train the same 2 steps;
  tp1    (TP=1, world 1): load the TP=2 checkpoint's weights.
Tolerances: resume is bit-exact (losses, grad norms, every weight, Adam moments and step, RNG);
TP=1 vs TP=2 weights bit-exact; log-probs 1e-5 absolute (measured ~5e-7: only the reduction
order of the TP=2 matmuls differs).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slime_rl.trainer import checkpoint as ck
from tests.conftest import free_port
from tests.trainer.checkpoint_scenarios import run_scenario

EXTRA = {"rollout_id": 2, "data": {"epoch": 0, "offset": 8}}


@pytest.fixture(scope="module")
def runs(tiny_qwen2, tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("checkpoint")
    root, out = base / "ckpt", base / "out"
    out.mkdir()
    args = {"hf": str(tiny_qwen2), "root": str(root)}
    save = run_scenario("save", 2, free_port(), out, args)
    crashed = sorted(p.name for p in root.iterdir())
    # a folder that never got the marker (e.g. written by a crashed non-atomic copy), and a tracker
    # that names it: neither may make latest_checkpoint skip the complete step 2
    fake = root / "iter_0000006"
    fake.mkdir()
    (fake / ck.DIST_CKPT_METADATA).write_text("{}")
    (root / ck.TRACKER_FILE).write_text("6")
    resume = run_scenario("resume", 2, free_port(), out, args)
    tp1 = run_scenario("tp1", 1, free_port(), out, args)
    return {"root": root, "save": save, "resume": resume, "tp1": tp1, "crashed": crashed}


@pytest.mark.slow
def test_interrupted_save_is_skipped(runs):
    root = runs["root"]
    assert [r["crash"] for r in runs["save"]] == ["simulated crash"] * 2
    # the dying save left its folder under the temporary name, complete shards but no marker
    assert runs["crashed"] == ["iter_0000002", "iter_0000004.tmp", ck.TRACKER_FILE]
    assert (root / "iter_0000004.tmp" / ck.DIST_CKPT_METADATA).is_file()
    assert not (root / "iter_0000004.tmp" / ck.MARKER_FILE).exists()
    assert ck.latest_checkpoint(root) == root / "iter_0000002"
    assert all(r["latest"] == str(root / "iter_0000002") for r in runs["resume"])
    info = ck.read_checkpoint_info(root)
    assert (info.step, info.extra, info.contents) == (2, EXTRA, ("model", "optimizer", "lr_scheduler", "rng_state"))
    assert info.topology == {"world": 2, "tp": 2, "pp": 1, "dp": 1}


@pytest.mark.slow
def test_resume_is_exact(runs):
    for save, resume in zip(runs["save"], runs["resume"], strict=True):
        assert resume["extra"] == EXTRA
        for name, t in save["at_save"].items():
            assert torch.equal(resume["loaded"][name], t), name
        assert len(resume["adam_loaded"]) == len(save["adam_at_save"]) > 0
        for got, want in zip(resume["adam_loaded"], save["adam_at_save"], strict=True):
            assert set(got) == set(want) == {"step", "exp_avg", "exp_avg_sq"}
            for k in want:
                assert torch.equal(got[k], want[k]), k
        assert torch.equal(resume["rng_after_load"], save["rng_after_save"])
        # losses, grad norms, lr (the schedule), every metric: the same floats
        assert resume["second"] == save["second"]
        for name, t in save["after"].items():
            assert torch.equal(resume["after"][name], t), name
    # the test is not vacuous: the 2 steps after the save moved the weights
    s = runs["save"][0]
    assert any(not torch.equal(s["after"][n], t) for n, t in s["at_save"].items())


@pytest.mark.slow
def test_tp2_checkpoint_loads_at_tp1(runs):
    (tp1,), save = runs["tp1"], runs["save"][0]
    assert "dp_reshardable" in tp1["refused"] and "TP=2" in tp1["refused"]
    assert tp1["extra"] == EXTRA
    for name, t in save["at_save"].items():
        assert torch.equal(tp1["loaded"][name], t), name
    diff = max(abs(a - b) for got, want in zip(tp1["logp"], save["logp_at_save"], strict=True)
               for a, b in zip(got, want, strict=True))
    assert diff <= 1e-5, diff


def _fake_checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    d = ck.iter_dir(root, step)
    if not complete:
        d = d.with_name(d.name + ck.TMP_SUFFIX)
    d.mkdir(parents=True)
    (d / ck.DIST_CKPT_METADATA).write_text("{}")
    if complete:
        (d / ck.MARKER_FILE).write_text(json.dumps({"step": step, "extra": {}, "contents": ["model"]}))
    return d


def test_keep_last_and_detection(tmp_path, tiny_qwen2):
    root = tmp_path / "ckpt"
    assert ck.latest_checkpoint(root) is None and not ck.is_megatron_checkpoint(root)
    for step in (1, 2, 3):
        _fake_checkpoint(root, step)
    stale, running = _fake_checkpoint(root, 2, complete=False), _fake_checkpoint(root, 5, complete=False)
    assert ck.latest_checkpoint(root) == ck.iter_dir(root, 3)
    deleted = ck.keep_last(root, 2)
    assert sorted(deleted) == sorted([ck.iter_dir(root, 1), stale])
    # a .tmp newer than every complete checkpoint may be a save in progress: kept
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000002", "iter_0000003", running.name]
    with pytest.raises(ValueError, match="n=0"):
        ck.keep_last(root, 0)
    assert ck.is_megatron_checkpoint(root) and ck.is_megatron_checkpoint(ck.iter_dir(root, 3))
    assert not ck.is_megatron_checkpoint(tiny_qwen2)
    assert ck.resolve_checkpoint(root) == ck.iter_dir(root, 3)
    with pytest.raises(FileNotFoundError, match="no complete Megatron checkpoint"):
        ck.resolve_checkpoint(running)


def test_extra_must_be_json(tmp_path):
    with pytest.raises(TypeError, match=r"extra\['position'\]"):
        ck.save_checkpoint(tmp_path, 1, [], extra={"position": object()})


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs: a disk that a save can fill (the suite runs as root, as CI does)."""
    import subprocess

    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(where)], capture_output=True,
                             text=True)
    assert mounted.returncode == 0, f"mount of a tmpfs failed (this test needs root): {mounted.stderr}"
    yield where
    subprocess.run(["umount", "-l", str(where)], check=True)


@pytest.mark.slow
def test_a_full_disk_is_named_and_the_previous_checkpoint_stays(tiny_qwen2, small_disk, tmp_path):
    """ENOSPC during a save: torch's writers lose the errno ("unexpected pos 704 vs 598"); the error names
    the disk and its free space, the checkpoint saved before is whole and still the latest, and the
    partial folder is removed once the rank has stopped writing."""
    (res,) = run_scenario("disk_full", 1, free_port(), tmp_path, {"hf": str(tiny_qwen2), "small": str(small_disk)})
    root = small_disk / "ckpt"
    assert res["free_before"] > 1024 * 1024  # the first save fitted with room to spare
    assert res["error"] is not None and res["disk_error"], res["error"]
    assert res["error"].startswith(f"CheckpointDiskError: saving iter_0000006 into {root}: No space left on device: "
                                   f"the disk holding {root} has "), res["error"]
    free = float(res["error"].split(" has ")[1].split(" MiB free")[0].replace(",", ""))
    assert free < 1.0  # MiB: the disk is full
    assert "MiB free of 16.0 MiB; free space there or give --save a folder on another disk" in res["error"]
    assert res["tmp_left"] and res["removed"] == ["iter_0000006.tmp"]
    assert res["latest"] == str(root / "iter_0000005")
    assert ck.is_complete(root / "iter_0000005") and not (root / "iter_0000006").exists()
    assert res["shapes"]["embedding.word_embeddings.weight"][1] == 64  # its metadata reads back
