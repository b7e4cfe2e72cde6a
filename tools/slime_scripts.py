"""slime's own launch scripts as a test corpus: extract each script's train command line by running the
script under bash with its external commands stubbed, then dry-run each through `slime-rl train`.

    python tools/slime_scripts.py --extract [--slime-git DIR] [--commit REV]   # rewrite the corpus JSON
    python tools/slime_scripts.py --table                                      # dry-run every script, print

Extraction (`extract`): the slime tree at `--commit` is unpacked with `git archive` into a temporary
folder (as `<tmp>/slime`), and each launch script (`scripts/**.sh` and `examples/**.sh`, not
`scripts/models/`) runs as `bash <script>` from the tree's root, the way slime's README runs them. A
prelude (bash's BASH_ENV, and a PATH of stub executables for what is not a bash function call) replaces
the external commands: `ray` (`ray job submit ... -- CMD` is recorded), `python`/`python3` (a program
`X.py ARGS` is recorded; `python3 -` prints `{}`), `pkill`, `sleep`, `nvidia-smi` (an 8-GPU node),
`pip`, `hf`, `huggingface-cli`, `wget`, `git`, `curl`, `ssh`, `hostname`, `ps`, `date` (the commit's
time), `mkdir`/`rm`/`mktemp` (only inside the temporary folder). `source` of a path under `/root/slime`
(slime's docker image keeps the repository there) reads the unpacked tree, and a sourced models file
that does not exist where the script looks reads `scripts/models/<its name>` (both noted per script).
The corpus (`tests/migration/slime_scripts.json`) keeps per script: the entry program, the argv as bash
expanded it (the temporary tree written back as /root/slime), the models file sourced, the variables a
user may set (`${NAME:-default}` in the script) with their values, what the script exported, and the
GPUs it asks for. The JSON is all the tests read: no network, no slime checkout.

Dry run (`run_script`): the argv with paths substituted (--hf-checkpoint -> a folder holding the
published config.json of the script's model, tests/migration/hf_configs/<name>/config.json;
--load/--save/--ref-load/--save-hf -> temporary paths), then `slime_rl.train.main(argv + ['--dry-run',
'--cluster', NODESxGPUS])` in this process, classified as `plans`, `refused-allowed` (needs
TransformerEngine, hardware not present, SFT only, or a parallel layout of the script's own that
megatron-core's own checks refuse as well: `megatron_verdicts`), `refused-named`, `unnamed` (a flag
slime-rl does not know) or `traceback`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SLIME_GIT = "/work/.mirror/THUDM+slime/repo"
CORPUS = REPO / "tests" / "migration" / "slime_scripts.json"
HF_CONFIGS = REPO / "tests" / "migration" / "hf_configs"
# the --eval-config files the scripts name (slime's own YAML, its sets and settings), by file name
EVAL_CONFIGS = REPO / "tests" / "migration" / "eval_configs"
# the --custom-config-path files they name (slime's mismatch helper's mis.yaml), by file name
CUSTOM_CONFIGS = REPO / "tests" / "migration" / "custom_configs"
# the --sglang-config files a script writes itself (a heredoc into a mktemp file) before it starts: the file's text
# as the script writes it, by the script's file name (SGLANG_CONFIGS / <script stem>.yaml)
SGLANG_CONFIGS = REPO / "tests" / "migration" / "sglang_configs"
# where slime's docker image keeps the repository: the unpacked tree is written back as this path
SLIME_ROOT = "/root/slime"
# the environment a user of these scripts sets
# (several refuse to start without them; five pass `--wandb-key ${WANDB_KEY}`, which without it leaves the flag
# without a value)
INPUTS = {"MASTER_ADDR": "127.0.0.1", "BASE_FOLDER": "/root", "BASE_DIR": "/root", "WANDB_KEY": "wandb-key"}
ENTRIES = ("train.py", "train_async.py")
OUTCOMES = ("plans", "refused-allowed", "refused-named", "unnamed", "traceback")

# ---------------------------------------------------------------------------------------------------
# extraction

PRELUDE = r"""
# stubs of the external commands of slime's launch scripts (tools/slime_scripts.py); every stub turns
# off the script's -x/-e/-u for itself (local -)
__stub_log() { printf '%q ' "$@" >> "$SLIME_STUB_OUT/log"; echo >> "$SLIME_STUB_OUT/log"; }
__stub_record() {  # KIND ARGV...: the call, the shell's variables and the environment, in callN/
    local __n=0 __d __v
    # the first free number, claimed by mkdir (atomic: a call in the background may record at the same time)
    while ! command mkdir "$SLIME_STUB_OUT/call$((++__n))" 2>/dev/null; do :; done
    __d="$SLIME_STUB_OUT/call$__n"
    printf '%s' "$1" > "$__d/kind"; shift
    printf '%s\0' "$@" > "$__d/argv"
    for __v in $(compgen -v); do
        case "$__v" in __*|BASH*|FUNCNAME|PIPESTATUS|GROUPS|DIRSTACK|COMP_*|SLIME_STUB_*) continue;; esac
        printf '%s\0%s\0' "$__v" "${!__v-}"
    done > "$__d/vars"
    env -0 > "$__d/env"
}
__stub_inside() { case "$(realpath -m -- "$1")" in "$SLIME_STUB_ROOT"/*) return 0;; esac; return 1; }
ray() {
    local -; set +xeu
    __stub_log ray "$@"
    if [ "${1-}" = job ] && [ "${2-}" = submit ]; then __stub_record ray_job_submit "$@"; fi
    if [ "${1-}" = start ]; then __stub_record ray_start "$@"; fi
    return 0
}
__stub_python() {
    local __name=$1; shift
    local -a __a=("$@"); local __i=0
    while [ $__i -lt ${#__a[@]} ]; do
        case "${__a[$__i]}" in
            -X|-W) __i=$((__i + 2));;
            -c) __stub_log "$__name" "$@"; return 0;;
            -m) __stub_record python_module "$__name" "$@"; return 0;;
            -) __stub_log "$__name" "$@"; cat > /dev/null; echo '{}'; return 0;;
            -*) __i=$((__i + 1));;
            *) __stub_record python "$__name" "$@"; return 0;;
        esac
    done
    cat > /dev/null; return 0
}
python() { local -; set +xeu; __stub_python python "$@"; }
python3() { local -; set +xeu; __stub_python python3 "$@"; }
nvidia-smi() {
    local -; set +xeu
    __stub_log nvidia-smi "$@"
    case "${1-}" in
        -L) for __i in 0 1 2 3 4 5 6 7; do echo "GPU $__i: NVIDIA H100 80GB HBM3 (UUID: GPU-stub-$__i)"; done;;
        topo) echo "        GPU0 GPU1"; echo "GPU0     X   NV18"; echo "GPU1    NV18  X";;
        *) echo "NVIDIA-SMI stub: 8 x NVIDIA H100 80GB HBM3, NVLink";;
    esac
    return 0
}
hostname() { local -; set +xeu; if [ "${1-}" = -I ]; then echo 127.0.0.1; else echo slime-head; fi; }
date() { local -; set +xeu; TZ=UTC command date -d "@$SLIME_STUB_EPOCH" "$@"; }
head() {
    local -; set +xeu
    if [ "$#" -eq 1 ] && [ "$1" = /dev/urandom ]; then echo SLIMESTUB; return 0; fi
    command head "$@"
}
ps() { local -; set +xeu; __stub_log ps "$@"; return 0; }
mkdir() {
    local -; set +xeu; local __a
    for __a in "$@"; do
        case "$__a" in -*) continue;; esac
        if __stub_inside "$__a"; then command mkdir -p -- "$__a"; else __stub_log mkdir "$__a"; fi
    done
    return 0
}
rm() {
    local -; set +xeu; local __a
    for __a in "$@"; do
        case "$__a" in -*) continue;; esac
        if __stub_inside "$__a"; then command rm -rf -- "$__a"; else __stub_log rm "$__a"; fi
    done
    return 0
}
mktemp() {
    local -; set +xeu; local __a __dir=0 __t=tmp.XXXXXX
    for __a in "$@"; do case "$__a" in -d) __dir=1;; -*) ;; *) __t=$__a;; esac; done
    __t="$SLIME_STUB_TMP/$(basename -- "$__t")"; __t=${__t//X/0}
    if [ $__dir = 1 ]; then command mkdir -p -- "$__t"; else : > "$__t"; fi
    echo "$__t"
}
pip() {  # slime's image: megatron-core installed from /root/Megatron-LM
    local -; set +xeu; __stub_log pip "$@"
    if [ "${1-}" = list ]; then echo "megatron-core 0.13.0 /root/Megatron-LM"; fi
    return 0
}
pip3() { pip "$@"; }
for __stub_name in pkill sleep hf huggingface-cli wget git curl ssh scp rsync sudo docker; do
    eval "$__stub_name() { local -; set +xeu; __stub_log $__stub_name \"\$@\"; return 0; }"
done
unset __stub_name
source() {
    local __src=$1; shift
    local __to=$__src
    case "$__src" in /root/slime/*) __to="$SLIME_STUB_TREE/${__src#/root/slime/}";; esac
    if [ ! -e "$__to" ] && [ -e "$SLIME_STUB_TREE/scripts/models/$(basename -- "$__src")" ]; then
        __to="$SLIME_STUB_TREE/scripts/models/$(basename -- "$__src")"
    fi
    printf '%s\t%s\n' "$__src" "$__to" >> "$SLIME_STUB_OUT/sourced"
    builtin source "$__to" "$@"
}
"""

# names the PATH stubs cover (a call that is not a bash function call: `env X`, `xargs X`, ...)
STUB_COMMANDS = ("ray", "python", "python3", "nvidia-smi", "hostname", "ps", "pkill", "sleep", "pip", "pip3", "hf",
                 "huggingface-cli", "wget", "git", "curl", "ssh", "scp", "rsync", "sudo", "docker")
# variables of the shell itself or of the stubs' environment, never the script's
_SHELL_VARS = {"PATH", "PWD", "OLDPWD", "SHLVL", "_", "HOME", "LANG", "TZ", "BASH_ENV", "IFS", "OPTIND", "OPTERR",
               "PS4", "PPID", "UID", "EUID", "HOSTNAME", "HOSTTYPE", "MACHTYPE", "OSTYPE", "SHELLOPTS", "SECONDS",
               "RANDOM", "LINENO", "EPOCHSECONDS", "EPOCHREALTIME", "SRANDOM", "HISTCMD", "LC_ALL", "TERM"}


def launch_scripts(tree: Path) -> list[str]:
    """The launch scripts of a slime tree: every *.sh under scripts/ and examples/ except scripts/models/."""
    found = [p.relative_to(tree).as_posix() for top in ("scripts", "examples") for p in (tree / top).rglob("*.sh")]
    return sorted(f for f in found if not f.startswith("scripts/models/"))


def unpack(git_dir: str, commit: str, dest: Path) -> None:
    """`git archive` of `commit` into `dest` (created)."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", f"--git-dir={git_dir}", "archive", commit], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)


def _read_pairs(path: Path) -> dict[str, str]:
    parts = path.read_bytes().decode(errors="replace").split("\0")
    return dict(zip(parts[0:-1:2], parts[1::2], strict=False))


def _read_env(path: Path) -> dict[str, str]:
    return dict(item.split("=", 1) for item in path.read_bytes().decode(errors="replace").split("\0") if "=" in item)


def _stub_env(sandbox: Path, tree: Path, out: Path, epoch: int, inputs: dict[str, str]) -> dict[str, str]:
    bin_dir = sandbox / "stub-bin"
    bin_dir.mkdir(exist_ok=True)
    prelude = sandbox / "prelude.sh"
    prelude.write_text(PRELUDE)
    for name in STUB_COMMANDS:
        exe = bin_dir / name
        exe.write_text(f'#!/bin/bash\nsource "{prelude}"\n{name} "$@"\n')
        exe.chmod(0o755)
    (sandbox / "tmp").mkdir(exist_ok=True)
    return {"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8", "TZ": "UTC",
            "BASH_ENV": str(prelude), "SLIME_STUB_OUT": str(out), "SLIME_STUB_ROOT": str(sandbox),
            "SLIME_STUB_TREE": str(tree), "SLIME_STUB_TMP": str(sandbox / "tmp"), "SLIME_STUB_EPOCH": str(epoch),
            **inputs}


def _calls(out: Path) -> list[dict[str, Any]]:
    calls = []
    for d in sorted(out.glob("call*"), key=lambda p: int(p.name[4:])):
        argv = d.joinpath("argv").read_bytes().decode(errors="replace").split("\0")[:-1]
        calls.append({"kind": d.joinpath("kind").read_text(), "argv": argv, "vars": _read_pairs(d / "vars"),
                      "env": _read_env(d / "env")})
    return calls


def _train_command(call: dict[str, Any]) -> tuple[str, list[str], dict[str, Any]] | None:
    """(program, args, ray options) of a recorded call that runs a Python program, else None."""
    argv = call["argv"]
    ray_opts: dict[str, Any] = {}
    if call["kind"] == "ray_job_submit":
        if "--" not in argv:
            return None
        cut = argv.index("--")
        for opt in argv[2:cut]:
            if opt.startswith("--runtime-env-json="):
                try:
                    ray_opts["runtime_env"] = json.loads(opt.partition("=")[2])
                except json.JSONDecodeError:
                    ray_opts["runtime_env"] = opt.partition("=")[2]
        argv = argv[cut + 1:]
    elif call["kind"] != "python":
        return None
    if not argv or Path(argv[0]).name not in ("python", "python3"):
        return None
    i = 1
    while i < len(argv) and argv[i].startswith("-"):
        i += 2 if argv[i] in ("-X", "-W") else 1
        if argv[i - 1] in ("-m", "-c"):
            return None
    if i >= len(argv):
        return None
    return argv[i], argv[i + 1:], ray_opts


def _user_knobs(texts: Iterable[str]) -> list[str]:
    """Variables a script reads with a default (`${NAME:-...}`, `${NAME-...}`, `${NAME:=...}`): what a
    user sets to change the run."""
    names: list[str] = []
    for text in texts:
        for m in re.finditer(r"\$\{([A-Za-z_][A-Za-z0-9_]*):?[-=]", text):
            if m.group(1) not in names:
                names.append(m.group(1))
    return names


def _option(argv: Sequence[str], flag: str) -> str | None:
    """The value of the last `flag VALUE` / `flag=VALUE` in argv."""
    value = None
    for i, tok in enumerate(argv):
        if tok == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif tok.startswith(flag + "="):
            value = tok.partition("=")[2]
    return value


def gpus_asked(argv: Sequence[str], node_gpus: str | None = None) -> dict[str, Any]:
    """The GPUs slime places for this argv (slime/ray/placement_group.py): the actor's nodes x GPUs per node
    (the critic shares them), plus --rollout-num-gpus unless --colocate (then the larger of the two) or
    --debug-train-only. `cluster` is NODESxGPUS: nodes of `node_gpus` GPUs (the script's `ray start --head
    --num-gpus`, else 8; at least the actor's GPUs per node), as many as the total needs."""
    def last(flag: str, default: int | None) -> int | None:
        value = _option(argv, flag)
        return default if value is None else int(value)

    nodes, per_node = last("--actor-num-nodes", 1), last("--actor-num-gpus-per-node", 8)
    actor = nodes * per_node
    rollout = last("--rollout-num-gpus", None)
    colocate, train_only = "--colocate" in argv, "--debug-train-only" in argv
    if train_only:
        total = actor
    elif colocate:
        total = max(actor, rollout if rollout is not None else actor)
    else:
        total = actor + (rollout or 0)
    per = max(int(node_gpus) if node_gpus and node_gpus.isdigit() else 8, per_node)
    return {"actor_nodes": nodes, "actor_gpus_per_node": per_node, "rollout_num_gpus": rollout,
            "colocate": colocate, "total": total, "cluster": f"{max(1, math.ceil(total / per))}x{per}"}


def extract_script(tree: Path, rel: str, epoch: int = 0, inputs: dict[str, str] | None = None,
                   timeout: float = 60) -> dict[str, Any]:
    """Run `bash <rel>` in `tree` (a slime tree; its parent is the sandbox the stubs may write in) and
    return the script's record; a script whose train command was not captured gets `error` (the reason)."""
    tree = tree.resolve()
    sandbox = tree.parent
    out = Path(tempfile.mkdtemp(prefix="calls-", dir=sandbox))
    env = _stub_env(sandbox, tree, out, epoch, dict(INPUTS if inputs is None else inputs))
    started = time.time()
    record: dict[str, Any] = {"script": rel}
    try:
        proc = subprocess.run(["bash", rel], cwd=tree, env=env, capture_output=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
        rc, stderr = proc.returncode, proc.stderr.decode(errors="replace")
    except subprocess.TimeoutExpired:
        rc, stderr = None, f"did not finish in {timeout:.0f} s"
    finally:
        _remove_stray_files(started)
    norm = _normalizer(tree, sandbox / "tmp")
    sourced = []  # (the path the script gave, the file read), raw
    if (out / "sourced").is_file():
        sourced = [tuple(line.split("\t")) for line in (out / "sourced").read_text().splitlines()]
    calls = _calls(out)
    commands = [(c, cmd) for c in calls if (cmd := _train_command(c)) is not None]
    lines = stderr.strip().splitlines()
    said = [line for line in lines if line.startswith(f"{rel}: ")]  # bash's own errors: "<script>: line N: ..."
    said = said or [line for line in lines if not line.startswith("+")]  # else the last lines not of its -x trace
    tail = " | ".join(norm(line) for line in said[-3:])
    if not commands:
        record["error"] = (f"no train command captured (bash exited {rc}): {tail}" if rc is not None
                           else f"no train command captured: {stderr}")
        return record
    call, (program, args, ray_opts) = commands[-1]
    args = [norm(a) for a in args]
    record["entry"] = Path(program).name if Path(program).name in ENTRIES else f"other: {norm(program)}"
    record["program"] = norm(program)
    record["launched_by"] = "ray job submit" if call["kind"] == "ray_job_submit" else "python"
    record["argv"] = args
    if rc != 0:  # the script fails as written (e.g. a line of the train command without its backslash)
        record["error"] = f"bash exited {rc} after the train command, which is cut short as written: {tail}"
    read_files = [os.path.normpath(read) for _, read in sourced]
    models = [norm(r) for r in read_files if "/scripts/models/" in r]
    record["models_file"] = models[0].removeprefix(SLIME_ROOT + "/") if models else None
    notes = []
    for asked, read in sourced:
        if asked.startswith(SLIME_ROOT + "/"):
            notes.append(f"sources {asked}: read from the unpacked tree (slime's docker image keeps the "
                         f"repository at {SLIME_ROOT})")
        elif asked != read:
            notes.append(f"sources {norm(os.path.normpath(asked))}, which is not in slime's tree; read "
                         f"{norm(os.path.normpath(read))} instead")
    for c in calls:
        if c["kind"] == "python_module":
            module = c["argv"][c["argv"].index("-m") + 1] if "-m" in c["argv"] else "?"
            notes.append(f"also runs {Path(c['argv'][0]).name} -m {module} (stubbed: nothing started)")
    if len(commands) > 1:
        notes.append(f"{len(commands)} Python programs run; the last one ({norm(program)}) is the train command")
    texts = [(tree / rel).read_text()] + [Path(r).read_text() for r in read_files if Path(r).is_file()]
    shell_vars = call["vars"]
    record["user_vars"] = {k: norm(shell_vars[k]) for k in _user_knobs(texts) if k in shell_vars}
    record["exported"] = {k: norm(v) for k, v in sorted(call["env"].items())
                          if k not in _SHELL_VARS and not k.startswith("SLIME_STUB_") and env.get(k) != v}
    if "runtime_env" in ray_opts:
        record["ray_runtime_env"] = _normalize_json(ray_opts["runtime_env"], norm)
    head_gpus = [_option(c["argv"], "--num-gpus") for c in calls if c["kind"] == "ray_start" and "--head" in c["argv"]]
    record["ray_head_gpus"] = head_gpus[-1] if head_gpus else None
    record["gpus"] = gpus_asked(args, record["ray_head_gpus"])
    record["sft"] = is_sft(args)
    record["notes"] = notes
    return record


def _normalize_json(value: Any, norm) -> Any:
    if isinstance(value, dict):
        return {k: _normalize_json(v, norm) for k, v in value.items()}
    if isinstance(value, list):
        return [_normalize_json(v, norm) for v in value]
    return norm(value) if isinstance(value, str) else value


def _normalizer(tree: Path, tmp: Path):
    pairs = [(str(tree), SLIME_ROOT), (str(tmp), "/tmp")]

    def norm(text: str) -> str:
        for a, b in pairs:
            text = text.replace(a, b)
        return text

    return norm


def _remove_stray_files(since: float) -> None:
    """A script's output redirected to a file named from /dev/urandom (stubbed: SLIMESTUB) lands in /tmp:
    remove what this run left there."""
    for path in Path("/tmp").glob("*SLIMES*"):
        with contextlib.suppress(OSError):
            if path.is_file() and path.stat().st_mtime >= since - 1:
                path.unlink()


def is_sft(argv: Sequence[str]) -> bool:
    """slime's supervised fine-tuning scripts: --loss-type sft_loss (with its --rollout-function-path
    slime.rollout.sft_rollout.generate_rollout)."""
    for i, tok in enumerate(argv):
        if tok == "--loss-type" and i + 1 < len(argv) and argv[i + 1] == "sft_loss":
            return True
        if tok == "--loss-type=sft_loss" or "sft_rollout" in tok:
            return True
    return False


def extract(git_dir: str, commit: str = "HEAD") -> dict[str, Any]:
    """The corpus of every launch script of slime at `commit`."""
    sha = subprocess.run(["git", f"--git-dir={git_dir}", "rev-parse", f"{commit}^{{commit}}"], capture_output=True,
                         text=True, check=True).stdout.strip()
    epoch, date = subprocess.run(["git", f"--git-dir={git_dir}", "log", "-1", "--format=%ct %cs", sha],
                                 capture_output=True, text=True, check=True).stdout.split()
    with tempfile.TemporaryDirectory(prefix="slime-scripts-") as tmp:
        tree = Path(tmp) / "slime"
        unpack(git_dir, sha, tree)
        scripts = [extract_script(tree, rel, int(epoch)) for rel in launch_scripts(tree)]
    return {
        "source": "https://github.com/THUDM/slime",
        "commit": sha,
        "commit_date": date,
        "extracted_by": "python tools/slime_scripts.py --extract",
        "inputs": INPUTS,
        "stubs": "tools/slime_scripts.py PRELUDE: nvidia-smi reports 8 GPUs (H100 80GB, NVLink); date prints the "
                 "commit's time; pip list shows megatron-core; ray, python, pkill, sleep, pip install, hf, wget, "
                 "git, curl, ssh do nothing",
        "tree_root": SLIME_ROOT,
        "scripts": scripts,
    }


# ---------------------------------------------------------------------------------------------------
# the published config.json of each script's model (the last folder name of its --hf-checkpoint)

ORCHESTRATION_CONFIGS = REPO / "tests" / "orchestration" / "hf_configs"
# folder name of --hf-checkpoint -> (the model's config: a folder of HF_CONFIGS or a file of
# ORCHESTRATION_CONFIGS, why that one when the folder names another checkpoint)
MODELS: dict[str, tuple[str, str | None]] = {
    "Qwen3-4B": ("qwen3_4b.json", None),
    "Qwen3-4B-FP8": ("Qwen3-4B-FP8", None),
    "Qwen3-4B-Base": ("Qwen3-4B-Base", None),
    "Qwen3-4B-Instruct-2507": ("Qwen3-4B-Instruct-2507", None),
    "qwen3-4b-sft": ("Qwen3-4B-Instruct-2507", "font-info/qwen3-4b-sft-SGLang-RL is Qwen3-4B-Instruct-2507 after "
                     "examples/retool/retool_qwen3_4b_sft.sh: that model's config.json"),
    "Qwen3-8B": ("Qwen3-8B", None),
    "Qwen3-32B": ("Qwen3-32B", None),
    "Qwen3-30B-A3B": ("qwen3_30b_a3b.json", None),
    "Qwen3-30B-A3B-FP8": ("Qwen3-30B-A3B-FP8", None),
    "Qwen3-30B-A3B-INT4": ("qwen3_30b_a3b.json", "slime's INT4 conversion (tools/convert_hf_to_int4_direct.py) of "
                           "Qwen3-30B-A3B: that model's config.json, without its quantization_config"),
    "Qwen3-235B-A22B": ("Qwen3-235B-A22B", None),
    "Qwen3-235B-A22B-FP8": ("Qwen3-235B-A22B-FP8", None),
    "Qwen3-235B-A22B-INT4": ("Qwen3-235B-A22B", "slime's INT4 conversion of Qwen3-235B-A22B: that model's config.json, "
                             "without its quantization_config"),
    "Qwen2.5-0.5B-Instruct": ("Qwen2.5-0.5B-Instruct", None),
    "Qwen2.5-3B": ("Qwen2.5-3B", None),
    "Qwen3-Next-80B-A3B-Thinking": ("Qwen3-Next-80B-A3B-Thinking", None),
    "Qwen3.5-9B": ("Qwen3.5-9B", None),
    "Qwen3.5-27B": ("Qwen3.5-27B", None),
    "Qwen3.5-35B-A3B": ("Qwen3.5-35B-A3B", None),
    "Qwen3.6-35B-A3B": ("Qwen3.6-35B-A3B", None),
    "DeepSeek-R1": ("DeepSeek-R1", None),
    "Kimi-K2-Thinking": ("Kimi-K2-Thinking", None),
    "Kimi-K2-Thinking-fp8": ("Kimi-K2-Thinking", "slime's FP8 conversion of Kimi-K2-Thinking: that model's "
                             "config.json"),
    "Moonlight-16B-A3B": ("Moonlight-16B-A3B", None),
    "Moonlight-16B-A3B-Instruct-INT4": ("Moonlight-16B-A3B", "slime's INT4 conversion of Moonlight-16B-A3B-Instruct "
                                        "(the architecture of Moonlight-16B-A3B)"),
    "GLM-Z1-9B-0414": ("GLM-Z1-9B-0414", None),
    "GLM-4.7-Flash": ("GLM-4.7-Flash", None),
    "GLM-4.7-355B-A32B": ("GLM-4.7", "zai-org/GLM-4.7 (355B-A32B)"),
    "GLM-5": ("GLM-5", None),
    "GLM-5.2-FP8": ("GLM-5.2-FP8", None),
    "MiMo-7B-RL": ("MiMo-7B-RL", None),
    "MiniMax-M2.5": ("minimax_m2_5.json", None),
}
# the checkpoint flags that become temporary paths (none of them exists there)
CHECKPOINT_FLAGS = ("--load", "--save", "--ref-load", "--save-hf", "--critic-load", "--critic-save")


def model_of(argv: Sequence[str]) -> str | None:
    """The folder name of the last --hf-checkpoint."""
    value = _option(argv, "--hf-checkpoint")
    return None if value is None else Path(value.rstrip("/")).name


def hf_config(name: str) -> dict[str, Any]:
    """The config.json of a folder name of MODELS."""
    source, _ = MODELS[name]
    path = ORCHESTRATION_CONFIGS / source if source.endswith(".json") else HF_CONFIGS / source / "config.json"
    return json.loads(path.read_text())


def dry_run_argv(record: dict[str, Any], workdir: Path) -> list[str]:
    """The script's argv with paths substituted: each --hf-checkpoint a folder holding its model's config.json,
    the checkpoint flags temporary paths, an --eval-config or --custom-config-path the corpus's copy of that file
    (EVAL_CONFIGS, CUSTOM_CONFIGS), an --sglang-config the file the script writes (SGLANG_CONFIGS); then
    `--dry-run --cluster NODESxGPUS`."""
    argv = list(record["argv"])
    for i, tok in enumerate(argv[:-1]):
        if tok == "--hf-checkpoint":
            name = Path(argv[i + 1].rstrip("/")).name
            folder = workdir / "hf" / name
            if not folder.is_dir():
                folder.mkdir(parents=True)
                (folder / "config.json").write_text(json.dumps(hf_config(name)))
            argv[i + 1] = str(folder)
        elif tok in CHECKPOINT_FLAGS:
            argv[i + 1] = str(workdir / "ckpt" / tok.lstrip("-"))
        elif tok == "--eval-config" and (EVAL_CONFIGS / Path(argv[i + 1]).name).is_file():
            argv[i + 1] = str(EVAL_CONFIGS / Path(argv[i + 1]).name)
        elif tok == "--custom-config-path" and (CUSTOM_CONFIGS / Path(argv[i + 1]).name).is_file():
            argv[i + 1] = str(CUSTOM_CONFIGS / Path(argv[i + 1]).name)
        elif tok == "--sglang-config":
            written = SGLANG_CONFIGS / (Path(record["script"]).stem.removeprefix("run-") + ".yaml")
            if written.is_file():
                argv[i + 1] = str(written)
    return [*argv, "--dry-run", "--cluster", record["gpus"]["cluster"]]


# ---------------------------------------------------------------------------------------------------
# the dry run and its outcome

# named refusals of an allowed kind: (what the sentence says, the kind)
ALLOWED = (
    (re.compile(r"TransformerEngine"), "needs TransformerEngine"),
    (re.compile(r"sft_loss|supervised fine-tuning|SFT", re.IGNORECASE), "SFT only"),
    (re.compile(r"\b(ROCm|AMD|HIP|NVFP4|Blackwell|Hopper)\b"), "hardware not present"),
)
UNKNOWN_FLAG = "is not a flag of slime-rl train"
# a refusal of the script's parallel layout (config/pipeline.py, config/checks.py): checked against megatron-core's
# own code (megatron_rejects) before it is called the script's own error
LAYOUT_REFUSAL = re.compile(r"pipeline stage\(s\), which must share them evenly|must divide the trainer world size")

# megatron-core 0.19's checks of a parallel layout, run in a fresh interpreter (its process group is one gloo rank
# standing for the script's world; nothing else of the suite's process is touched): the layers of each pipeline
# stage (transformer_block.get_num_layers_to_build) and the model-parallel grids
# (parallel_state.initialize_model_parallel); prints megatron's message, or nothing when megatron accepts the layout
_MEGATRON_CHECK = """
import json, sys, torch
from torch.distributed import HashStore, init_process_group
from slime_rl.trainer import cpu_compat
cpu_compat.apply(only=("paged_stash",))
with cpu_compat.eager_jit_fuser():  # megatron's jit_fuser without torch.compile on CPU, as the trainer imports it
    from megatron.core import parallel_state
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import get_num_layers_to_build
init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
for lay in json.loads(sys.argv[1]):
    said = ""
    if lay["pp"] > 1 and lay["first"] is None and lay["last"] is None:
        cfg = TransformerConfig(num_layers=lay["layers"], hidden_size=64, num_attention_heads=4,
                                pipeline_model_parallel_size=lay["pp"], pipeline_dtype=torch.float32)
        try:
            get_num_layers_to_build(cfg, vp_stage=None, pp_rank=0)
        except AssertionError as exc:
            said = f"AssertionError: {exc}"
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=lay["tp"], pipeline_model_parallel_size=lay["pp"],
            context_parallel_size=lay["cp"], expert_model_parallel_size=lay["ep"],
            expert_tensor_parallel_size=lay["etp"], local_world_size=lay["world"])
    except RuntimeError as exc:  # the sizes' own check, before any group is made
        if str(exc).startswith("world_size ("):
            said = said or f"RuntimeError: {exc}"
    except Exception:  # a layout megatron takes goes on to make its groups, which one gloo rank cannot hold
        pass
    parallel_state.destroy_model_parallel()
    print(json.dumps(said))
"""


def parallel_layout(record: dict[str, Any]) -> dict[str, Any]:
    """The trainer's parallel layout the script asks for: sizes, its world (the actor's GPUs) and its layers
    (--num-layers, else its config.json's num_hidden_layers)."""
    argv = record["argv"]

    def size(flag: str, default: int | None = 1) -> int | None:
        value = _option(argv, flag)
        return default if value is None else int(value)

    gpus = record["gpus"]
    layers = size("--num-layers", None)
    if layers is None:
        layers = int(hf_config(model_of(argv))["num_hidden_layers"])
    tp = size("--tensor-model-parallel-size")
    return {"tp": tp, "pp": size("--pipeline-model-parallel-size"), "cp": size("--context-parallel-size"),
            "ep": size("--expert-model-parallel-size"), "etp": size("--expert-tensor-parallel-size", tp),
            "world": gpus["actor_nodes"] * gpus["actor_gpus_per_node"], "layers": layers,
            "first": size("--decoder-first-pipeline-num-layers", None),
            "last": size("--decoder-last-pipeline-num-layers", None)}


def megatron_rejects(layouts: Sequence[dict[str, Any]]) -> list[str | None]:
    """For each layout (parallel_layout's), megatron-core's own message refusing it, or None where megatron-core
    takes it: one interpreter for all (importing megatron costs seconds)."""
    if not layouts:
        return []
    done = subprocess.run([sys.executable, "-c", _MEGATRON_CHECK, json.dumps(list(layouts))], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    said = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('"')]
    if done.returncode != 0 or len(said) != len(layouts):
        raise RuntimeError(f"megatron-core's layout check did not run: {done.stderr.strip()[-2000:]}")
    return [text or None for text in said]


def run_cli(argv: list[str], tmp: str) -> tuple[Any, str, str | None, list[str]]:
    """`slime_rl.train.main(argv)` in this process, what it prints captured (warnings always shown): (its exit
    code, stdout + stderr, the traceback of any exception but SystemExit, the CLI's error sentences), the temporary
    folder `tmp` written as <tmp> so that a table does not change from one run to the next."""
    import warnings

    from slime_rl import train

    out, err = io.StringIO(), io.StringIO()
    rc: Any = None
    trace = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("always")
        try:
            rc = train.main(argv)
        except SystemExit as exc:  # argparse's own exit (--help) or a deliberate one
            rc = exc.code
        except BaseException:  # noqa: BLE001 - every other exception is the outcome `traceback`
            trace = traceback.format_exc().replace(tmp, "<tmp>")
    output = (out.getvalue() + err.getvalue()).replace(tmp, "<tmp>")
    errors = [line.removeprefix("slime-rl train: error: ") for line in err.getvalue().replace(tmp, "<tmp>").splitlines()
              if line.startswith("slime-rl train: error: ")]
    return rc, output, trace, errors


def dry_run(record: dict[str, Any]) -> dict[str, Any]:
    """Dry-run one corpus record through `slime_rl.train.main` in this process: {outcome, reason, output, and
    `layout` where the script's parallel layout was refused}."""
    if record.get("error"):
        return {"outcome": "not-extracted", "reason": record["error"], "output": ""}
    with tempfile.TemporaryDirectory(prefix="slime-script-") as tmp:
        rc, output, trace, errors = run_cli(dry_run_argv(record, Path(tmp)), tmp)
    if trace is not None:
        return {"outcome": "traceback", "reason": trace.strip().splitlines()[-1], "output": output + trace}
    if rc == 0:
        return {"outcome": "plans", "reason": "", "output": output}
    if rc != 2 or not errors:
        return {"outcome": "traceback", "reason": f"exit {rc} without the CLI's error line", "output": output}
    reason = errors[-1]
    if UNKNOWN_FLAG in reason:
        return {"outcome": "unnamed", "reason": reason, "output": output}
    for pattern, kind in ALLOWED:
        if pattern.search(reason):
            return {"outcome": "refused-allowed", "reason": f"{kind}: {reason}", "output": output}
    if record.get("sft"):  # a supervised fine-tuning script (--loss-type sft_loss): not an RL run, whatever stops first
        return {"outcome": "refused-allowed", "reason": f"SFT only (--loss-type sft_loss): {reason}", "output": output}
    if LAYOUT_REFUSAL.search(reason):  # megatron_verdicts decides
        return {"outcome": "refused-named", "reason": reason, "output": output, "layout": parallel_layout(record)}
    return {"outcome": "refused-named", "reason": reason, "output": output}


def megatron_verdicts(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each refusal of a script's parallel layout (a result with `layout`) that megatron-core's own code refuses as
    well is the script's own error (slime's trainer cannot start it either): `refused-allowed`, megatron's message
    in the reason; refused-named where megatron-core takes the layout."""
    asked = [r for r in results if "layout" in r]
    for result, said in zip(asked, megatron_rejects([r["layout"] for r in asked]), strict=True):
        if said:
            result.update(outcome="refused-allowed", reason=f"the script's own layout, which megatron-core refuses "
                          f"too ({said}): {result['reason']}")
    return results


def run_script(record: dict[str, Any]) -> dict[str, Any]:
    """Dry-run one corpus record through `slime_rl.train.main` in this process: {outcome, reason, output}; a
    refusal of its parallel layout is checked against megatron-core's (megatron_verdicts)."""
    return megatron_verdicts([dry_run(record)])[0]


# ---------------------------------------------------------------------------------------------------
# every flag of every script: accepted, refused with a reason, or unknown

def _values_after(argv: Sequence[str], i: int) -> list[str]:
    """The tokens after argv[i] up to the next flag."""
    out = []
    for tok in argv[i + 1:]:
        if tok.startswith("--"):
            break
        out.append(tok)
    return out


def flag_census(argv: Sequence[str]) -> list[dict[str, str]]:
    """Each flag of argv as slime-rl reads it alone: `accepted`, `refused` (with the sentence: one of slime's
    flags without a counterpart, a value its own check or choices refuse, an --sglang-*/--router-* flag the
    pinned SGLang / sglang-router lacks (their snapshots in slime_rl/engines/) or slime-rl sets itself) or
    `unknown` (not a flag of slime-rl at all). Checks across flags (config/load.py) are the dry run's."""
    from slime_rl.config.checks import ConfigError
    from slime_rl.config.flags import FLAGS, OWN_SGLANG_FLAGS, ROUTER_PREFIX, SGLANG_PREFIX
    from slime_rl.config.parse import _make_parser
    from slime_rl.config.slime_args import SLIME_ONLY_FLAGS
    from slime_rl.engines.cli_args import (
        ROUTER_SNAPSHOT,
        SGLANG_SNAPSHOT,
        CliTable,
        PassthroughError,
        check_passthrough,
    )
    from slime_rl.engines.launch import ROUTER_OWNED, SGLANG_OWNED

    # the snapshots of SGLang's and sglang-router's flags slime-rl carries (importing SGLang takes seconds)
    tables = {prefix: CliTable.from_json(json.loads(path.read_text()), path.name)
              for prefix, path in (("sglang-", SGLANG_SNAPSHOT), ("router-", ROUTER_SNAPSHOT))}
    parser = _make_parser()
    actions = parser._option_string_actions
    by_name = {f.name: f for f in FLAGS}
    out = []
    for i, tok in enumerate(argv):
        if not tok.startswith("--"):
            continue
        name, eq, inline = tok.partition("=")
        values = [inline] if eq else _values_after(argv, i)
        status, reason = "accepted", ""
        if name in SLIME_ONLY_FLAGS:
            status, reason = "refused", f"{name} is slime's and has no counterpart here: {SLIME_ONLY_FLAGS[name]}"
        elif name not in OWN_SGLANG_FLAGS and name.startswith((SGLANG_PREFIX, ROUTER_PREFIX)):
            router = name.startswith(ROUTER_PREFIX)
            prefix = "router-" if router else "sglang-"
            key = name[len("--" + prefix):].replace("-", "_")
            value: Any = values[0] if len(values) == 1 else (values or True)
            try:
                check_passthrough({key: value}, tables[prefix], prefix, ROUTER_OWNED if router else SGLANG_OWNED)
            except PassthroughError as exc:
                status, reason = "refused", str(exc)
        elif name in actions:
            action = actions[name]
            take = 0 if action.nargs == 0 else (len(values) if action.nargs in ("+", "*") else 1)
            try:
                ns = parser.parse_args([tok] if eq else [tok, *values[:take]])
                flag = by_name.get(name)
                if flag is not None and flag.check is not None and getattr(ns, flag.key) is not None:
                    holds, must = flag.check
                    if not holds(getattr(ns, flag.key)):
                        status, reason = "refused", f"{name} {must}"
            except ConfigError as exc:
                status, reason = "refused", str(exc)
        else:
            status = "unknown"
        out.append({"flag": name, "status": status, "reason": reason})
    return out


