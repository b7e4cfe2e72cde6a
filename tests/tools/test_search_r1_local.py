"""tools/search_r1_local.py's own parts (the whole run needs slime's example, which CI cannot fetch: it was run by
hand, docs/migration.md says with what): the retrieval API in the shape Search-R1's retrieval_server.py answers,
the prompts in the shape of its training rows, the example copied from a git directory unchanged."""

from __future__ import annotations

import json
import subprocess
import urllib.request

from tests.conftest import _load_tool, free_port

tool = _load_tool("search_r1_local")


def test_retrieve_ranks_by_shared_words():
    top = tool.retrieve("capital of France?", 2)
    assert top[0] == {"id": "0", "contents": '"Paris"\nParis is the capital and largest city of France.'}
    # 'capital' alone: Paris (0) and Canberra (7) share one word each beyond 'of'/'the'; corpus order breaks the tie
    assert [d["id"] for d in tool.retrieve("capital", 3)][:2] == ["0", "7"]
    assert tool.retrieve("x", 0) == []


def test_server_answers_the_retrieval_api():
    server = tool.serve(("127.0.0.1", free_port()))
    try:
        host, port = server.server_address
        body = json.dumps({"queries": ["largest planet", "who wrote hamlet"], "topk": 3, "return_scores": False})
        req = urllib.request.Request(f"http://{host}:{port}/retrieve", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        out = json.loads(urllib.request.urlopen(req, timeout=10).read())
    finally:
        server.shutdown()
    assert [len(r) for r in out["result"]] == [3, 3]
    assert out["result"][0][0]["contents"].startswith('"Jupiter"\n')
    assert out["result"][1][0]["contents"] == '"Hamlet"\nHamlet is a tragedy written by William Shakespeare.'


def test_prompts_are_search_r1_rows(tmp_path):
    rows = [json.loads(x) for x in tool.write_data(tmp_path / "p.jsonl").read_text().splitlines()]
    assert len(rows) == len(tool.QUESTIONS)
    for row, (question, answers) in zip(rows, tool.QUESTIONS, strict=True):
        (msg,) = row["prompt"]
        assert msg["role"] == "user" and msg["content"].endswith(f"Question: {question}\n")
        assert row["reward_model"] == {"style": "rule", "ground_truth": {"target": answers}}
        # each question's first answer is in the corpus, so a search can find it
        assert any(answers[0] in text for _, text in tool.CORPUS)


def test_example_copied_from_a_git_directory_unchanged(tmp_path):
    repo = tmp_path / "slime"
    ex = repo / "examples" / "search-r1"
    ex.mkdir(parents=True)
    (ex / "generate_with_search.py").write_text("X = 1\n")
    (repo / "README.md").write_text("r\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git[:3], "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    got = tool.copy_example(repo / ".git", tmp_path / "out")
    assert sorted(p.name for p in got.iterdir()) == ["generate_with_search.py"]
    assert (got / "generate_with_search.py").read_text() == "X = 1\n"
    assert tool.copy_example(repo, tmp_path / "out2").joinpath("generate_with_search.py").read_text() == "X = 1\n"
