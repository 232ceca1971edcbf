"""cp_cache.layout: sequence dims, 4-D views, LSE broadcasting, narrowing."""

from __future__ import annotations

import pytest
import torch

from cp_cache import layout as L

B, N, S, D = 3, 2, 5, 4


@pytest.mark.parametrize("lay", L.LAYOUTS)
def test_roundtrip_and_views(lay):
    x = torch.randn(B, N, S, D)
    y = L.from_bnsd(x, lay)
    assert y.is_contiguous()
    assert y.size(L.seq_dim(lay)) == S
    assert L.dims(y, lay, N) == L.Dims(B, N, S, D)
    assert torch.equal(L.to_bnsd(y, lay, N), x)
    v = L.as_4d(y, lay, N)
    assert v.data_ptr() == y.data_ptr() and v.dim() == 4
    # narrowing is a view, on the layout form and on the 4-D view alike
    part = L.narrow_seq(y, lay, 2, 3)
    assert part.data_ptr() == y.narrow(L.seq_dim(lay), 2, 1).data_ptr()
    assert part._base is y
    assert torch.equal(L.to_bnsd(part, lay, N), x[:, :, 2:5])
    assert torch.equal(L.to_bnsd(L.narrow_seq(v, lay, 2, 3), lay, N), x[:, :, 2:5])


@pytest.mark.parametrize("lay", L.LAYOUTS)
def test_lse_view_broadcasts(lay):
    x = torch.randn(B, N, S, D)
    lse = torch.randn(B, N, S)
    y = L.as_4d(L.from_bnsd(x, lay), lay, N) * L.lse_view(lse, lay)
    assert torch.equal(L.to_bnsd(y, lay, N), x * lse.unsqueeze(-1))  # the same products, through views


def test_heads_of_gqa():
    k = L.from_bnsd(torch.randn(B, 1, S, D), "BSH")
    assert L.heads_of(k, "BSH", D) == 1
    assert L.heads_of(L.from_bnsd(torch.randn(B, 3, S, D), "SBH"), "SBH", D) == 3


def test_errors():
    with pytest.raises(NotImplementedError, match="input_layout='TND'"):
        L.check_layout("TND")  # the dense layouts' operations refuse packed documents
    with pytest.raises(ValueError, match="'NSD'"):
        L.seq_dim("NSD")
    with pytest.raises(ValueError, match="'NSD'"):
        L.check_layout("NSD")
    with pytest.raises(ValueError, match="4-D"):
        L.dims(torch.randn(2, 3, 4), "BNSD", 2)
    with pytest.raises(ValueError, match="not divisible by head_num=3"):
        L.dims(torch.randn(2, 3, 8), "BSH", 3)
    with pytest.raises(ValueError, match="head_num=2"):
        L.dims(torch.randn(2, 3, 4, 5), "BNSD", 2)


def test_one_table_with_tnd():
    """TND is in the same table: its sequence, head and statistics dims."""
    assert (L.seq_dim(L.TND), L.head_dim_index(L.TND), L.stats_dims(L.TND)) == (0, 1, (0, 1))
    for lay in L.LAYOUTS:
        assert L.stats_dims(lay) == (2, 1)
        x = L.from_bnsd(torch.randn(B, 2, S, D), lay)
        assert x.size(L.seq_dim(lay)) == S
        assert L.lse_shape(x, lay, 2) == (B, 2, S)
    assert L.lse_shape(torch.randn(S, 2, D), L.TND, 2) == (S, 2)

