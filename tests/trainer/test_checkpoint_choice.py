"""Which checkpoint --load / --ckpt-step resume from, and when --save would overwrite checkpoints
(trainer/checkpoint_layout.choose_checkpoint, check_save_folder), on folders written by hand in the
layout a save leaves (iter_<step>/ with the completion marker and dist_checkpointing's metadata.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime_rl.trainer.checkpoint_layout import (
    CheckpointChoiceError,
    check_save_folder,
    choose_checkpoint,
)


def saved(root: Path, *steps: int, incomplete: tuple[int, ...] = ()) -> Path:
    """A --save folder with complete checkpoints of `steps` and interrupted saves of `incomplete`."""
    for step in steps:
        folder = root / f"iter_{step:07d}"
        folder.mkdir(parents=True)
        (folder / "metadata.json").write_text("{}")
        (folder / "slime_rl_checkpoint.json").write_text(json.dumps(
            {"step": step, "contents": ["model", "optimizer"], "extra": {"rollout_id": step, "rollout": {}}}))
    for step in incomplete:
        (root / f"iter_{step:07d}").mkdir(parents=True)  # no marker, no metadata
    (root / "latest_checkpointed_iteration.txt").parent.mkdir(parents=True, exist_ok=True)
    if steps:
        (root / "latest_checkpointed_iteration.txt").write_text(str(max(steps)))
    return root


def test_a_save_folder_resumes_from_its_newest_and_an_iteration_folder_from_itself(tmp_path):
    root = saved(tmp_path / "ckpt", 0, 1, 2)
    assert choose_checkpoint(root) == root / "iter_0000002"
    assert choose_checkpoint(root / "iter_0000001") == root / "iter_0000001"
    assert choose_checkpoint(root, ckpt_step=0) == root / "iter_0000000"


def test_nothing_there_yet_is_a_fresh_start(tmp_path):
    assert choose_checkpoint(tmp_path / "not-yet") is None  # the first run of --load X --save X
    (tmp_path / "empty").mkdir()
    assert choose_checkpoint(tmp_path / "empty") is None
    assert choose_checkpoint(None) is None


@pytest.mark.parametrize("load, step, message", [
    ("ckpt/iter_0000007", None, r"--load .*iter_0000007 does not exist; intact checkpoints: iter_0000000 "
                                r"\(--load .*iter_0000000\); iter_0000001"),
    ("ckpt/iter_0000003", None, r"iter_0000003 is not a complete checkpoint \(an interrupted save"),
    ("ckpt", 5, r"--ckpt-step 5: .*iter_0000005 is not a complete checkpoint; intact checkpoints: iter_0000000"),
    ("ckpt/iter_0000001", 1, r"--ckpt-step 1 with --load .*iter_0000001: --load already names one checkpoint"),
    ("interrupted-only", None, r"it holds iteration folders but none is complete"),
])
def test_a_path_naming_a_checkpoint_that_is_not_there_is_an_error(tmp_path, load, step, message):
    saved(tmp_path / "ckpt", 0, 1, incomplete=(3,))
    saved(tmp_path / "interrupted-only", incomplete=(0,))
    with pytest.raises(CheckpointChoiceError, match=message):
        choose_checkpoint(tmp_path / load, ckpt_step=step)


def test_a_broken_marker_names_the_file_and_the_intact_ones(tmp_path):
    root = saved(tmp_path / "ckpt", 0, 1, 2)
    (root / "iter_0000002" / "slime_rl_checkpoint.json").write_text('{"step": 2, "conte')  # cut short
    with pytest.raises(CheckpointChoiceError, match=r"iter_0000002/slime_rl_checkpoint.json is not a complete "
                                                    r"checkpoint marker \(JSONDecodeError.*intact checkpoints: "
                                                    r"iter_0000000 \(--load .*iter_0000000\); iter_0000001"):
        choose_checkpoint(root)


def test_save_refuses_to_overwrite_later_or_foreign_checkpoints(tmp_path):
    root = saved(tmp_path / "ckpt", 0, 1, 2, 3)
    # resuming from iter_2 into the same folder would write iter_3 over the old run's iter_3
    with pytest.raises(CheckpointChoiceError, match=r"resumes at step 3, but --save .*ckpt already holds later "
                                                    r"checkpoints \(iter_0000003\) that this run would overwrite"):
        check_save_folder(root, choose_checkpoint(root / "iter_0000002"))
    check_save_folder(root, choose_checkpoint(root))  # the newest: nothing later, auto-resume as before
    check_save_folder(tmp_path / "from-2", choose_checkpoint(root / "iter_0000002"))  # a new folder: fine
    with pytest.raises(CheckpointChoiceError, match=r"already holds checkpoints of a run \(newest: iter_0000003\); "
                                                    r"this run would start fresh.*--load .*ckpt"):
        check_save_folder(root, None)  # --save without --load
    other = saved(tmp_path / "other", 0)
    with pytest.raises(CheckpointChoiceError, match="holds checkpoints of another run"):
        check_save_folder(other, choose_checkpoint(root))


def test_a_model_only_checkpoint_is_refused_naming_what_takes_it(tmp_path):
    """tools/convert_hf_to_megatron.py writes weights with no run state: --load of it used to crash
    (KeyError 'rollout') after every actor had started."""
    root = saved(tmp_path / "converted", 0)
    (root / "iter_0000000" / "slime_rl_checkpoint.json").write_text(json.dumps(
        {"step": 0, "contents": ["model"], "extra": {}}))
    with pytest.raises(CheckpointChoiceError, match=r"holds no training position .*model-only checkpoint "
                                                    r"\(tools/convert_hf_to_megatron.py.*--ref-load takes"):
        choose_checkpoint(root)


def test_the_critic_save_folder_is_kept_as_the_policy_one(tiny_qwen2, tmp_path):
    from slime_rl.config import ConfigError, build_config
    from slime_rl.preflight import check_checkpoints

    policy = saved(tmp_path / "policy", 0, 1)
    critic = saved(tmp_path / "critic", 0, 1, 2)
    base = ["--hf-checkpoint", str(tiny_qwen2), "--prompt-data", str(tmp_path / "d.jsonl"), "--rollout-batch-size",
            "2", "--num-rollout", "4", "--rm-type", "digit", "--advantage-estimator", "ppo",
            "--critic-save", str(critic)]
    (tmp_path / "d.jsonl").write_text('{"input": "1", "label": "1"}\n')
    cfg = build_config(base + ["--load", str(policy), "--save", str(policy)])
    with pytest.raises(ConfigError, match=r"--critic-save .*critic already holds checkpoints after step 1 "
                                          r"\(iter_0000002\)"):
        check_checkpoints(cfg)


def with_shards(root: Path, *steps: int) -> Path:
    """`saved`, with real torch_dist files in each checkpoint: torch.distributed.checkpoint's index and
    shard file (what dist_checkpointing writes through it) and a torch.save'd common.pt."""
    import torch
    import torch.distributed.checkpoint as dcp

    saved(root, *steps)
    for step in steps:
        folder = root / f"iter_{step:07d}"
        dcp.save({"a": torch.arange(1000.0), "b": torch.ones(300)}, checkpoint_id=str(folder), no_dist=True)
        torch.save({"iteration": step}, folder / "common.pt")
    return root


def truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


@pytest.mark.parametrize("damage, message", [
    ("truncated shard", r"__0_0.distcp is 4,000 bytes, but .*\.metadata places saved tensors up to byte {size} "
                        r"\(truncated\)"),
    ("missing shard", r"__0_0.distcp is missing \(.*\.metadata places saved tensors in it\)"),
    ("bad index", r"\.metadata cannot be read \(UnpicklingError"),
    ("truncated common", r"common.pt is not a whole file"),
])
def test_a_damaged_checkpoint_is_named_before_any_rank_loads_it(tmp_path, damage, message):
    """The files a checkpoint's own index names are checked in the driver: a shard file cut short used to
    fail only on the ranks that read it, and hang the others in the load's collectives."""
    root = with_shards(tmp_path / "ckpt", 0, 1, 2)
    assert choose_checkpoint(root) == root / "iter_0000002"  # whole: taken
    newest = root / "iter_0000002"
    shard = newest / "__0_0.distcp"
    size = shard.stat().st_size
    assert size > 5200  # 1,300 float32 values and their framing; the last one ends at the file's end
    message = message.replace("{size}", f"{size:,}")
    if damage == "truncated shard":
        truncate(shard, 4000)
    elif damage == "missing shard":
        shard.unlink()
    elif damage == "bad index":
        (newest / ".metadata").write_bytes(b"\x80\x04not a pickle")
    else:
        truncate(newest / "common.pt", 100)
    intact = r"; intact checkpoints: iter_0000000 \(--load .*iter_0000000\); iter_0000001 \(--load .*iter_0000001\)$"
    for load, step in ((root, None), (newest, None), (root, 2)):  # every way to name it
        with pytest.raises(CheckpointChoiceError, match=r"--load .*iter_0000002: .*" + message + ".*" + intact):
            choose_checkpoint(load, ckpt_step=step)
    assert choose_checkpoint(root, ckpt_step=1) == root / "iter_0000001"  # the others still load
