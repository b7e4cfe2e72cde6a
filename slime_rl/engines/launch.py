"""Launch commands for rollout engines and the sglang-router (pure functions building argv lists)
and a health wait.

`--sglang-<name>` and `--router-<name>` pass-through flags reach SGLang's server and the router as
`--<name>`, checked first against that program's own flags (`cli_args`: live when the package
imports, else the snapshot of SGLang 0.5.23 / sglang-router 0.3.2) and rendered in the shape its
argparse reads (bare switches, `--no-x`, lists). The flags we compute ourselves (model path, tp
size, addresses, ports, seed, API key) may not be passed through: the error names the flag of ours
that sets them. Nothing here starts a process: the orchestration layer runs the argv where it wants
(Ray actor, subprocess) and calls `wait_healthy`.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from slime_rl.config import EngineConfig
from slime_rl.config.builtin_engine import ServerConfig, to_argv
from slime_rl.engines.cli_args import (
    PassthroughError,
    check_passthrough,
    render,
    router_table,
    sglang_server_table,
)

# ServerArgs dests the launcher computes -> what sets them (named in the error for a pass-through)
SGLANG_OWNED = {
    "model_path": "--hf-checkpoint",
    "tp_size": "--rollout-num-gpus-per-engine",
    "host": "the engine's node address, from the placement",
    "port": "a free port on the engine's node",
    "nccl_port": "a free port on the engine's node",
    "dist_init_addr": "the engine's first node, from the placement",
    "nnodes": "--rollout-num-gpus-per-engine over the GPUs of a node",
    "node_rank": "the engine's node part, from the placement",
    "base_gpu_id": "the engine's GPUs, from the placement",
    "random_seed": "--seed and --rollout-seed, plus the engine's index",
    "api_key": "a secret drawn per run",
    "disaggregation_mode": "--prefill-num-servers / --sglang-config's worker_type",
    "disaggregation_bootstrap_port": "a free port on a prefill engine's node",
}
# RouterArgs dests the launcher computes
ROUTER_OWNED = {
    "host": "the head node's address",
    "port": "--sglang-router-port",
    "worker_urls": "the engines of this run",
    "pd_disaggregation": "--prefill-num-servers / --sglang-config",
    "prefill": "the prefill engines of --prefill-num-servers / --sglang-config",
    "decode": "the decode engines of --prefill-num-servers / --sglang-config",
    "api_key": "a secret drawn per run",
}


class EngineLaunchError(RuntimeError):
    """An engine did not become healthy: names the URL and, if it died, its exit code and last logs."""


def sglang_extra_args(extra: Mapping[str, Any] | None) -> list[str]:
    """`--sglang-*` pass-through ({ServerArgs option name: value}) as SGLang's argv; raises
    PassthroughError (a ValueError) naming the `--sglang-*` flag for names SGLang does not have,
    names we set ourselves, and values of the wrong shape."""
    table = sglang_server_table()
    return render(check_passthrough(extra or {}, table, "sglang-", SGLANG_OWNED), table)


def router_extra_args(extra: Mapping[str, Any] | None) -> list[str]:
    """`--router-*` pass-through as sglang-router's argv (checked like `sglang_extra_args`)."""
    table = router_table()
    return render(check_passthrough(extra or {}, table, "router-", ROUTER_OWNED), table)


def check_engine_config(engine: EngineConfig) -> EngineConfig:
    """Preflight of the pass-through flags: the config with `sglang_args` / `router_args` checked and
    normalized (switches as bool), or PassthroughError naming the flag, before any actor starts.
    A table is read only when there is something to check (a live read imports the package)."""
    sglang, router = dict(engine.sglang_args), dict(engine.router_args)
    for name in sglang:
        if name.startswith("router_") and name not in sglang_server_table().options:
            raise PassthroughError(f"--sglang-{name.replace('_', '-')}: not a flag of SGLang's server; the router "
                                   "is started by --use-sglang-router (port: --sglang-router-port) and takes "
                                   "--router-<name> flags; an external router is not supported")
    if sglang:
        sglang = check_passthrough(sglang, sglang_server_table(), "sglang-", SGLANG_OWNED)
    if router:
        router = check_passthrough(router, router_table(), "router-", ROUTER_OWNED)
    groups = []
    for i, group in enumerate(engine.server_groups):  # --sglang-config's overrides: SGLang fields, as --sglang-*
        overrides = group.overrides
        if overrides:
            try:
                overrides = check_passthrough(overrides, sglang_server_table(), "sglang-", SGLANG_OWNED)
            except PassthroughError as exc:
                raise PassthroughError(f"--sglang-config {engine.sglang_config}: server group {i} "
                                       f"({group.worker_type}) overrides: {exc}") from None
        groups.append(dataclasses.replace(group, overrides=overrides))
    return dataclasses.replace(engine, sglang_args=sglang, router_args=router, server_groups=tuple(groups))


# the command that runs the built-in engine's Python, as shell words: a wrapper around the interpreter
# (`numactl --cpunodebind=1 python`, `py-spy record -o engine.svg -- python`); unset: the driver's interpreter
ENGINE_PYTHON_ENV = "SLIME_RL_ENGINE_PYTHON"


def engine_python() -> list[str]:
    """$SLIME_RL_ENGINE_PYTHON split as shell words, else [sys.executable]."""
    return shlex.split(os.environ.get(ENGINE_PYTHON_ENV, "")) or [sys.executable]


