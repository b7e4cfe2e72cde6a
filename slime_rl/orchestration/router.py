"""sglang-router on the head node, in front of the run's engines (`--use-sglang-router`).

The router process runs under a Ray actor pinned to the driver's node (the head node), so it lives
and dies with the run like the engines do; its log lines are prefixed "[router]". It is started
after every engine is healthy and given their URLs (`--worker-urls`), then waited on until /health
answers and its /workers lists every engine as healthy. The RolloutManager sends /generate to it;
abort, pause/continue and weight updates still go to every engine directly (the router has no
route for them).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

import httpx
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from slime_rl.config import Config
from slime_rl.engines.launch import EngineLaunchError, router_command, wait_healthy
from slime_rl.orchestration.engines import free_port, terminate


def router_launch_command(cfg: Config, host: str, port: int, worker_urls: Sequence[str],
                          api_key: str | None, prometheus_port: int | None = None,
                          bootstrap_ports: Mapping[int, int] | None = None) -> list[str]:
    """The router's argv: what the actor runs and what --dry-run prints. `prometheus_port`: used when
    `--router-prometheus-port` is not given (the router's default, 29000, collides between runs). With
    prefill/decode engines (config/server_groups.py) the router runs in its PD mode: engine i's URL is
    `worker_urls[i]`, a prefill engine's bootstrap port `bootstrap_ports[i]`."""
    extra = dict(cfg.engine.router_args)
    if prometheus_port is not None:
        extra.setdefault("prometheus_port", prometheus_port)
    if not cfg.engine.disaggregated:
        return router_command(host, port, worker_urls, api_key=api_key, extra=extra)
    roles = [cfg.engine.role(i)[0] for i in range(len(worker_urls))]
    prefill = [(url, (bootstrap_ports or {})[i]) for i, (url, r) in enumerate(zip(worker_urls, roles, strict=True))
               if r == "prefill"]
    decode = [url for url, r in zip(worker_urls, roles, strict=True) if r == "decode"]
    return router_command(host, port, worker_urls, api_key=api_key, extra=extra, prefill=prefill, decode=decode)


def wait_workers(url: str, worker_urls: Sequence[str], timeout: float, api_key: str | None = None,
                 poll_s: float = 0.25) -> None:
    """Poll the router's GET /workers until every URL of `worker_urls` is listed healthy. A router
    without that route (404) is taken as ready once /health answered. With `--api-key` the router
    asks its own callers for that key too."""
    want = {u.rstrip("/") for u in worker_urls}
    deadline = time.monotonic() + timeout
    seen: set[str] = set()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=httpx.Timeout(5.0), headers=headers) as client:
        while time.monotonic() < deadline:
            r = client.get(url.rstrip("/") + "/workers")
            if r.status_code == 404:
                return
            if r.status_code == 200:
                seen = {w["url"].rstrip("/") for w in r.json().get("workers", []) if w.get("is_healthy", True)}
                if want <= seen:
                    return
            time.sleep(poll_s)
    raise EngineLaunchError(f"router at {url}: engines {sorted(want - seen)} not healthy behind it "
                            f"after {timeout:.0f}s")


@ray.remote(num_cpus=0)
class RouterActor:
    """Owns the sglang-router process for the life of the run."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self._lines: list[str] = []

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def pick_ports(self) -> tuple[int, int]:
        """(router port, prometheus port), both free on this node now."""
        return free_port("0.0.0.0"), free_port("0.0.0.0")

    def start(self, cmd: list[str], url: str, worker_urls: list[str], api_key: str | None,
              timeout: float = 120.0) -> str:
        self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._pump, daemon=True).start()
        wait_healthy(url, timeout=timeout, process=self.process, recent_logs=lambda: self._lines)
        wait_workers(url, worker_urls, timeout=timeout, api_key=api_key)
        return url

    def _pump(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            self._lines = (self._lines + [line.rstrip("\n")])[-50:]
            sys.stdout.write(f"[router] {line}")
            sys.stdout.flush()

    def stop(self) -> int | None:
        """Terminate the router (SIGTERM: it shuts down gracefully); returns its exit code."""
        return None if self.process is None else terminate(self.process)


def start_router(cfg: Config, engine_urls: Sequence[str], api_key: str | None, timeout: float = 120.0,
                 bootstrap_ports: Mapping[int, int] | None = None) -> tuple[ray.actor.ActorHandle, str]:
    """Start the router on this (the head) node in front of `engine_urls` (in its PD mode for prefill/decode
    engines, with the prefill engines' `bootstrap_ports`); returns (actor, URL) once it routes to every engine."""
    here = ray.get_runtime_context().get_node_id()
    actor = RouterActor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote()
    host, (port, prom) = ray.get([actor.node_ip.remote(), actor.pick_ports.remote()])
    port = cfg.engine.router_port or port
    url = f"http://{host}:{port}"
    cmd = router_launch_command(cfg, host, port, engine_urls, api_key, prometheus_port=prom,
                                bootstrap_ports=bootstrap_ports)
    try:
        ray.get(actor.start.remote(cmd, url, list(engine_urls), api_key, timeout))
    except BaseException:
        ray.get(actor.stop.remote())
        raise
    return actor, url