# ---------------------------------------------------------------------------------------------------
# the table

def load_corpus(path: Path = CORPUS) -> dict[str, Any]:
    return json.loads(path.read_text())


def measure(corpus: dict[str, Any]) -> list[dict[str, Any]]:
    """Every script of the corpus dry-run: its record, outcome, reason and flag census."""
    results = megatron_verdicts([dry_run(record) for record in corpus["scripts"]])
    rows = []
    for record, result in zip(corpus["scripts"], results, strict=True):
        census = flag_census(record["argv"]) if "argv" in record and not record.get("error") else []
        rows.append({"record": record, **result, "census": census})
    return rows


def _cell(text: str, limit: int = 160) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"


def flag_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Distinct flag names over all scripts, each counted once at its worst (unknown > refused > accepted),
    and per unknown / refused flag the scripts that give it."""
    rank = {"accepted": 0, "refused": 1, "unknown": 2}
    worst: dict[str, str] = {}
    scripts: dict[str, set[str]] = {}
    for row in rows:
        for entry in row["census"]:
            name = entry["flag"]
            if rank[entry["status"]] >= rank.get(worst.get(name, "accepted"), 0):
                worst[name] = entry["status"]
            scripts.setdefault(name, set()).add(row["record"]["script"])
    counts = Counter(worst.values())
    by_status = {status: sorted(((n, len(scripts[n])) for n, st in worst.items() if st == status),
                                key=lambda x: (-x[1], x[0])) for status in rank}
    return {"counts": {s: counts.get(s, 0) for s in rank}, "flags": by_status}


def render_table(rows: Sequence[dict[str, Any]], corpus: dict[str, Any], date: str) -> str:
    """The Markdown of docs/migration.md's section (without its heading)."""
    lines = [f"Measured {date} on slime commit {corpus['commit'][:7]} ({corpus['commit_date']}), by running each of "
             "its launch scripts under bash with the external commands stubbed and dry-running the train command "
             "it builds (`slime-rl train ... --dry-run --cluster NODESxGPUS`, the script's GPUs; its "
             "--hf-checkpoint a folder holding the published config.json of its model; --load/--save/--ref-load "
             "temporary paths). Regenerate with `python tools/slime_scripts.py --table` (`--docs` rewrites this "
             "section; `--extract` re-reads the scripts from a slime checkout into "
             "tests/migration/slime_scripts.json). tests/config/test_slime_scripts.py fails when an outcome "
             "below differs from the current one.", "",
             "Outcomes: `plans` (the dry run prints a plan), `refused-allowed` (refused for TransformerEngine, "
             "hardware not present, SFT only, or a parallel layout of the script's own that megatron-core 0.19's "
             "own checks refuse as well, run by the tool: slime cannot start such a script either), "
             "`refused-named` (refused with a sentence naming the flag and why; "
             "the first one is shown), `unnamed` (a flag slime-rl does not know at all), `traceback`, "
             "`not-extracted` (the script fails under bash as written).", "",
             "| script | model | GPUs | outcome | first reason |", "|---|---|---|---|---|"]
    for row in rows:
        rec = row["record"]
        model = model_of(rec.get("argv", [])) or "-"
        gpus = f"{rec['gpus']['total']} ({rec['gpus']['cluster']})" if "gpus" in rec else "-"
        tag = " (sft)" if rec.get("sft") else ""
        lines.append(f"| `{rec['script']}`{tag} | {model} | {gpus} | {row['outcome']} | {_cell(row['reason'])} |")
    outcomes = Counter(row["outcome"] for row in rows)
    flags = flag_summary(rows)
    c = flags["counts"]
    lines += ["", f"{len(rows)} scripts: " + " / ".join(f"{outcomes.get(o, 0)} {o}" for o in
                                                       (*OUTCOMES, "not-extracted")) + ".",
              f"Flags (distinct names over all scripts, each at its worst): {c['accepted']} accepted / "
              f"{c['refused']} refused with a reason / {c['unknown']} unknown.", "",
              "Unknown flags (scripts that give them): "
              + ", ".join(f"`{n}`\u00a0({k})" for n, k in flags["flags"]["unknown"]) + "."]  # kept on one line
    # prose wrapped as the rest of the page is; table rows stay one line each
    return "\n".join(line if line.startswith("|") else textwrap.fill(line, 110, break_on_hyphens=False,
                                                                     break_long_words=False).replace("\u00a0", " ")
                     for line in lines) + "\n"


