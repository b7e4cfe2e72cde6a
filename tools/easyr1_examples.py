"""EasyR1's own example scripts (hiyouga/EasyR1 `examples/*.sh`), each one's command line dry-run here.

Each script runs `python3 -m verl.trainer.main config=examples/config.yaml key=value ...`; here the same
overrides go to `slime-rl train` (config/easyr1.py reads EasyR1's command line with OmegaConf, as EasyR1's
main does). Extraction (`--extract GIT_DIR`) runs each script under bash with `python3` a shell function that
records its arguments (so the script's own variables expand as written) and writes the argument lists to
tests/migration/easyr1_examples.json, which is all the tests read (no EasyR1 checkout, no network).

Dry run (`run_example`): the overrides with what points outside this machine made local: `config=` EasyR1's
examples/config.yaml as tests/config/easyr1/geo3k_config.yaml holds it (its placeholders filled), the model a
folder holding the published config.json of the model the script names (`MODELS`), the hub datasets local
rows in EasyR1's row shape (with images for a vision-language model), the format prompt
tests/config/easyr1/math.jinja, each reward file a local file of the same API (`REWARDS`); then `--dry-run
--cluster NODESxGPUS` with the script's `trainer.nnodes` x `trainer.n_gpus_per_node` (EasyR1's defaults 1 x 8).
Outcomes: `plans`, `refused` (the sentence), `traceback`, or `not-run` (no config.json here for its model, or
no local reward file of its reward's API).

    python tools/easyr1_examples.py --extract /path/to/EasyR1/.git   # refresh the corpus
    python tools/easyr1_examples.py --table [--docs]                 # the outcomes (into docs/migration.md)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "migration" / "easyr1_examples.json"
EASYR1_TESTS = ROOT / "tests" / "config" / "easyr1"
DOCS = ROOT / "docs" / "migration.md"
BEGIN, END = "<!-- easyr1-examples:begin -->", "<!-- easyr1-examples:end -->"

# the model a script names -> the published config.json held here
MODELS: dict[str, Path] = {
    "Qwen2.5-7B-Instruct": ROOT / "tests" / "orchestration" / "hf_configs" / "qwen2_5_7b_instruct.json",
    "Qwen2.5-VL-7B-Instruct": ROOT / "tests" / "orchestration" / "hf_configs" / "qwen2_5_vl_7b_instruct.json",
    "Qwen3-4B": ROOT / "tests" / "orchestration" / "hf_configs" / "qwen3_4b.json",
    "Qwen3-14B-Base": ROOT / "tests" / "migration" / "hf_configs" / "Qwen3-14B-Base" / "config.json",
}
# EasyR1's reward file -> a local file of the same API (REWARD_TYPE, compute_score's parameters)
REWARDS: dict[str, Path] = {
    "math.py": EASYR1_TESTS / "math_reward.py",
    "r1v.py": EASYR1_TESTS / "r1v_reward.py",
    "dapo.py": EASYR1_TESTS / "dapo_reward.py",
}
# EasyR1's examples/config.yaml: its model and reward (what tests/config/easyr1/geo3k_config.yaml replaced)
CONFIG_MODEL, CONFIG_REWARD = "Qwen/Qwen2.5-7B-Instruct", "./examples/reward_function/math.py:compute_score"

_RECORD = r"""
python3() { python3_args=("$@"); printf '%s\0' "$@" > "$EASYR1_ARGS_OUT"; }
set +e
source "$1" > /dev/null 2>&1
"""


def extract(git_dir: str, commit: str = "HEAD") -> dict[str, Any]:
    """Every examples/**/*.sh of the EasyR1 repository at `commit`: its arguments after `-m verl.trainer.main`."""
    git = ["git", "--git-dir", git_dir]
    sha = subprocess.run([*git, "rev-parse", commit], capture_output=True, text=True, check=True).stdout.strip()
    date = subprocess.run([*git, "show", "-s", "--format=%cs", sha], capture_output=True, text=True,
                          check=True).stdout.strip()
    names = subprocess.run([*git, "ls-tree", "-r", "--name-only", sha, "examples"], capture_output=True, text=True,
                           check=True).stdout.split()
    scripts = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in sorted(n for n in names if n.endswith(".sh")):
            text = subprocess.run([*git, "show", f"{sha}:{name}"], capture_output=True, text=True, check=True).stdout
            if "verl.trainer.main" not in text:
                continue
            script, out = Path(tmp) / "script.sh", Path(tmp) / "args"
            script.write_text(text)
            out.unlink(missing_ok=True)
            subprocess.run(["bash", "-c", _RECORD, "record", str(script)], cwd=tmp, timeout=60,
                           env={"PATH": "/usr/bin:/bin", "EASYR1_ARGS_OUT": str(out), "HOME": tmp})
            args = out.read_text().split("\0")[:-1] if out.exists() else []
            if args[:2] != ["-m", "verl.trainer.main"]:
                scripts.append({"script": name, "error": f"no `python3 -m verl.trainer.main` call ran: {args[:3]}"})
                continue
            scripts.append({"script": name, "overrides": args[2:]})
    return {"source": "https://github.com/hiyouga/EasyR1", "commit": sha, "commit_date": date,
            "extracted_by": "tools/easyr1_examples.py --extract", "scripts": scripts}


def _value(overrides: list[str], key: str, default: str | None = None) -> str | None:
    found = default
    for tok in overrides:
        k, _, v = tok.partition("=")
        if k == key:
            found = v
    return found


def _rows(path: Path, vl: bool) -> Path:
    """Local rows in EasyR1's shape (`problem`, `answer`, and `images` for a vision-language model)."""
    if not path.exists():
        if vl:
            from slime_rl.data.vl_counting import make_rows, write_jsonl

            write_jsonl(make_rows(8, seed=1, image_dir=path.parent / "images", size=56), path)
        else:
            path.write_text("".join(json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                                    for i in range(8)))
    return path


