"""Request rate of the built-in engine's HTTP layer: `/health` and a `/generate` of one new token on the
tiny model, from C keep-alive clients for T seconds each, the engine in its own process (as deployed).

    python bench/http_rate.py [--clients 8] [--seconds 5] [--engine-threads 1]

Prints one JSON line: requests per second for each path, and the clients' median/p99 latency. The
engine's own CPU use competes with the clients' on a small machine: compare runs made side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "bench"))

from common import free_port  # noqa: E402
from make_tiny_model import make_tiny_model  # noqa: E402


def _load(url: str, path: str, body: dict | None, clients: int, seconds: float, engine=None) -> dict:
    lat: list[float] = []
    cpu0 = sum(engine.cpu_times()[:2]) if engine else 0.0
    errors = [0]
    stop = time.perf_counter() + seconds

    def client() -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                r = c.post(path, json=body) if body is not None else c.get(path)
                lat.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    errors[0] += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    cpu = sum(engine.cpu_times()[:2]) - cpu0 if engine else 0.0
    lat.sort()
    # the engine's CPU time per request: what the rate would be with a core to itself (the rate depends
    # on how much of a shared machine the engine's threads get)
    return {"requests": len(lat), "req_per_s": round(len(lat) / took, 1), "errors": errors[0],
            "engine_cpu_ms_per_request": round(1e3 * cpu / max(len(lat), 1), 3),
            "median_ms": round(1e3 * statistics.median(lat), 2),
            "p99_ms": round(1e3 * lat[int(0.99 * (len(lat) - 1))], 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--engine-threads", type=int, default=1, help="torch threads of the engine process")
    p.add_argument("--engine-repo", default=str(ROOT),
                   help="the checkout whose engine is measured (another one's, for a before/after)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny", arch="qwen2", seed=0)
        port = free_port()
        env = dict(os.environ, PYTHONPATH=args.engine_repo)
        proc = subprocess.Popen([sys.executable, "-m", "slime_rl.engines.embedded", "--model-path", str(model),
                                 "--port", str(port), "--num-threads", str(args.engine_threads),
                                 "--log-level", "warning"], env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("the engine did not start")
                time.sleep(0.2)
            engine = psutil.Process(proc.pid)
            gen = {"input_ids": [5, 12, 19, 26], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
            _load(url, "/generate", gen, args.clients, 1.0)  # warm-up
            out = {"engine_repo": args.engine_repo, "clients": args.clients, "seconds": args.seconds,
                   "health": _load(url, "/health", None, args.clients, args.seconds, engine),
                   "generate_1_token": _load(url, "/generate", gen, args.clients, args.seconds, engine)}
            print(json.dumps(out))
        finally:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
