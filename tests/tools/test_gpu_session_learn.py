"""bench/gpu_session.sh `learn` wires its environment into the right commands.

A device call runs it once, with no second chance (device time), so the wiring is checked
here with stand-ins for `python3` and `nvidia-smi` that only record their arguments. The 2026-12-03 slip:
a second run of the same task in another config (EXTRA_TASK_CONFIG) trained on the first run's files.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_session.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _learn(tmp_path: Path, mode: str = "learn", **env: str) -> list[list[str]]:
    """Run `mode` with recording stand-ins; the commands it ran, in order, as argument lists."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    # one append per call (the script runs some at once: two appends per call could interleave)
    (bin_dir / "python3").write_text(f"#!/bin/bash\nline=$(printf '%s\\t' \"$@\")\necho \"$line\" >> {log}\n")
    (bin_dir / "nvidia-smi").write_text("#!/bin/bash\necho 'GPU 0: stand-in'\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    model = tmp_path / "smol"
    model.mkdir()
    (model / "config.json").write_text("{}")
    full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
                "SMOL": str(model), **env}
    subprocess.run(["bash", str(SCRIPT), mode], cwd=ROOT, env=full_env, check=True, capture_output=True,
                   timeout=60)
    return [line.rstrip("\t").split("\t") for line in log.read_text().splitlines() if line]


def _value(call: list[str], flag: str) -> str | None:
    return call[call.index(flag) + 1] if flag in call else None


def _runs(calls: list[list[str]]) -> dict[str, list[str]]:
    """peer_trl calls by side: trl (--skip-ours), ours (--skip-trl, saving to learned_<task>), extra."""
    runs = {}
    for c in calls:
        if len(c) > 1 and c[0] == "bench/peer_trl.py":
            if "--skip-ours" in c:
                runs["trl"] = c
            else:
                runs["extra" if "learned_extra" in _value(c, "--save-hf") else "ours"] = c
    return runs


def _data_calls(calls: list[list[str]]) -> list[list[str]]:
    return [c for c in calls if c and c[0] == "tools/make_reasoning_gym_data.py"]


def test_same_task_in_another_config_trains_on_its_own_files(tmp_path):
    calls = _learn(tmp_path, TASK="basic_arithmetic", TASK_CONFIG="--config max_digits=1",
                   EXTRA_TASK="basic_arithmetic", EXTRA_TASK_CONFIG="--config max_digits=2")
    runs = _runs(calls)
    assert set(runs) == {"ours", "trl", "extra"}
    assert _value(runs["ours"], "--data") == _value(runs["trl"], "--data")
    assert _value(runs["extra"], "--data") != _value(runs["ours"], "--data")
    # each training file is written with its own run's config
    written = {_value(c, "--out"): c for c in _data_calls(calls)}
    assert "max_digits=1" in written[_value(runs["ours"], "--data")]
    assert "max_digits=2" in written[_value(runs["extra"], "--data")]
    # and its held-out file (the one it excludes) is the one its evaluations read
    extra_heldout = _value(written[_value(runs["extra"], "--data")], "--exclude")
    assert "max_digits=2" in written[extra_heldout]
    extra_evals = [c for c in calls if c[0] == "tools/eval_greedy.py" and _value(c, "--data") == extra_heldout]
    assert len(extra_evals) == 2  # start and end


def test_same_task_in_the_same_config_reuses_the_files(tmp_path):
    calls = _learn(tmp_path, TASK="chain_sum", EXTRA_TASK="chain_sum", EXTRA_LR="2e-5")
    runs = _runs(calls)
    assert _value(runs["extra"], "--data") == _value(runs["ours"], "--data")
    assert _value(runs["extra"], "--lr") == "2e-5" and _value(runs["ours"], "--lr") == "5e-6"
    assert len(_data_calls(calls)) == 2  # one held-out and one training file, not rewritten


def test_seed_and_per_side_flags(tmp_path):
    calls = _learn(tmp_path, TASK="chain_sum", SEED="7", OURS_EXTRA="--flag-a", TRL_EXTRA="--trl-no-autocast",
                   EXTRA_TASK="gcd", EXTRA_OURS_EXTRA="--flag-b")
    runs = _runs(calls)
    assert {_value(r, "--seed") for r in runs.values()} == {"7"}
    assert "--trl-no-autocast" in runs["trl"]
    assert "--trl-no-autocast" not in runs["ours"] + runs["extra"]
    assert "--flag-a" in runs["ours"] and "--flag-a" not in runs["extra"] + runs["trl"]
    assert "--flag-b" in runs["extra"] and "--flag-b" not in runs["ours"]
    # the seed is in the result names, so a second seed does not overwrite the first
    assert all("_seed7_" in _value(r, "--out") for r in runs.values())