DOCS = REPO / "docs" / "migration.md"
DOCS_HEADING = "## slime's own launch scripts"


def write_docs(text: str, path: Path = DOCS) -> None:
    """Replace (or append) the section DOCS_HEADING of docs/migration.md with `text`."""
    doc = path.read_text()
    section = f"{DOCS_HEADING}\n\n{text}"
    start = doc.find(DOCS_HEADING + "\n")
    if start < 0:
        doc = doc.rstrip("\n") + "\n\n" + section
    else:
        end = doc.find("\n## ", start + len(DOCS_HEADING))
        doc = doc[:start] + section + ("" if end < 0 else "\n" + doc[end + 1:])
    path.write_text(doc)


def docs_outcomes(path: Path = DOCS) -> dict[str, str]:
    """script -> outcome, as the table of docs/migration.md's section records them."""
    doc = path.read_text()
    start = doc.find(DOCS_HEADING + "\n")
    if start < 0:
        return {}
    end = doc.find("\n## ", start + len(DOCS_HEADING))
    out = {}
    for line in doc[start:None if end < 0 else end].splitlines():
        m = re.match(r"\| `([^`]+)`(?: \(sft\))? \| [^|]* \| [^|]* \| ([a-z-]+) \|", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    import datetime

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--extract", action="store_true", help=f"re-read the scripts into {CORPUS.relative_to(REPO)}")
    p.add_argument("--slime-git", default=DEFAULT_SLIME_GIT, help="slime's git directory (for --extract)")
    p.add_argument("--commit", default="HEAD", help="slime's commit (for --extract)")
    p.add_argument("--table", action="store_true", help="dry-run every script and print the Markdown table")
    p.add_argument("--docs", action="store_true", help="also write the table into docs/migration.md")
    p.add_argument("--date", default=datetime.date.today().isoformat(), help="the date the table names")
    args = p.parse_args(argv)
    if not (args.extract or args.table or args.docs):
        p.error("give --extract, --table or --docs")
    if args.extract:
        corpus = extract(args.slime_git, args.commit)
        CORPUS.parent.mkdir(parents=True, exist_ok=True)
        CORPUS.write_text(json.dumps(corpus, indent=1, ensure_ascii=False) + "\n")
        bad = [s["script"] for s in corpus["scripts"] if s.get("error")]
        print(f"wrote {CORPUS.relative_to(REPO)}: {len(corpus['scripts'])} scripts ({len(bad)} not extracted: "
              f"{', '.join(bad) or 'none'})")
    if args.table or args.docs:
        corpus = load_corpus()
        text = render_table(measure(corpus), corpus, args.date)
        print(text)
        if args.docs:
            write_docs(text)
            print(f"wrote {DOCS.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
