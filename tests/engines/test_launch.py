"""Launch argv builders (pure) and wait_healthy's timeout path; the dead-process path is exercised in
test_weight_update.py with a real engine process."""

from __future__ import annotations

import socket
import sys
import time

import pytest

from slime_rl.config.builtin_engine import ServerConfig, parse_server_args
from slime_rl.engines.launch import (
    EngineLaunchError,
    embedded_command,
    router_command,
    sglang_command,
    wait_healthy,
)


def test_sglang_command_uses_server_args_flag_names():
    argv = sglang_command("/m", "10.0.0.2", 30001, tp_size=2, nccl_port=31000, dist_init_addr="10.0.0.2:25000",
                          base_gpu_id=4, random_seed=7, api_key="k",
                          extra={"mem_fraction_static": 0.7, "enable_memory_saver": True,
                                 "disable_radix_cache": False, "cuda_graph_bs_decode": [1, 2, 4], "log_level": None})
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    pairs = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert pairs["--model-path"] == "/m" and pairs["--host"] == "10.0.0.2" and pairs["--port"] == "30001"
    assert pairs["--tp-size"] == "2" and pairs["--base-gpu-id"] == "4" and pairs["--nccl-port"] == "31000"
    assert pairs["--dist-init-addr"] == "10.0.0.2:25000" and pairs["--random-seed"] == "7"
    assert pairs["--api-key"] == "k"
    tail = argv[argv.index("--mem-fraction-static"):]
    assert tail == ["--mem-fraction-static", "0.7", "--enable-memory-saver", "--cuda-graph-bs-decode", "1", "2", "4"]
    assert "--disable-radix-cache" not in argv and "--log-level" not in argv


def test_sglang_extra_may_not_override_owned_flags_nor_be_unknown():
    with pytest.raises(ValueError, match="--sglang-port: --port is set by slime_rl itself"):
        sglang_command("/m", "h", 1, extra={"port": 2})
    with pytest.raises(ValueError, match=r"--sglang-mem-fraction-statik: sglang .* has no flag --mem-fraction-statik"
                                         r".*did you mean --sglang-mem-fraction-static\?"):
        sglang_command("/m", "h", 1, extra={"mem_fraction_statik": 0.5})


def test_router_command_puts_the_workers_behind_it():
    argv = router_command("10.0.0.1", 30999, ["http://a:1", "http://b:2"], api_key="k",
                          extra={"policy": "round_robin", "disable_retries": True, "log_level": None})
    assert argv[:3] == [sys.executable, "-m", "sglang_router.launch_router"]
    assert argv[3:] == ["--host", "10.0.0.1", "--port", "30999", "--worker-urls", "http://a:1", "http://b:2",
                        "--api-key", "k", "--policy", "round_robin", "--disable-retries"]
    with pytest.raises(ValueError, match="--router-worker-urls: .* set by slime_rl itself .the engines of this run"):
        router_command("h", 1, ["http://a:1"], extra={"worker_urls": ["http://x:1"]})


def test_embedded_command_carries_the_whole_config_and_the_engine_reads_it_back():
    cfg = ServerConfig("/m", "127.0.0.1", 9000, random_seed=5, device="cuda", dtype="bfloat16",
                       max_running_requests=8, num_threads=2, disable_cuda_graph=True, cuda_graph_max_bs=16,
                       disable_overlap_schedule=True, enable_torch_compile=True, torch_compile_max_bs=64)
    argv = embedded_command(cfg)
    assert argv[:3] == [sys.executable, "-m", "slime_rl.engines.embedded"]
    assert argv[3] == "--config-json" and len(argv) == 5
    assert parse_server_args(argv[3:]) == cfg  # every field, through the engine's own parser
    assert parse_server_args(embedded_command(ServerConfig("/m", "h", 1))[3:]) == ServerConfig("/m", "h", 1)


def test_embedded_command_keeps_the_key_off_the_command_line():
    with pytest.raises(ValueError, match="SLIME_RL_ENGINE_API_KEY"):
        embedded_command(ServerConfig("/m", "127.0.0.1", 9000, api_key="k"))


def test_wait_healthy_times_out_with_the_url():
    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(EngineLaunchError, match=rf"127.0.0.1:{port} not healthy after 1s"):
        wait_healthy(f"http://127.0.0.1:{port}", timeout=1.0, poll_s=0.1)
    assert time.monotonic() - t0 < 10


def test_wait_healthy_returns_for_a_live_engine(server):
    wait_healthy(server.url, timeout=10)


def test_wait_healthy_reports_exit_code_and_recent_logs():
    class Dead:
        def poll(self) -> int:
            return 7

    lines = [f"line {i}" for i in range(100)] + ["OSError: no such model"]
    with pytest.raises(EngineLaunchError, match=r"exited with code 7") as info:
        wait_healthy("http://127.0.0.1:1", timeout=30, process=Dead(), recent_logs=lambda: lines, log_lines=5)
    msg = str(info.value)
    assert msg.endswith("line 96\nline 97\nline 98\nline 99\nOSError: no such model") and "line 95" not in msg
