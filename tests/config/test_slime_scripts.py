"""slime's own launch scripts as a corpus (tests/migration/slime_scripts.json, tools/slime_scripts.py).

Every script's train command dry-runs through `slime-rl train` in this process without a traceback, with
the outcome docs/migration.md's table ("slime's own launch scripts") records, so the table cannot drift;
the corpus is self-contained (no slime checkout, no network); the extractor captures the exact argv of a
made-up script.
"""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import _load_tool

tool = _load_tool("slime_scripts")
CORPUS = json.loads(tool.CORPUS.read_text())
SCRIPTS = [s["script"] for s in CORPUS["scripts"]]


@pytest.fixture(scope="module")
def measured() -> dict[str, dict]:
    """Each script's dry run, once for the module: script -> {record, outcome, reason, output, census}."""
    return {row["record"]["script"]: row for row in tool.measure(CORPUS)}


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_outcome(script, measured):
    row, recorded = measured[script], tool.docs_outcomes()
    assert row["outcome"] != "traceback", row["output"][-3000:]
    assert script in recorded, f"{script}: not in docs/migration.md's table (python tools/slime_scripts.py --docs)"
    assert row["outcome"] == recorded[script], (
        f"{script}: {row['outcome']} now ({row['reason']}), {recorded[script]} in docs/migration.md; "
        "regenerate the table: python tools/slime_scripts.py --docs")


def test_docs_table_is_the_corpus(measured):
    recorded = tool.docs_outcomes()
    assert set(recorded) == set(SCRIPTS), set(recorded) ^ set(SCRIPTS)
    plans_then = sum(outcome == "plans" for outcome in recorded.values())
    plans_now = sum(row["outcome"] == "plans" for row in measured.values())
    assert plans_now >= plans_then, f"{plans_now} scripts plan now, {plans_then} in docs/migration.md"
    # the summary line under the table counts the same outcomes
    doc = tool.DOCS.read_text()
    counts = Counter(recorded.values())
    every = (*tool.OUTCOMES, "not-extracted")
    line = f"{len(SCRIPTS)} scripts: " + " / ".join(f"{counts.get(o, 0)} {o}" for o in every)
    assert line in doc


def test_corpus_is_self_contained(monkeypatch):
    """What the tests read is the JSON and the config files beside it: no slime checkout, no subprocess."""
    assert re.fullmatch(r"[0-9a-f]{40}", CORPUS["commit"]) and re.fullmatch(r"\d{4}-\d\d-\d\d", CORPUS["commit_date"])
    assert len(SCRIPTS) == len(set(SCRIPTS)) == 44
    for rec in CORPUS["scripts"]:
        if rec.get("error"):  # listed with the reason, never dropped
            assert rec["error"].strip()
            continue
        assert rec["entry"] in ("train.py", "train_async.py") or rec["entry"].startswith("other: ")
        assert rec["argv"] and re.fullmatch(r"\d+x\d+", rec["gpus"]["cluster"])
        assert tool.model_of(rec["argv"]) in tool.MODELS, rec["script"]
        assert tool.hf_config(tool.model_of(rec["argv"]))["model_type"]
        assert rec["sft"] == tool.is_sft(rec["argv"])
    assert [r["script"] for r in CORPUS["scripts"] if r["sft"]] == [
        "examples/retool/retool_qwen3_4b_sft.sh", "scripts/run-qwen3-235B-A22B-sft.sh",
        "scripts/run-qwen3-4B-base-sft.sh", "scripts/run-qwen3.5-35B-A3B-sft.sh"]

    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"the dry run of a corpus record started a process: {args}")

    monkeypatch.setattr(tool, "DEFAULT_SLIME_GIT", "/nonexistent")
    monkeypatch.setattr(subprocess, "run", no_subprocess)
    monkeypatch.setattr(subprocess, "Popen", no_subprocess)
    record = next(r for r in CORPUS["scripts"] if r["script"] == "scripts/run-qwen3-4B.sh")
    assert tool.run_script(record)["outcome"] != "traceback"


def test_flag_census():
    argv = ["--lr", "1e-6", "--colocate", "--swiglu", "--foo-bar", "3", "--custom-loss-function-path", "m.f",
            "--sglang-mem-fraction-static", "0.7", "--sglang-no-such-flag", "1", "--attention-dropout", "0.1",
            "--moe-token-dispatcher-type", "deepep", "--optimizer-cpu-offload",
            "--disable-compute-advantages-and-returns", "--eval-prompt-data", "aime", "/x.jsonl"]
    got = {e["flag"]: e["status"] for e in tool.flag_census(argv)}
    # --swiglu: slime's MODEL_ARGS are read (and compared with config.json in preflight)
    assert got == {"--lr": "accepted", "--colocate": "accepted", "--swiglu": "accepted", "--foo-bar": "unknown",
                   "--custom-loss-function-path": "refused", "--sglang-mem-fraction-static": "accepted",
                   "--sglang-no-such-flag": "refused", "--attention-dropout": "refused",
                   "--moe-token-dispatcher-type": "refused", "--optimizer-cpu-offload": "accepted",
                   "--disable-compute-advantages-and-returns": "refused", "--eval-prompt-data": "accepted"}


