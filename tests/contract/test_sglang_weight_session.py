"""SGLang 0.5.23's own SchedulerWeightUpdaterManager (srt/managers/scheduler_components/weight_updater.py)
driven by this project's weight updaters, on CPU.

The manager is built with minimal fakes for what it reaches beyond its own state (the TP worker and its
runners, the memory saver, the scheduler's flush and version record; `get_parallel` and the TP barrier).
`SGLangOverHTTP` is an engine client whose calls, instead of going over HTTP, build SGLang's request
struct from the project's payload (`Struct(**payload)`: a field SGLang lacks raises TypeError) and
answer what http_server.py answers: {"success", "message"} with 400 on success=false, an empty 200
for the memory endpoints, 404 for a route the server lacks. So a whole WeightBroadcaster /
ColocatedUpdater sync runs against SGLang's session logic, and the built-in engine's session gate
(engines/embedded/session.py) is held to the same answers for the same call sequence.
"""

from __future__ import annotations

from socket import socket
from types import SimpleNamespace

import pytest
import torch

from slime_rl.config import WeightSyncConfig
from slime_rl.engines.client import EngineClient, EngineError
from slime_rl.engines.embedded.sampling import RequestError
from slime_rl.engines.embedded.session import WeightUpdateSession
from slime_rl.weight_sync.broadcast import EngineTarget, WeightBroadcaster
from slime_rl.weight_sync.colocated import MEMORY_TAGS, RESUME_AFTER_SYNC, RESUME_BEFORE_SYNC, ColocatedUpdater

wu = pytest.importorskip("sglang.srt.managers.scheduler_components.weight_updater",
                         reason="sglang 0.5.23 is not importable here (pip install --no-deps sglang)")
io = pytest.importorskip("sglang.srt.managers.io_struct")

STRUCTS = {"/begin_weight_update": ("BeginWeightUpdateReqInput", "begin_weight_update"),
           "/end_weight_update": ("EndWeightUpdateReqInput", "end_weight_update"),
           "/init_weights_update_group": ("InitWeightsUpdateGroupReqInput", "init_weights_update_group"),
           "/destroy_weights_update_group": ("DestroyWeightsUpdateGroupReqInput", "destroy_weights_update_group"),
           "/update_weights_from_distributed": ("UpdateWeightsFromDistributedReqInput",
                                                "update_weights_from_distributed"),
           "/update_weights_from_tensor": ("UpdateWeightsFromTensorReqInput", "update_weights_from_tensor"),
           "/release_memory_occupation": ("ReleaseMemoryOccupationReqInput", "release_memory_occupation"),
           "/resume_memory_occupation": ("ResumeMemoryOccupationReqInput", "resume_memory_occupation")}


class FakeRunnerUpdater:
    def __init__(self, log: list) -> None:
        self.log = log

    def begin_weight_update(self) -> None:
        self.log.append("runner.begin")

    def end_weight_update(self, run_post_load: bool) -> None:
        self.log.append(("runner.end", run_post_load))

    def load_weights_from_distributed(self, weights) -> tuple[bool, str]:
        self.log.append("runner.load")
        return True, "Succeeded to update parameter online."

    def update_weights_from_tensor(self, named_tensors, load_format) -> tuple[bool, str]:
        self.log.append("runner.load")
        return True, "Success"