def embedded_command(cfg: ServerConfig, python: str | None = None) -> list[str]:
    """argv of the built-in engine (`python -m slime_rl.engines.embedded --config-json ...`): its whole
    ServerConfig, read back by the engine's one parser (config/builtin_engine.py). `python`: the interpreter,
    else engine_python()."""
    return [*([python] if python else engine_python()), "-m", "slime_rl.engines.embedded", *to_argv(cfg)]


def sglang_command(model_path: str | Path, host: str, port: int, tp_size: int = 1, nccl_port: int | None = None,
                   dist_init_addr: str | None = None, base_gpu_id: int = 0, random_seed: int | None = None,
                   api_key: str | None = None, extra: Mapping[str, Any] | None = None,
                   python: str = sys.executable, nnodes: int = 1, node_rank: int = 0,
                   disaggregation_mode: str | None = None, bootstrap_port: int | None = None) -> list[str]:
    """argv of a real SGLang server (`python -m sglang.launch_server ...`). `nnodes` > 1: one node part of an
    engine over several nodes (`--nnodes --node-rank --dist-init-addr`, the address of node rank 0's part,
    where the TP ranks meet; only node rank 0 serves HTTP). `disaggregation_mode` prefill or decode: a
    prefill/decode engine (`--disaggregation-mode`; a prefill engine's `bootstrap_port`, where its decode
    partners fetch the KV cache)."""
    passthrough = sglang_extra_args(extra)  # first: a bad flag fails before anything else is computed
    if nnodes > 1 and dist_init_addr is None:
        raise ValueError("an engine over several nodes needs --dist-init-addr (node rank 0's host:port)")
    argv = [python, "-m", "sglang.launch_server", "--model-path", str(model_path), "--host", host,
            "--port", str(port), "--tp-size", str(tp_size), "--base-gpu-id", str(base_gpu_id)]
    if nccl_port is not None:
        argv += ["--nccl-port", str(nccl_port)]
    if nnodes > 1:
        argv += ["--nnodes", str(nnodes), "--node-rank", str(node_rank)]
    if dist_init_addr is not None:
        argv += ["--dist-init-addr", dist_init_addr]
    if random_seed is not None:
        argv += ["--random-seed", str(random_seed)]
    if api_key:
        argv += ["--api-key", api_key]
    if disaggregation_mode is not None:
        argv += ["--disaggregation-mode", disaggregation_mode]
    if bootstrap_port is not None:
        argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    return argv + passthrough


def router_command(host: str, port: int, worker_urls: Sequence[str], api_key: str | None = None,
                   extra: Mapping[str, Any] | None = None, python: str = sys.executable,
                   prefill: Sequence[tuple[str, int]] = (), decode: Sequence[str] = ()) -> list[str]:
    """argv of sglang-router (`python -m sglang_router.launch_router ...`) in front of `worker_urls`, or with
    `prefill` ((URL, bootstrap port) of each prefill engine) and `decode` (URLs) in its PD mode
    (`--pd-disaggregation --prefill URL PORT ... --decode URL ...`), which pairs a prefill and a decode engine
    for each request. `api_key` is what the router sends to the workers on its own calls (health, flush);
    clients' Authorization headers are forwarded with their requests."""
    passthrough = router_extra_args(extra)
    argv = [python, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port)]
    if prefill or decode:
        if not (prefill and decode):
            raise ValueError("the router's PD mode needs prefill and decode engines")
        argv += ["--pd-disaggregation"]
        for url, bootstrap in prefill:
            argv += ["--prefill", url, str(bootstrap)]
        for url in decode:
            argv += ["--decode", url]
    else:
        argv += ["--worker-urls", *worker_urls]
    if api_key:
        argv += ["--api-key", api_key]
    return argv + passthrough


def _tail(path: str | Path | None, lines: int, recent_logs: Callable[[], Iterable[str]] | None = None) -> str:
    if recent_logs is not None:
        return "\n".join(list(recent_logs())[-lines:])
    if path is None:
        return ""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as e:
        return f"(could not read {path}: {e})"
    return "\n".join(text.splitlines()[-lines:])


def wait_healthy(url: str, timeout: float, process: Any = None, log_path: str | Path | None = None,
                 poll_s: float = 0.25, log_lines: int = 30,
                 recent_logs: Callable[[], Iterable[str]] | None = None) -> None:
    """Poll `GET {url}/health` until 200. Raises EngineLaunchError when `timeout` seconds pass or when
    `process` (anything with `.poll()`, e.g. subprocess.Popen) exits first; the error carries the exit
    code and the last `log_lines` lines of the engine's log: from `recent_logs()` (for a caller that
    pumps the process's stdout itself) or else from the file `log_path`. /health needs no API key
    (SGLang's auth.py)."""
    deadline = time.monotonic() + timeout
    last_error = "no answer yet"
    with httpx.Client(timeout=httpx.Timeout(5.0)) as client:
        while True:
            code = process.poll() if process is not None else None
            if code is not None:
                tail = _tail(log_path, log_lines, recent_logs)
                raise EngineLaunchError(f"engine at {url} exited with code {code} before it was healthy"
                                        + (f"; last log lines:\n{tail}" if tail else ""))
            try:
                r = client.get(url.rstrip("/") + "/health")
                if r.status_code == 200:
                    return
                last_error = f"/health answered {r.status_code}"
            except httpx.HTTPError as e:
                last_error = f"{type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                tail = _tail(log_path, log_lines, recent_logs)
                raise EngineLaunchError(f"engine at {url} not healthy after {timeout:.0f}s ({last_error})"
                                        + (f"; last log lines:\n{tail}" if tail else ""))
            time.sleep(poll_s)
