"""SGLang 0.5.23's own `TokenizerManager.abort_request` against the rids this project sends.

The tokenizer manager (one tokenizer worker) forwards an `AbortReq` to the scheduler only for a rid
it holds in `rid_to_state` (or with abort_all); any other rid, a group prefix included, is dropped
without an answer. The method is driven on an object built with `object.__new__` holding the few
attributes it reads; the scheduler socket send is recorded instead of sent."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from slime_rl.data import Sample
from slime_rl.rollout.routing import ClientPool, group_prefix, request_id

tm_mod = pytest.importorskip("sglang.srt.managers.tokenizer_manager",
                             reason="sglang 0.5.23 is not importable here (pip install --no-deps sglang)")


@pytest.fixture()
def manager(monkeypatch):
    """(tokenizer manager, list of what reached the scheduler socket)."""
    sent: list = []
    monkeypatch.setattr(tm_mod, "sock_send", lambda _sock, obj: sent.append(obj))
    monkeypatch.setattr(tm_mod, "get_serving", lambda: SimpleNamespace(tokenizer_worker_num=1))
    tm = object.__new__(tm_mod.TokenizerManager)
    tm.rid_to_state, tm.tokenizer_ipc_name, tm.send_to_scheduler, tm.enable_metrics = {}, None, None, False
    return tm, sent


def test_a_group_prefix_is_dropped_and_an_exact_rid_reaches_the_scheduler(manager):
    tm, sent = manager
    rid = request_id("ab12", 3, 0, 0)
    tm.rid_to_state[rid] = SimpleNamespace(abort_sent=False)
    tm.abort_request(rid=group_prefix("ab12", 3))  # what the project sent before: a prefix of rid
    assert sent == []
    tm.abort_request(rid=rid)
    assert [(type(r).__name__, r.rid, r.abort_all) for r in sent] == [("AbortReq", rid, False)]
    tm.abort_request(rid=rid)  # the same rid again: already sent, dropped
    assert len(sent) == 1
    tm.abort_request(abort_all=True)
    assert sent[-1].abort_all is True and len(sent) == 2


class ManagedClient:
    """An engine whose /generate registers the rid with SGLang's tokenizer manager and waits, and
    whose /abort_request is SGLang's abort_request."""

    def __init__(self, tm) -> None:
        self.tm, self.release = tm, asyncio.Event()

    async def generate(self, *, rid: str, **_kw) -> dict:
        self.tm.rid_to_state[rid] = SimpleNamespace(abort_sent=False)
        await self.release.wait()
        del self.tm.rid_to_state[rid]
        return {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}, "output_token_logprobs": []}}

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.tm.abort_request(rid=rid, abort_all=abort_all)


def test_pool_group_abort_reaches_the_scheduler_for_every_live_request(manager):
    tm, sent = manager

    async def go():
        client = ManagedClient(tm)
        pool = ClientPool([client], tokenizer=None, per_engine=8)
        samples = [Sample(index=i, group_index=g, prompt="", prompt_ids=[1]) for i, g in enumerate((5, 5, 5, 50))]
        tasks = [asyncio.create_task(pool.generate(s, [1], {})) for s in samples]
        while len(tm.rid_to_state) < 4:
            await asyncio.sleep(0)
        group5 = sorted(r for r in tm.rid_to_state if "-g0000000005-" in r)
        await pool.abort_groups([5])
        client.release.set()
        await asyncio.gather(*tasks)
        return group5

    group5 = asyncio.run(go())
    assert len(group5) == 3
    assert sorted(r.rid for r in sent) == group5  # each live request of group 5, none of group 50