@pytest.fixture()
def manager(monkeypatch):
    """(SGLang's manager, the log of what it did to the fakes)."""
    log: list = []
    monkeypatch.setattr(wu, "get_parallel", lambda: SimpleNamespace(tp_group=SimpleNamespace(cpu_group=None)))
    monkeypatch.setattr(wu.torch.distributed, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(wu.torch, "get_device_module", lambda *a: torch.cpu)  # its synchronize after a release
    updater = FakeRunnerUpdater(log)
    receiver = SimpleNamespace(receive_weights_from_distributed=lambda **kw: log.append(("receive", kw)) or [])
    tp_worker = SimpleNamespace(
        weight_update_runners=lambda: [("target", SimpleNamespace(weight_updater=updater))],
        model_runner=SimpleNamespace(weight_updater=receiver, model=torch.nn.Linear(2, 2)),
        deserialize_own_rank=lambda entries: [],
        init_weights_update_group=lambda req: (True, "Succeeded to initialize custom process group."),
        destroy_weights_update_group=lambda req: (True, "Succeeded to destroy custom process group."))
    saver = SimpleNamespace(pause=lambda tag: log.append(("pause", tag)),
                            resume=lambda tag: log.append(("resume", tag)))
    scheduler = SimpleNamespace(record_weight_version_change=lambda new_version: None, _engine_paused=True,
                                disaggregation_mode=None)

    def flush_cache(empty_cache: bool = False) -> bool:
        log.append("flush")
        return True

    m = wu.SchedulerWeightUpdaterManager(tp_worker=tp_worker, draft_worker=None, memory_saver_adapter=saver,
                                         flush_cache=flush_cache, is_fully_idle=lambda **kw: True, scheduler=scheduler)
    monkeypatch.setattr(wu, "get_model", lambda: SimpleNamespace(weight_cache_mode="off"))
    return m, log


class SGLangOverHTTP(EngineClient):
    """An EngineClient answered by SGLang's manager as its HTTP server would (see the module doc)."""

    def __init__(self, m, has_sessions: bool = True) -> None:
        super().__init__("http://sglang.invalid")
        self.m, self.has_sessions, self.calls = m, has_sessions, []

    def _call(self, method: str, path: str, payload: dict | None = None):
        self.calls.append(path)
        if path not in STRUCTS or (not self.has_sessions and "weight_update" in path and "group" not in path):
            raise EngineError(self.base_url, path, 404, "Not Found")
        struct, method_name = STRUCTS[path]
        out = getattr(self.m, method_name)(getattr(io, struct)(**(payload or {})))
        if path.endswith("_memory_occupation"):
            return None
        if not out.success:
            raise EngineError(self.base_url, path, 400, out.message)
        return {"success": True, "message": out.message}


def test_an_update_outside_a_session_is_refused_by_sglang(manager):
    m, _ = manager
    out = m.update_weights_from_distributed(io.UpdateWeightsFromDistributedReqInput(
        names=["model.norm.weight"], dtypes=["float32"], shapes=[[4]]))
    assert (out.success, out.message) == (False, "update_weights_from_distributed must run between "
                                                 "begin_weight_update() and end_weight_update()")


def test_a_pipelined_broadcast_sync_is_accepted_and_flushes_once(manager):
    """WeightBroadcaster.sync (a one-rank gloo group: the bytes go nowhere) over 3 buckets: SGLang
    accepts begin, every bucket, end; the cache is flushed for the last bucket only."""
    m, log = manager
    client = SGLangOverHTTP(m)
    with socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    b = WeightBroadcaster([EngineTarget("http://sglang.invalid", 1)], WeightSyncConfig(16), True, "127.0.0.1", free,
                          1, "gloo", group_name="contract")
    b._clients = [client]
    b.connect()
    try:
        weights = [(f"w{i}", torch.full((4,), float(i))) for i in range(3)]  # 16 bytes each: 3 buckets
        assert b.sync(iter(weights), version="v1")["weight_sync/buckets"] == 3
    finally:
        b.destroy()
    assert client.calls == ["/init_weights_update_group", "/begin_weight_update"] + \
        ["/update_weights_from_distributed"] * 3 + ["/end_weight_update", "/destroy_weights_update_group"]
    assert log.count("flush") == 1 and log.index("flush") > max(i for i, e in enumerate(log) if e == "runner.load")
    assert log[-1] == ("runner.end", False)  # weights were loaded: no post-load pass at end
    assert m._session is None


def test_the_colocated_order_release_resume_weights_sync_resume_rest(manager):
    m, log = manager
    client = SGLangOverHTTP(m)
    up = ColocatedUpdater([EngineTarget("http://sglang.invalid", 0)], [0], WeightSyncConfig(16))
    up._clients = [client]
    client.release_memory_occupation(MEMORY_TAGS)
    client.resume_memory_occupation(RESUME_BEFORE_SYNC)
    up.sync(iter([(f"w{i}", torch.full((4,), float(i))) for i in range(2)]), version="v1")
    client.resume_memory_occupation(RESUME_AFTER_SYNC)
    up.close()
    assert m.offload_tags == set()
    assert [e for e in log if isinstance(e, tuple) and e[0] == "pause"] == [
        ("pause", "kv_cache"), ("pause", "weights"), ("pause", "cuda_graph")]
    resumed = [e[1] for e in log if isinstance(e, tuple) and e[0] == "resume"]
    assert resumed == ["weights", "cuda_graph", "kv_cache"]  # weights first, KV and graphs after the sync
    assert log.index(("resume", "weights")) < log.index("runner.begin") < log.index(("resume", "kv_cache"))
    with pytest.raises(KeyError):  # resuming what is not released: what the built-in engine answers 400 for
        m.resume_memory_occupation(io.ResumeMemoryOccupationReqInput(tags=["kv_cache"]))


def test_an_older_server_without_sessions_is_detected_once_by_its_404(manager):
    m, _ = manager
    old = SGLangOverHTTP(m, has_sessions=False)
    assert old.open_weight_update_session() is False
    assert old.open_weight_update_session() is False
    old.close_weight_update_session()
    assert old.calls == ["/begin_weight_update"]  # asked once, then remembered


SEQUENCE = ["/update_weights_from_distributed", "/end_weight_update", "/begin_weight_update",
            "/begin_weight_update", "/update_weights_from_distributed", "/update_weights_from_tensor",
            "/end_weight_update", "/end_weight_update", "/update_weights_from_tensor"]


def test_the_built_in_engine_gate_answers_as_sglang(manager):
    """The same call sequence, in and out of order: SGLang's manager and the built-in engine's session
    gate accept and refuse the same calls with the same messages."""
    m, _ = manager
    ours = WeightUpdateSession()
    upd = {"/update_weights_from_distributed": lambda: io.UpdateWeightsFromDistributedReqInput(
               names=["w"], dtypes=["float32"], shapes=[[1]]),
           "/update_weights_from_tensor": lambda: io.UpdateWeightsFromTensorReqInput(serialized_named_tensors=[])}
    for path in SEQUENCE:
        if path in upd:
            out = getattr(m, path.lstrip("/"))(upd[path]())
            refused = ours.refusal(path)
            mine = (refused is None, refused or out.message)
        else:
            out = getattr(m, path.lstrip("/"))(getattr(io, STRUCTS[path][0])())
            mine = (ours.begin if "begin" in path else ours.end)({})
        assert (out.success, out.message) == mine, path
    with pytest.raises(ValueError):  # SGLang's selector parse; ours answers 400 naming the field
        wu._parse_runner_selector("both")
    with pytest.raises(RequestError, match="selector"):
        ours.begin({"selector": "both"})


def _builders() -> dict:
    from slime_rl.engines import payloads
    return {
        "InitWeightsUpdateGroupReqInput": payloads.init_weights_update_group_payload(
            "10.0.0.1", 29500, 1, 3, "g", "gloo"),
        "UpdateWeightsFromDistributedReqInput": payloads.update_weights_from_distributed_payload(
            ["model.norm.weight"], [torch.bfloat16], [[64]], "g", flush_cache=False, weight_version="7",
            abort_all_requests=True, load_format="flattened_bucket"),
        "UpdateWeightsFromTensorReqInput": payloads.update_weights_from_tensor_payload(
            ["AAAA"], "direct", False, True, "3"),
        "DestroyWeightsUpdateGroupReqInput": payloads.destroy_weights_update_group_payload("g"),
        "UpdateWeightFromDiskReqInput": payloads.update_weights_from_disk_payload(
            "/shared/run/v00000002", "2", flush_cache=False, abort_all_requests=True, load_format="safetensors"),
        "BeginWeightUpdateReqInput": payloads.begin_weight_update_payload("target"),
        "EndWeightUpdateReqInput": payloads.end_weight_update_payload(),
        "ReleaseMemoryOccupationReqInput": payloads.memory_occupation_payload(MEMORY_TAGS),
        "ResumeMemoryOccupationReqInput": payloads.memory_occupation_payload(RESUME_AFTER_SYNC),
    }


@pytest.mark.parametrize("struct", sorted(_builders()))
def test_sglang_builds_its_request_struct_from_our_payload(struct):
    """msgspec Structs are keyword-only: a field name SGLang does not have raises TypeError here."""
    payload = _builders()[struct]
    req = getattr(io, struct)(**payload)
    assert {k: getattr(req, k) for k in payload} == payload


@pytest.fixture()
def sglang_reductions():
    """SGLang's deserialize_own_rank patches torch's reducers process-wide (monkey_patch_torch_reductions:
    CUDA devices by UUID); its patch of reduce_tensor fails on CPU tensors, which later tests of this
    process serialize. The reducers are put back afterwards."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    saved = (reductions.reduce_tensor, reductions.rebuild_cuda_tensor, dict(ForkingPickler._extra_reducers))
    yield
    reductions.reduce_tensor, reductions.rebuild_cuda_tensor = saved[:2]
    ForkingPickler._extra_reducers.clear()
    ForkingPickler._extra_reducers.update(saved[2])
    for name in ("_reduce_tensor_original", "_rebuild_cuda_tensor_original"):
        if hasattr(reductions, name):
            delattr(reductions, name)


def test_an_engine_of_two_devices_gets_one_request_whose_entry_i_sglang_tp_rank_i_reads(monkeypatch,
                                                                                         sglang_reductions):
    """Two trainer ranks beside an engine of two devices (tests/contract/colocated_rank.py: the real
    ColocatedUpdater and EngineShare over gloo, rank r's tensors r + 1 times the base ones): rank 0 posts
    ONE /update_weights_from_tensor with two entries; SGLang builds its struct from it, and its TP worker's
    own deserialize_own_rank, run as TP rank i, decodes the tensors of trainer rank i. The built-in engine's
    decoder reads entry 0 as SGLang's TP rank 0 does."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from sglang.srt.managers import tp_worker
    from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads

    from slime_rl.engines.tensor_ipc import deserialize_named_tensors
    from tests.contract.colocated_rank import named

    root = Path(__file__).resolve().parents[2]
    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    ranks = [subprocess.Popen([sys.executable, "-m", "tests.contract.colocated_rank", str(r), str(port)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=root, env=env)
             for r in (0, 1)]
    try:
        request = json.loads(ranks[0].stdout.readline())
        assert request["path"] == "/update_weights_from_tensor"
        req = io.UpdateWeightsFromTensorReqInput(**request["payload"])
        entries = normalize_serialized_named_tensor_payloads(req.serialized_named_tensors)
        assert len(entries) == 2 and req.weight_version == "v1" and req.flush_cache is True  # its only bucket
        for tp_rank in (0, 1):
            monkeypatch.setattr(tp_worker, "get_parallel", lambda r=tp_rank: SimpleNamespace(tp_rank=r))
            got = tp_worker.BaseTpWorker.deserialize_own_rank(None, entries)
            expected = named(tp_rank)
            assert [n for n, _ in got] == [n for n, _ in expected]
            assert all(torch.equal(g, e) for (_, g), (_, e) in zip(got, expected, strict=True)), tp_rank
        ours = deserialize_named_tensors(request["payload"]["serialized_named_tensors"][0])
        assert all(torch.equal(g, e) for (_, g), (_, e) in zip(ours, named(0), strict=True))
        del got, ours  # the mapped storages, before the ranks free them
        ranks[0].stdin.write("\n")
        ranks[0].stdin.flush()
        for p in ranks:
            assert p.wait(timeout=60) == 0
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
