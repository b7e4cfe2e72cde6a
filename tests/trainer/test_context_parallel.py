"""Context parallel pieces that need no process group: the chunk layout (checked against
megatron-core's own RoPE slicing), the per-rank micro-batch split, and the errors for layouts that
cannot be built. The multi-rank equivalence (CP=2, TP=2 x CP=2 vs one rank) is in
test_trainer_parallel.py."""

from __future__ import annotations

import pytest
import torch

from slime_rl.trainer.batching import build_micro_batch
from slime_rl.trainer.context_parallel import local_positions, split_micro_batch
from slime_rl.trainer.packing import build_packed_micro_batch
from tests.trainer.trainer_ref import make_batch


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_layout_matches_megatron_rope_slicing(cp):
    """Rank r's positions are what megatron's THD RoPE gives rank r for one sequence (the freqs
    of position p are p here), and the ranks together hold every position once."""
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    length = 2 * cp * 3
    freqs = torch.arange(length)
    held = []
    for r in range(cp):
        mine = local_positions(length, cp, r)
        want = _get_thd_freqs_on_this_cp_rank(r, cp, torch.zeros(length // cp), freqs)
        assert torch.equal(mine, want), (r, mine, want)
        c = length // (2 * cp)  # chunks r and 2cp-1-r, in that order
        assert mine.tolist() == [*range(r * c, (r + 1) * c), *range((2 * cp - 1 - r) * c, (2 * cp - r) * c)]
        held += mine.tolist()
    assert sorted(held) == list(range(length))


def _gather_back(mbs, global_tokens):
    """Per response token: the token id at its predicting position, read from whichever rank owns it."""
    got = torch.zeros(mbs[0].logit_index.shape, dtype=torch.long)
    owners = torch.zeros(mbs[0].logit_index.shape)
    for mb in mbs:
        row = mb.tokens if mb.packed_seq_params is None else mb.tokens[0].expand(mb.logit_index.shape[0], -1)
        got += torch.gather(row, 1, mb.logit_index) * mb.cp_own.long()
        owners += mb.cp_own
    return got, owners


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("cp", [2, 3])
def test_split_micro_batch_every_position_owned_once(packed, cp):
    batch, ids = make_batch(), [0, 1, 2, 3]
    if packed:
        whole = build_packed_micro_batch(batch, ids, torch.device("cpu"), segment_multiple=2 * cp)
        assert all(n % (2 * cp) == 0 for n in torch.diff(whole.packed_seq_params.cu_seqlens_q).tolist())
    else:
        whole = build_micro_batch(batch, ids, torch.device("cpu"))
    parts = [split_micro_batch(whole, cp, r) for r in range(cp)]
    for mb in parts:
        assert mb.tokens.shape[1] * cp >= whole.tokens.shape[1]
        assert mb.tokens.shape[1] % 2 == 0 and torch.equal(mb.targets, whole.targets)
    got, owners = _gather_back(parts, whole.tokens)
    assert torch.equal(owners, torch.ones_like(owners))  # each position on exactly one rank
    row = whole.tokens if not packed else whole.tokens[0].expand(len(ids), -1)
    want = torch.gather(row, 1, whole.logit_index)
    assert torch.equal(got, want)
    # the padding mask (MoE routers leave it out of the load-balancing loss) follows the split: the
    # ranks' real positions are each sample's tokens once, the CP pad is padding
    lengths = [len(batch["tokens"][i]) for i in ids]
    assert sum(int((~mb.padding).sum()) for mb in parts) == sum(lengths)
    for mb in parts:
        assert mb.padding.shape == mb.tokens.shape
        if not packed:  # local position p of row i is real iff p < its sample's length
            assert torch.equal(mb.padding, mb.position_ids >= torch.tensor(lengths).unsqueeze(1))
    split_real = sorted(t for mb in parts for t in mb.tokens[~mb.padding].tolist())
    assert split_real == sorted(t for i in ids for t in batch["tokens"][i])


def test_packed_cp_positions_restart_per_sample():
    """Packed: each sample padded to 2 * cp and its local position ids are its chunks' positions."""
    batch = make_batch()
    whole = build_packed_micro_batch(batch, [0, 1], torch.device("cpu"), segment_multiple=4)
    assert whole.packed_seq_params.cu_seqlens_q.tolist() == [0, 8, 20]  # lengths 7 -> 8, 12
    r1 = split_micro_batch(whole, 2, 1)
    assert r1.position_ids[0].tolist() == [2, 3, 4, 5, 3, 4, 5, 6, 7, 8]


def test_world_not_divisible_by_cp_is_refused():
    from slime_rl.trainer.parallel import init_parallel

    with pytest.raises(ValueError, match="--context-parallel-size 2"):
        init_parallel(0, 3, "127.0.0.1", 1, tp_size=1, pp_size=1, cp_size=2)


def test_config_counts_cp_in_the_layout(tmp_path):
    from slime_rl.config import ConfigError, build_config
    from tests.config.test_config import base_argv

    cfg = build_config(base_argv(tmp_path) + ["--context-parallel-size", "2", "--actor-num-gpus-per-node", "4"])
    assert cfg.parallel.context_parallel_size == 2 and cfg.parallel.data_parallel_size == 2
    with pytest.raises(ConfigError, match="--context-parallel-size"):
        build_config(base_argv(tmp_path) + ["--context-parallel-size", "3", "--actor-num-gpus-per-node", "4"])
