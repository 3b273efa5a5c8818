"""Packed micro-batches' bookkeeping (rl/engine/packing.py) and the packed attention on one
process (rl/models/packed_attention.py): each segment attends to itself alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rl.engine.packing import build_pack, plan_packs, stream_length, zigzag
from rl.models.packed_attention import packed_attention


def test_plan_packs_first_fit_decreasing():
    lengths = [13, 7, 20, 8, 5, 3, 6, 4]
    packs = plan_packs(lengths, 16)
    # 20 > 16 runs alone; then 13+3, 8+7, 6+5+4 (each pack's own tokens, not rows x width).
    assert packs == [[2], [0, 5], [1, 3], [4, 6, 7]]
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    for p in packs[1:]:
        assert sum(lengths[i] for i in p) <= 16
    assert plan_packs(lengths, 1000) == [list(range(8))]
    assert plan_packs([0, 0], 1) == [[0], [1]]  # an empty row still takes one position
    with pytest.raises(ValueError, match="max_tokens_per_microbatch=0"):
        plan_packs(lengths, 0)


def test_build_pack_pads_only_what_divisibility_needs():
    p = build_pack([3, 5, 1], width=5)
    assert p.length == 9 and p.cu_seqlens.tolist() == [0, 3, 8, 9]
    assert p.index.tolist() == [0, 1, 2, 5, 6, 7, 8, 9, 10]  # row r's column c: r*5 + c
    assert p.positions().tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0]]
    # Sequence parallelism over 4 ranks: one padding segment at the end.
    p = build_pack([3, 5, 1], width=5, multiple=4)
    assert p.length == 12 and p.cu_seqlens.tolist() == [0, 3, 8, 9, 12]
    assert (p.index[9:] == -1).all()
    # CP=2: every segment a multiple of 4, each padded at its own end.
    p = build_pack([3, 5, 1], width=5, cp=2)
    assert p.cu_seqlens.tolist() == [0, 4, 12, 16]
    assert p.index[:4].tolist() == [0, 1, 2, -1]
    # A pipeline's fixed length; stream_length agrees with build_pack.
    assert build_pack([3, 5, 1], width=5, length=20).length == 20
    for cp, mult in ((1, 1), (1, 3), (2, 1), (2, 3), (3, 2)):
        assert (
            stream_length([3, 5, 1], cp=cp, multiple=mult)
            == build_pack([3, 5, 1], width=5, cp=cp, multiple=mult).length
        )
        assert build_pack([3, 5, 1], width=5, cp=cp, multiple=mult).length % (mult * cp) == 0
    with pytest.raises(ValueError, match="past the micro-batch's width"):
        build_pack([6], width=5)


def test_pack_and_unpack_round_trip():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 2, generator=g)
    p = build_pack([3, 5, 1], width=5, cp=2, multiple=2)
    packed = p.pack(x, fill=-7)
    assert packed.shape == (1, p.length, 2) and (packed[0, p.index < 0] == -7).all()
    back = p.unpack(packed)
    keep = torch.zeros(3, 5, dtype=torch.bool)
    keep[0, :3], keep[1, :5], keep[2, :1] = True, True, True
    assert torch.equal(back[keep], x[keep]) and (back[~keep] == 0).all()


def test_zigzag_gives_rank_r_chunks_r_and_2cp_minus_1_minus_r():
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)  # segments of 8 and 4, cp=2: chunks 2 and 1
    assert zigzag(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert zigzag(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    p = build_pack([8, 4], width=8, cp=2)
    assert sorted(p.gathered_order().tolist()) == list(range(12))
    with pytest.raises(ValueError, match="does not split into 2\\*cp=4"):
        zigzag(torch.tensor([0, 6], dtype=torch.int32), 2, 0)


def _rows_attention(q, k, v, lengths, scale):
    """The padded reference: each row alone, causal."""
    outs, lo = [], 0
    for n in lengths:
        o = F.scaled_dot_product_attention(
            *(t[lo : lo + n].transpose(0, 1)[None] for t in (q, k, v)),
            is_causal=True, scale=scale, enable_gqa=True,
        )  # fmt: skip
        outs.append(o[0].transpose(0, 1))
        lo += n
    return torch.cat(outs)


def test_packed_attention_is_each_row_alone_and_fails_across_a_boundary():
    g = torch.Generator().manual_seed(1)
    lengths = [5, 1, 9, 3, 5, 1, 5]
    t = sum(lengths)
    q = torch.randn(t, 4, 8, generator=g)
    k, v = torch.randn(2, t, 2, 8, generator=g)  # grouped-query: 4 heads over 2 groups
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    want = _rows_attention(q, k, v, lengths, 0.3)
    got = packed_attention(q, k, v, cu, 0.3, gqa=True)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    one = packed_attention(q[:5], k[:5], v[:5], cu[:2], 0.3, gqa=True)  # a single row
    torch.testing.assert_close(one, want[:5], atol=1e-6, rtol=0)
    # The mutation: one segment over all rows, so a row attends to the one before it.
    crossed = packed_attention(q, k, v, torch.tensor([0, t], dtype=torch.int32), 0.3, gqa=True)
    assert (crossed[5:] - want[5:]).abs().max() > 1e-2
