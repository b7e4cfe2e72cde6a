"""How many rows the built-in engine decodes together (its --max-running-requests), as the launcher
builds its command: the rollout client's cap on requests in flight (--sglang-server-concurrency)
unless --sglang-max-running-requests says otherwise. A smaller engine batch than the client's cap
leaves requests queued in the engine; a larger one is never filled."""

from __future__ import annotations

from slime_rl.config import build_config
from slime_rl.config.builtin_engine import parse_server_args
from slime_rl.orchestration.engines import engine_command
from slime_rl.orchestration.placement import EngineSlot


def _running(tiny_qwen2, tmp_path, *extra: str) -> int:
    data = tmp_path / "d.jsonl"
    data.write_text('{"input": "1", "label": "1"}\n')
    cfg = build_config(["--hf-checkpoint", str(tiny_qwen2), "--prompt-data", str(data), "--rollout-batch-size", "1",
                        "--num-rollout", "1", "--rm-type", "digit", *extra])
    argv = engine_command(cfg, EngineSlot(engine_id=0, bundles=(0,), rank_offset=1), "127.0.0.1", 30000, None,
                          use_gpu=False)
    return parse_server_args(argv[3:]).max_running_requests


def test_engine_rows_follow_the_client_concurrency(tiny_qwen2, tmp_path):
    assert _running(tiny_qwen2, tmp_path) == 64  # both defaults: the CPU quickstart is unchanged
    assert _running(tiny_qwen2, tmp_path, "--sglang-server-concurrency", "512") == 512
    assert _running(tiny_qwen2, tmp_path, "--sglang-server-concurrency", "512",
                    "--sglang-max-running-requests", "128") == 128
