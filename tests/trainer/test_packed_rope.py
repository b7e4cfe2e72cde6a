"""The sync-free packed RoPE equals megatron-core's own per-sample THD RoPE (bit for bit in fp32
up to op order), for both kinds of frequencies megatron passes, interleaved or not, partial rotary."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from slime_rl.trainer import packed_rope


class _Group:  # the only thing the THD functions ask of the CP group
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


def _megatron_original():
    packed_rope.install()
    assert packed_rope._ORIGINAL is not None and packed_rope._ORIGINAL is not packed_rope.apply_rotary_pos_emb_thd
    return packed_rope._ORIGINAL


def test_positions_restart_per_sample():
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    assert packed_rope.packed_positions(cu, 9).tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("rot_dim", [16, 8])  # 8 < head dim 16: partial rotary, the rest passes through
def test_equals_megatron_thd_rope(interleaved, per_token, rot_dim):
    torch.manual_seed(0)
    lens = [5, 1, 7, 3]
    total, heads, dim = sum(lens), 3, 16
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    t = torch.randn(total, heads, dim)
    freqs = torch.randn(total if per_token else max(lens) + 2, 1, 1, rot_dim)
    original = _megatron_original()
    want = original(t, cu, freqs, rotary_interleaved=interleaved, cp_group=_Group(1))
    got = packed_rope.apply_rotary_pos_emb_thd(t, cu, freqs, rotary_interleaved=interleaved, cp_group=_Group(1))
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # and it is not the identity: position matters
    assert not torch.allclose(got, t)


def test_installed_in_megatron_and_idempotent():
    packed_rope.install()
    packed_rope.install()
    assert rope_utils._apply_rotary_pos_emb_thd is packed_rope.apply_rotary_pos_emb_thd
    assert packed_rope._ORIGINAL is not packed_rope.apply_rotary_pos_emb_thd
