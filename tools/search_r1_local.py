"""slime's search-r1 example (examples/search-r1: its generate and reward functions, unchanged) trained here on
CPU, with the retrieval server and the data it expects made small and local.

    python tools/search_r1_local.py --slime SLIME_GIT_OR_CHECKOUT --hf-checkpoint DIR --out DIR
                                    [--commit REV] [--num-rollout 2] [extra slime-rl train flags ...]

What it does:
1. copies slime's `examples/search-r1` (from a checkout, or `git archive` of REV from a git directory) into
   OUT/search-r1, as it is;
2. serves the retrieval API its `local_search_server.local_search` calls (POST /retrieve with
   {"queries", "topk", "return_scores"} -> {"result": [[{"id", "contents"}, ...]]}; contents '"Title"\\ntext', as
   Search-R1's retrieval_server.py answers) at the address its SEARCH_R1_CONFIGS names, 127.0.0.1:8000, over a
   corpus of a few short documents (`CORPUS`): passages ranked by the words they share with the query;
3. writes prompts in the shape of Search-R1's qa_search_train_merge.py output (a `prompt` chat list with the
   search instruction and the question, `reward_model.ground_truth.target` the answers; the instruction is worded
   here, with the tags the example parses: <think>, <search>, <information>, <answer>);
4. runs `slime-rl train` with the flags of the example's run_qwen2.5_3B.sh that describe its data, algorithm and
   functions (--input-key prompt --label-key reward_model --apply-chat-template, GRPO with the KL loss,
   --custom-generate-function-path generate_with_search.generate --custom-rm-path generate_with_search.reward_func,
   the example folder on PYTHONPATH as its runtime env sets it), sized for CPU: one trainer rank and the built-in
   engine, a few prompts, short responses.

It prints the run's per-step rewards and, from the rollout dumps, how many responses searched and how many got
the example's invalid-action message. No network: the corpus and the prompts are this file's.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

EXAMPLE = "examples/search-r1"
SEARCH_ADDRESS = ("127.0.0.1", 8000)  # generate_with_search.SEARCH_R1_CONFIGS["local"]["search_url"]

# (title, text): each question below is answered by one passage
CORPUS = (
    ("Paris", "Paris is the capital and largest city of France."),
    ("Mount Everest", "Mount Everest is the highest mountain on Earth, in the Himalayas."),
    ("Pacific Ocean", "The Pacific Ocean is the largest and deepest ocean on Earth."),
    ("Jupiter", "Jupiter is the largest planet in the Solar System."),
    ("Nile", "The Nile is a major river in northeastern Africa, often called the longest river."),
    ("Hamlet", "Hamlet is a tragedy written by William Shakespeare."),
    ("Water", "Water boils at 100 degrees Celsius at sea level."),
    ("Canberra", "Canberra is the capital city of Australia."),
)
QUESTIONS = (
    ("what is the capital of france?", ["Paris"]),
    ("what is the highest mountain on earth?", ["Mount Everest", "Everest"]),
    ("which ocean is the largest on earth?", ["Pacific Ocean", "Pacific"]),
    ("what is the largest planet in the solar system?", ["Jupiter"]),
    ("who wrote hamlet?", ["William Shakespeare", "Shakespeare"]),
    ("what is the capital city of australia?", ["Canberra"]),
    ("at what temperature in celsius does water boil at sea level?", ["100", "100 degrees Celsius"]),
    ("which river is often called the longest river?", ["Nile", "the Nile"]),
)
INSTRUCTION = ("Answer the given question. Reason inside <think> and </think> first each time you get new "
               "information. If you lack knowledge, search by writing <search> query </search>; the search engine's "
               "results come back between <information> and </information>. Search as many times as you want. When "
               "you know the answer, give it inside <answer> and </answer>, without further explanation, for example "
               "<answer> Beijing </answer>. Question: {question}\n")
_WORD = re.compile(r"[a-z0-9]+")


def _words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower()))


def retrieve(query: str, topk: int) -> list[dict[str, str]]:
    """The top-k passages of CORPUS for `query` (most shared words first, then corpus order), in the retrieval
    server's item shape."""
    q = _words(query)
    ranked = sorted(range(len(CORPUS)), key=lambda i: (-len(q & _words(" ".join(CORPUS[i]))), i))
    return [{"id": str(i), "contents": f'"{CORPUS[i][0]}"\n{CORPUS[i][1]}'} for i in ranked[:max(topk, 0)]]


