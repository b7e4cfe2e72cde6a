"""One of the two trainer ranks beside an engine of two devices (--colocate, --rollout-num-gpus-per-engine
2), for tests/contract/test_sglang_weight_session.py: `python -m tests.contract.colocated_rank RANK PORT`
joins a two-rank gloo world and runs the real ColocatedUpdater with its EngineShare. Rank r hands over
tensors whose values are r + 1 times the base ones (in a real sync every rank holds the same ones;
here they differ so that the test can tell whose handle each entry is). Rank 0 posts the request: its
engine client prints the request as JSON and answers only once a line arrives on stdin, so both ranks'
buffers stay alive (the sync's last barrier waits for that answer) while the test decodes them.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from slime_rl.config import WeightSyncConfig
from slime_rl.engines.client import EngineClient
from slime_rl.weight_sync.broadcast import EngineTarget
from slime_rl.weight_sync.colocated import ColocatedUpdater, EngineShare


def named(rank: int) -> list[tuple[str, torch.Tensor]]:
    return [("model.norm.weight", torch.arange(4, dtype=torch.float32) * (rank + 1)),
            ("lm_head.weight", torch.arange(6, dtype=torch.float32).view(2, 3) * (rank + 1))]


class PrintingClient(EngineClient):
    def _call(self, method: str, path: str, payload: dict | None = None) -> dict:
        print(json.dumps({"path": path, "payload": payload}), flush=True)
        sys.stdin.readline()
        return {"success": True, "message": "Success"}


def main() -> None:
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    share = EngineShare.create(rank, [[0, 1]])
    updater = ColocatedUpdater([EngineTarget("http://sglang.invalid", 0)], [0], WeightSyncConfig(1 << 20), share)
    updater._clients = [PrintingClient("http://sglang.invalid")]
    metrics = updater.sync(iter(named(rank)), version="v1", own_session=False)
    assert bool(metrics) == (rank == 0), metrics  # the rank that posts reports the sync
    updater.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