@pytest.mark.parametrize("seed", ["", "5"])
def test_a_second_run_of_the_same_task_writes_its_own_results(tmp_path, seed):
    runs = _runs(_learn(tmp_path, TASK="chain_sum", EXTRA_TASK="chain_sum", SEED=seed))
    outs = [_value(r, "--out") for r in runs.values()]
    assert len(outs) == 3 and len({o.removesuffix("_trl.json").removesuffix("_ours.json") for o in outs}) == 2
    assert _value(runs["extra"], "--out") != _value(runs["ours"], "--out")


@pytest.mark.parametrize("which", ["OURS_FP32", "EXTRA_FP32"])
def test_fp32_runs_the_recipe_with_bf16_off_on_that_run_only(tmp_path, which):
    runs = _runs(_learn(tmp_path, TASK="chain_sum", EXTRA_TASK="chain_sum", TRL_EXTRA="--trl-no-autocast",
                        **{which: "1"}))
    fp32_side, other = ("ours", "extra") if which == "OURS_FP32" else ("extra", "ours")
    config = _value(runs[fp32_side], "--ours-config")
    assert config is not None and "--ours-config" not in runs[other] + runs["trl"]
    # before --ours-extra, whose REMAINDER would take it as one of our train flags
    assert runs[fp32_side].index("--ours-config") < runs[fp32_side].index("--ours-extra")
    assert config == "configs/smollm2_chain_sum_grpo_1gpu_fp32.yaml" and (ROOT / config).is_file()
    names = {side: Path(_value(runs[side], "--out")).name for side in (fp32_side, other)}
    assert "_fp32_" in names[fp32_side] and "_fp32_" not in names[other]


def test_in_order_reaches_every_run(tmp_path):
    runs = _runs(_learn(tmp_path, TASK="chain_sum", EXTRA_TASK="chain_sum", IN_ORDER="1"))
    assert set(runs) == {"ours", "trl", "extra"}
    for r in runs.values():
        # before --ours-extra, whose REMAINDER would pass it to slime-rl train
        assert "--in-order" in r and ("--ours-extra" not in r or r.index("--in-order") < r.index("--ours-extra"))
        assert "_inorder_" in Path(_value(r, "--out")).name
    (tmp_path / "b").mkdir()
    assert all("--in-order" not in r for r in _runs(_learn(tmp_path / "b", TASK="chain_sum")).values())


def test_without_seed_both_sides_keep_the_default(tmp_path):
    runs = _runs(_learn(tmp_path, TASK="chain_sum"))
    assert set(runs) == {"ours", "trl"}
    assert all("--seed" not in r for r in runs.values())


def test_gap_bisect_runs_each_variant_with_its_flags_and_summarizes_them(tmp_path):
    calls = _learn(tmp_path, "gap-bisect", VARIANTS="base=--a;no_x=--a --b", STEPS="5", SEED="3")
    runs = [c for c in calls if c[0] == "bench/peer_trl.py"]
    assert len(runs) == 2 and all("--skip-trl" in r and _value(r, "--steps") == "5" for r in runs)
    assert all(_value(r, "--seed") == "3" for r in runs)
    # the variant's flags are the last words (peer_trl's --ours-extra takes the rest of the line); the
    # variants start at once, so they are matched by the name in their result file
    flags = {Path(_value(r, "--out")).name.split("_seed3_")[0]: r[r.index("--ours-extra") + 1:] for r in runs}
    assert flags == {"gap_bisect_basic_arithmetic_base": ["--a"], "gap_bisect_basic_arithmetic_no_x": ["--a", "--b"]}
    summary = [c for c in calls if c[0] == "bench/logprob_gap_summary.py"]
    assert len(summary) == 1
    assert sorted(summary[0][1:3]) == sorted(_value(r, "--out") for r in runs)
    # one training file, the one every variant reads
    data = [c for c in calls if c[0] == "tools/make_reasoning_gym_data.py"]
    assert len(data) == 1 and {_value(r, "--data") for r in runs} == {_value(data[0], "--out")}