class _Retrieval(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        if self.path != "/retrieve":
            self.send_error(404)
            return
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        out = {"result": [retrieve(q, int(body.get("topk", 3))) for q in body.get("queries", [])]}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def serve(address: tuple[str, int] = SEARCH_ADDRESS) -> ThreadingHTTPServer:
    """The retrieval server, answering in a daemon thread; `.shutdown()` stops it."""
    try:
        server = ThreadingHTTPServer(address, _Retrieval)
    except OSError as exc:
        raise SystemExit(f"cannot serve the retrieval API at {address[0]}:{address[1]} (the address slime's "
                         f"generate_with_search.py calls): {exc}") from exc
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def write_data(path: Path, repeat: int = 1) -> Path:
    """Prompts in the shape of Search-R1's training parquet rows (module docstring), as JSON lines."""
    with path.open("w") as f:
        for _ in range(repeat):
            for question, answers in QUESTIONS:
                f.write(json.dumps({"data_source": "local", "ability": "fact-reasoning",
                                    "prompt": [{"role": "user", "content": INSTRUCTION.format(question=question)}],
                                    "reward_model": {"style": "rule", "ground_truth": {"target": answers}}}) + "\n")
    return path


def copy_example(slime: Path, dest: Path, commit: str = "HEAD") -> Path:
    """slime's examples/search-r1 into `dest`, unchanged: from a checkout's folder, else from `git archive`."""
    if dest.exists():
        shutil.rmtree(dest)
    if (slime / EXAMPLE).is_dir():
        shutil.copytree(slime / EXAMPLE, dest)
        return dest
    tar = subprocess.run(["git", "--git-dir", str(slime), "archive", "--format=tar", commit, EXAMPLE],
                         check=True, capture_output=True).stdout
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        for member in t.getmembers():
            if member.isfile():
                member.name = member.name[len(EXAMPLE) + 1:]
                t.extract(member, dest, filter="data")
    return dest


def train_args(data: Path, hf: str, out: Path, num_rollout: int) -> list[str]:
    """run_qwen2.5_3B.sh's data, algorithm and function flags, sized for CPU (module docstring)."""
    return ["--hf-checkpoint", hf, "--prompt-data", str(data), "--input-key", "prompt", "--label-key", "reward_model",
            "--apply-chat-template", "--rollout-shuffle", "--num-rollout", str(num_rollout),
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "96",
            "--rollout-temperature", "1", "--global-batch-size", "8",
            "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.001", "--kl-loss-type", "low_var_kl",
            "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
            "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.01",
            "--adam-beta1", "0.9", "--adam-beta2", "0.98",
            "--custom-generate-function-path", "generate_with_search.generate",
            "--custom-rm-path", "generate_with_search.reward_func",
            # CPU: one trainer rank, the built-in engine
            "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--rollout-backend", "embedded",
            "--run-dir", str(out / "run"), "--dump-rollouts"]


def summarize(run: Path) -> dict:
    """Per step: the mean reward and loss (metrics.jsonl); over the dumped responses: how many searched (the
    example inserts <information> after a search) and how many got the example's invalid-action message."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if r.get("step", -1) >= 0 and "rollout/reward_mean" in r]
    files = sorted((run / "rollouts").glob("step_*.jsonl"))
    dumped = [json.loads(x) for f in files for x in f.read_text().splitlines()]
    seen = Counter(responses=len(dumped))
    for d in dumped:
        seen["searched"] += "<information>" in d["response"]
        seen["invalid_action"] += "My previous action is invalid" in d["response"]
    return {"steps": [{"step": r["step"], "reward_mean": r["rollout/reward_mean"],
                       "loss": r.get("train/loss")} for r in steps], **seen}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slime", type=Path, required=True, help="slime's checkout, or its git directory")
    ap.add_argument("--commit", default="HEAD", help="the revision to take the example from (a git directory)")
    ap.add_argument("--hf-checkpoint", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--num-rollout", type=int, default=2)
    args, extra = ap.parse_known_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    example = copy_example(args.slime, args.out / "search-r1", args.commit)
    data = write_data(args.out / "search_r1_prompts.jsonl")
    server = serve()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(example), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "slime_rl.cli", "train", *train_args(data, args.hf_checkpoint, args.out,
                                                                       args.num_rollout), *extra]
    print("running:", " ".join(cmd), flush=True)
    try:
        rc = subprocess.run(cmd, env=env).returncode
    finally:
        server.shutdown()
    if rc != 0:
        raise SystemExit(f"slime-rl train exited {rc}")
    print(json.dumps(summarize(args.out / "run")))


if __name__ == "__main__":
    main()