def local_argv(record: dict[str, Any], workdir: Path) -> tuple[list[str] | None, str]:
    """The script's overrides made local (module docstring) and the `--cluster` of its GPUs; (None, why) where a
    part is not here."""
    overrides = list(record["overrides"])
    model = _value(overrides, "worker.actor.model.model_path", CONFIG_MODEL)
    name = Path(model.rstrip("/")).name
    if name not in MODELS:
        return None, f"no config.json here for {model}"
    config = json.loads(MODELS[name].read_text())
    vl = "vision_config" in config
    folder = workdir / "hf" / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    reward = _value(overrides, "worker.reward.reward_function", CONFIG_REWARD)
    file, _, fn = reward.partition(":")
    if Path(file).name not in REWARDS:
        return None, f"no local reward file of the API of EasyR1's {file}"
    rows = _rows(workdir / ("vl_rows.jsonl" if vl else "rows.jsonl"), vl)
    local = {"worker.actor.model.model_path": str(folder), "data.train_files": str(rows), "data.val_files": str(rows),
             "data.format_prompt": str(EASYR1_TESTS / "math.jinja"),
             "worker.reward.reward_function": f"{REWARDS[Path(file).name]}:{fn or 'main'}",
             "trainer.save_checkpoint_path": str(workdir / "ckpt")}
    base = (EASYR1_TESTS / "geo3k_config.yaml").read_text()
    for key, value in {"@MODEL@": str(folder), "@TRAIN@": str(rows), "@VAL@": str(rows),
                       "@PROMPT@": local["data.format_prompt"], "@REWARD@": local["worker.reward.reward_function"],
                       "@SAVE@": local["trainer.save_checkpoint_path"]}.items():
        base = base.replace(key, value)
    (workdir / "config.yaml").write_text(base)
    argv = []
    for tok in overrides:
        key, _, _ = tok.partition("=")
        if key == "config":
            argv.append(f"config={workdir / 'config.yaml'}")
        elif key in local:
            argv.append(f"{key}={local[key]}")
        else:
            argv.append(tok)
    gpus = int(_value(overrides, "trainer.n_gpus_per_node", "8"))
    nodes = int(_value(overrides, "trainer.nnodes", "1"))
    return [*argv, "--run-dir", str(workdir / "run"), "--dry-run", "--cluster", f"{nodes}x{gpus}"], ""


def _slime_scripts() -> Any:
    """tools/slime_scripts.py (tools/ is not a package), for its in-process dry run `run_cli`."""
    import importlib.util

    name = "tools_slime_scripts"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("slime_scripts.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def run_example(record: dict[str, Any]) -> dict[str, Any]:
    """One corpus record dry-run through `slime_rl.train.main` in this process: {outcome, reason, output}."""
    if record.get("error"):
        return {"outcome": "not-run", "reason": record["error"], "output": ""}
    with tempfile.TemporaryDirectory(prefix="easyr1-example-") as tmp:
        argv, why = local_argv(record, Path(tmp))
        if argv is None:
            return {"outcome": "not-run", "reason": why, "output": ""}
        rc, output, trace, errors = _slime_scripts().run_cli(argv, tmp)
    if trace is not None:
        return {"outcome": "traceback", "reason": trace.strip().splitlines()[-1], "output": output + trace}
    if rc == 0:
        return {"outcome": "plans", "reason": "", "output": output}
    return {"outcome": "refused" if rc == 2 and errors else "traceback",
            "reason": errors[-1] if errors else f"exit {rc} without the CLI's error line", "output": output}


def load_corpus(path: Path = CORPUS) -> dict[str, Any]:
    return json.loads(path.read_text())


def render_table(corpus: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [BEGIN, "", f"EasyR1 {corpus['commit'][:7]} ({corpus['commit_date']}), each example's command line "
             "dry-run by `python tools/easyr1_examples.py --table` (tests/config/test_easyr1_examples.py fails when "
             "an outcome differs):", "", "| script | GPUs | outcome | reason |", "|---|---|---|---|"]
    for rec, row in zip(corpus["scripts"], rows, strict=True):
        ov = rec.get("overrides", [])
        gpus = f"{_value(ov, 'trainer.nnodes', '1')}x{_value(ov, 'trainer.n_gpus_per_node', '8')}"
        reason = row["reason"].replace("|", "\\|")
        lines.append(f"| `{rec['script']}` | {gpus} | {row['outcome']} | {reason[:160]} |")
    return "\n".join([*lines, "", END])


def docs_outcomes(path: Path = DOCS) -> dict[str, str]:
    text = path.read_text()
    block = text[text.index(BEGIN):text.index(END)]
    return {line.split("`")[1]: line.split("|")[3].strip() for line in block.splitlines() if line.startswith("| `")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extract", metavar="GIT_DIR", help="re-read the examples from an EasyR1 git directory")
    ap.add_argument("--table", action="store_true", help="dry-run every example and print the outcomes")
    ap.add_argument("--docs", action="store_true", help="with --table: write the table into docs/migration.md")
    a = ap.parse_args(argv)
    if a.extract:
        CORPUS.write_text(json.dumps(extract(a.extract), indent=1) + "\n")
        print(f"wrote {CORPUS}")
    if a.table:
        corpus = load_corpus()
        table = render_table(corpus, [run_example(r) for r in corpus["scripts"]])
        print(table)
        if a.docs:
            text = DOCS.read_text()
            text = text[:text.index(BEGIN)] + table + text[text.index(END) + len(END):]
            DOCS.write_text(text)
            print(f"wrote {DOCS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
