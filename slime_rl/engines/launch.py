"""Launch commands for rollout engines (pure functions building argv lists) and a health wait.

Both engine kinds take the flag names of SGLang's ServerArgs (sglang/srt/arg_groups/fields/*.py,
SGLang 0.5.23: a field `foo_bar` is the flag `--foo-bar`; booleans are bare `store_true` flags), so
the `--sglang-*` pass-through of the config (keyed by ServerArgs field name) maps one to one.
Nothing here starts a process: the orchestration layer runs the argv where it wants (Ray actor,
subprocess) and calls `wait_healthy`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import httpx

# Flags the explicit arguments of `sglang_command` own; `extra` may not set them a second time.
_OWNED = frozenset({"model_path", "host", "port", "tp_size", "nccl_port", "dist_init_addr", "base_gpu_id",
                    "random_seed", "api_key"})


class EngineLaunchError(RuntimeError):
    """An engine did not become healthy: names the URL and, if it died, its exit code and last logs."""


def flag(name: str) -> str:
    """ServerArgs field name -> CLI flag (`mem_fraction_static` -> `--mem-fraction-static`)."""
    return "--" + name.replace("_", "-")


def extra_args(extra: Mapping[str, Any] | None) -> list[str]:
    """Pass-through ServerArgs fields as argv: True -> bare flag, False/None -> omitted,
    list/tuple -> flag followed by each item (nargs), anything else -> flag and str(value)."""
    argv: list[str] = []
    for name, value in (extra or {}).items():
        if not name or "-" in name:
            raise ValueError(f"--sglang-{name}: pass-through keys are ServerArgs field names (underscores)")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag(name))
        elif isinstance(value, list | tuple):
            argv += [flag(name), *(str(v) for v in value)]
        else:
            argv += [flag(name), str(value)]
    return argv


def embedded_command(model_path: str | Path, host: str, port: int, api_key: str | None = None,
                     seed: int = 0, device: str = "cpu", dtype: str = "float32",
                     max_running_requests: int | None = None, num_threads: int | None = None,
                     weight_version: str | None = None, python: str = sys.executable) -> list[str]:
    """argv of the built-in engine (`python -m slime_rl.engines.embedded ...`)."""
    argv = [python, "-m", "slime_rl.engines.embedded", "--model-path", str(model_path), "--host", host,
            "--port", str(port), "--random-seed", str(seed), "--device", device, "--dtype", dtype]
    if api_key:
        argv += ["--api-key", api_key]
    if max_running_requests is not None:
        argv += ["--max-running-requests", str(max_running_requests)]
    if num_threads is not None:
        argv += ["--num-threads", str(num_threads)]
    if weight_version is not None:
        argv += ["--weight-version", weight_version]
    return argv


def sglang_command(model_path: str | Path, host: str, port: int, tp_size: int = 1, nccl_port: int | None = None,
                   dist_init_addr: str | None = None, base_gpu_id: int = 0, random_seed: int | None = None,
                   api_key: str | None = None, extra: Mapping[str, Any] | None = None,
                   python: str = sys.executable) -> list[str]:
    """argv of a real SGLang server (`python -m sglang.launch_server ...`)."""
    clash = sorted(_OWNED & set(extra or {}))
    if clash:
        raise ValueError(f"--sglang-{clash[0]}: set by the launcher itself; use the dedicated flag")
    argv = [python, "-m", "sglang.launch_server", "--model-path", str(model_path), "--host", host,
            "--port", str(port), "--tp-size", str(tp_size), "--base-gpu-id", str(base_gpu_id)]
    if nccl_port is not None:
        argv += ["--nccl-port", str(nccl_port)]
    if dist_init_addr is not None:
        argv += ["--dist-init-addr", dist_init_addr]
    if random_seed is not None:
        argv += ["--random-seed", str(random_seed)]
    if api_key:
        argv += ["--api-key", api_key]
    return argv + extra_args(extra)


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