def test_gap_bisect_brings_back_few_files(tmp_path):
    """A device call brings back at most 8 files: the runs' folders and curves are removed (under the
    mode's `set -f` a glob did not expand, so the 2026-12-03 version left them), the logs come in one archive."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # peer_trl's stand-in writes what the real one writes next to its result: a run folder and a curve
    (bin_dir / "python3").write_text(
        "#!/bin/bash\n[ \"$1\" = bench/peer_trl.py ] || exit 0\n"
        "out=$(printf '%s\\n' \"$@\" | grep -A1 -x -- --out | tail -1)\n"
        "mkdir -p \"${out%.json}_ours_run\" && echo '{}' > \"${out%.json}_ours_run/metrics.jsonl\"\n"
        "echo '{}' > \"$out\" && echo png > \"${out%.json}_reward.png\"\n")
    (bin_dir / "nvidia-smi").write_text("#!/bin/bash\necho 'GPU 0: stand-in'\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    model, out = tmp_path / "smol", tmp_path / "out"
    model.mkdir()
    (model / "config.json").write_text("{}")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out), "SMOL": str(model),
           "VARIANTS": "a=--x;b=--y;c=--z;d=--w", "SEED": "77"}
    subprocess.run(["bash", str(SCRIPT), "gap-bisect"], cwd=ROOT, env=env, check=True, capture_output=True,
                   timeout=60)
    left = sorted(p.name for p in out.iterdir())
    assert not [n for n in left if n.endswith(("_ours_run", "_reward.png"))], left
    assert len([n for n in left if n.endswith(".json")]) == 4 and len(left) <= 8, left
    assert any(n.startswith("gap_bisect_logs_seed77_") and n.endswith(".tgz") for n in left), left
    for f in Path("/tmp").glob("gap_bisect_*_seed77_*.log"):  # the mode keeps its logs in /tmp
        f.unlink()


def test_gap_bisect_default_task_config_keeps_its_quotes(tmp_path):
    """reasoning-gym reads operators=["+","-","*"] as JSON; the first gap-bisect of 2026-12-03 passed
    operators=[+,-,*] (the quotes of a ${VAR-default} word are removed) and every variant failed."""
    calls = _learn(tmp_path, "gap-bisect", VARIANTS="a=--x")
    (data,) = _data_calls(calls)
    assert "operators=[\"+\",\"-\",\"*\"]" in data and "max_digits=1" in data


def test_sync_check_runs_the_recipe_on_the_one_digit_file(tmp_path):
    calls = _learn(tmp_path, "sync-check", STEPS="7", OURS_EXTRA="--lr 2e-5")
    (data,) = _data_calls(calls)
    (check,) = [c for c in calls if c[0] == "bench/sync_check.py"]
    assert "operators=[\"+\",\"-\",\"*\"]" in data and "max_digits=1" in data
    assert _value(check, "--data") == _value(data, "--out") and _value(check, "--steps") == "7"
    train_flags = check[check.index("--") + 1:]
    assert train_flags == ["--config", "configs/smollm2_basic_arithmetic_grpo_1gpu.yaml", "--lr", "2e-5"]


def test_outliers_dumps_where_the_analysis_reads(tmp_path):
    dbg = tmp_path / "dbg"
    calls = _learn(tmp_path, "outliers", STEPS="5", DBG=str(dbg), OURS_EXTRA="--lr 2e-5")
    (data,) = _data_calls(calls)
    (train,) = [c for c in calls if c[:2] == ["-m", "slime_rl.cli"]]
    (analysis,) = [c for c in calls if c[0] == "bench/outlier_tokens.py"]
    assert _value(train, "--prompt-data") == _value(data, "--out") and "max_digits=1" in data
    assert _value(train, "--num-rollout") == "5" and train[-2:] == ["--lr", "2e-5"]
    assert _value(train, "--config") == "configs/smollm2_basic_arithmetic_grpo_1gpu.yaml"
    # the templates reach the analysis as the run wrote them, braces and all
    rollout, shards = f"{dbg}/rollout_{{rollout_id}}.pt", f"{dbg}/train_{{rollout_id}}_{{rank}}.pt"
    assert _value(analysis, "--rollout") == _value(train, "--save-debug-rollout-data") == rollout
    assert _value(analysis, "--train") == _value(train, "--save-debug-train-data") == shards