def test_gpus_asked():
    # colocated: the actor's GPUs; disaggregated: plus --rollout-num-gpus, on nodes of the head's ray start
    one = tool.gpus_asked(["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate"])
    assert (one["total"], one["cluster"]) == (8, "1x8")
    two = tool.gpus_asked(["--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4"], node_gpus="8")
    assert (two["total"], two["cluster"]) == (8, "1x8")
    small = tool.gpus_asked(["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "3"], node_gpus="4")
    assert small["cluster"] == "1x4"
    big = tool.gpus_asked(["--actor-num-nodes", "16", "--actor-num-gpus-per-node", "8", "--colocate",
                           "--rollout-num-gpus", "64"])
    assert (big["total"], big["cluster"]) == (128, "16x8")
    assert tool.gpus_asked([])["cluster"] == "1x8"  # slime's defaults: 1 node x 8 GPUs


MODELS_FILE = """\
NLAYERS=3
arr=()
for ((i=0; i<NLAYERS; i++)); do arr+=(1); done
printf -v FREQ "[%s]" "$(IFS=', '; echo "${arr[*]}")"
MODEL_ARGS=(
   --num-layers $NLAYERS
   --normalization "RMSNorm"
   --rotary-base "${MODEL_ARGS_ROTARY_BASE:-1000000}"
   --moe-layer-freq "$FREQ"
)
"""

SCRIPT = """\
#!/bin/bash
pkill -9 sglang
sleep 3
ray stop --force
pkill -9 python
set -ex
export PYTHONUNBUFFERED=1
if command -v nvidia-smi >/dev/null 2>&1; then
    DETECTED_GPUS=$(nvidia-smi -L 2>/dev/null | wc -l | tr -d ' ')
else
    DETECTED_GPUS=0
fi
NUM_GPUS=${NUM_GPUS:-${DETECTED_GPUS}}
SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
source "${SCRIPT_DIR}/models/tiny.sh"
CKPT_ARGS=(
   --hf-checkpoint /root/Tiny
   #--hf-checkpoint /root/Tiny-FP8
   --save ${SCRIPT_DIR}/out/
)
ROLLOUT_ARGS=(
   --eval-prompt-data aime /root/aime.jsonl
   --rollout-stop-token-ids 1 2
   --custom-rm-kwargs '{"a": 1}'
)
EMPTY_ARGS=(
   # --use-wandb
)
ray start --head --node-ip-address 127.0.0.1 --num-gpus ${NUM_GPUS}
ray job submit --address="http://127.0.0.1:8265" \\
   --runtime-env-json='{"env_vars": {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}}' \\
   -- python3 train.py \\
   --actor-num-gpus-per-node ${NUM_GPUS} \\
   --rollout-num-gpus $((NUM_GPUS / 2)) \\
   ${MODEL_ARGS[@]} \\
   ${CKPT_ARGS[@]} \\
   "${ROLLOUT_ARGS[@]}" \\
   ${EMPTY_ARGS[@]}
"""


def _tree(tmp_path: Path, script: str, name: str = "run-tiny.sh") -> Path:
    tree = tmp_path / "slime"
    (tree / "scripts" / "models").mkdir(parents=True)
    (tree / "scripts" / "models" / "tiny.sh").write_text(MODELS_FILE)
    (tree / "scripts" / name).write_text(script)
    return tree


def test_extract_made_up_script(tmp_path):
    rec = tool.extract_script(_tree(tmp_path, SCRIPT), "scripts/run-tiny.sh")
    assert "error" not in rec, rec
    # by hand: the unquoted arrays split on blanks (RMSNorm loses its quotes, '{"a": 1}' stays one word in the
    # quoted "${ROLLOUT_ARGS[@]}"), the empty array adds nothing, NUM_GPUS comes from the stubbed nvidia-smi (8),
    # $SCRIPT_DIR is written back under /root/slime
    assert rec["argv"] == [
        "--actor-num-gpus-per-node", "8", "--rollout-num-gpus", "4",
        "--num-layers", "3", "--normalization", "RMSNorm", "--rotary-base", "1000000", "--moe-layer-freq", "[1,1,1]",
        "--hf-checkpoint", "/root/Tiny", "--save", "/root/slime/scripts/out/",
        "--eval-prompt-data", "aime", "/root/aime.jsonl", "--rollout-stop-token-ids", "1", "2",
        "--custom-rm-kwargs", '{"a": 1}']
    assert (rec["entry"], rec["launched_by"], rec["models_file"]) == ("train.py", "ray job submit",
                                                                      "scripts/models/tiny.sh")
    assert rec["user_vars"] == {"NUM_GPUS": "8"}  # MODEL_ARGS_ROTARY_BASE is not set: not listed
    assert rec["exported"] == {"PYTHONUNBUFFERED": "1"}
    assert rec["ray_runtime_env"] == {"env_vars": {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}}
    assert rec["gpus"] == {"actor_nodes": 1, "actor_gpus_per_node": 8, "rollout_num_gpus": 4, "colocate": False,
                           "total": 12, "cluster": "2x8"}
    assert rec["notes"] == [] and not rec["sft"]


def test_extract_direct_python_and_inputs(tmp_path):
    script = textwrap.dedent("""\
        set -e
        source /root/slime/scripts/models/tiny.sh
        ARGS=(--loss-type sft_loss --num-rollout ${STEPS:-5})
        python3 -u train_async.py ${MODEL_ARGS[@]} ${ARGS[@]} --seed "$MASTER_ADDR"
        """)
    rec = tool.extract_script(_tree(tmp_path, script), "scripts/run-tiny.sh", inputs={"MASTER_ADDR": "10.0.0.1"})
    assert rec["argv"] == ["--num-layers", "3", "--normalization", "RMSNorm", "--rotary-base", "1000000",
                           "--moe-layer-freq", "[1,1,1]", "--loss-type", "sft_loss", "--num-rollout", "5",
                           "--seed", "10.0.0.1"]
    assert (rec["entry"], rec["launched_by"], rec["sft"]) == ("train_async.py", "python", True)
    assert rec["user_vars"] == {}  # STEPS is not set: its default is in the argv
    assert rec["notes"] == ["sources /root/slime/scripts/models/tiny.sh: read from the unpacked tree (slime's docker "
                            "image keeps the repository at /root/slime)"]


def test_extract_lists_what_it_cannot_extract(tmp_path):
    # a line of the train command without its backslash: bash runs the rest as a command of its own
    broken = "ray job submit -- python3 train.py --colocate --lr 1e-6\n   --num-rollout 3 \\\n   --seed 1\n"
    rec = tool.extract_script(_tree(tmp_path, broken), "scripts/run-tiny.sh")
    assert rec["argv"] == ["--colocate", "--lr", "1e-6"]
    assert "bash exited 127" in rec["error"] and "--num-rollout: command not found" in rec["error"]
    assert tool.run_script(rec)["outcome"] == "not-extracted"
    rec = tool.extract_script(_tree(tmp_path / "b", "echo nothing to run\n"), "scripts/run-tiny.sh")
    assert rec["error"].startswith("no train command captured (bash exited 0)")


def test_megatron_core_judges_the_layouts_refused_as_the_scripts_own(measured):
    """A script whose parallel layout we refuse counts as allowed only where megatron-core's own code refuses it
    too (slime's trainer could not start it either): glm4.7-30B-A3B's EP 8 x PP 2 on its 8 GPUs, the delta
    example's 47 layers over 2 stages without an uneven split. The same check takes each layout once the script
    is mended (16 GPUs; a last stage of 23 layers) and a script that plans, so it can tell them apart."""
    delta, glm = (measured[s] for s in ("examples/delta_weight_sync/run-glm4.7-30B-A3B-delta.sh",
                                        "scripts/run-glm4.7-30B-A3B.sh"))
    assert delta["outcome"] == glm["outcome"] == "refused-allowed"
    assert "num_layers=47 should be divisible by config.pipeline_model_parallel_size=2" in delta["reason"]
    assert "world_size (8) is not divisible by expert_tensor_model_pipeline_parallel size (16)" in glm["reason"]
    # the layouts as parsed from the argv: the sizes written in the scripts (derived by hand from them)
    assert glm["layout"] == {"tp": 2, "pp": 2, "cp": 2, "ep": 8, "etp": 1, "world": 8, "layers": 47, "first": None,
                             "last": 23}
    assert delta["layout"]["world"] == 16 and delta["layout"]["last"] is None
    planned = tool.parallel_layout(measured["scripts/run-qwen3-30B-A3B.sh"]["record"])
    assert tool.megatron_rejects([dict(glm["layout"], world=16), dict(delta["layout"], last=23), planned]) == [
        None, None, None]
