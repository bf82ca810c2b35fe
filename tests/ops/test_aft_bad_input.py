"""Bad arguments to the AFT ops raise clear errors naming the argument, before computing."""

from __future__ import annotations

import pytest
import torch

from fastweights.ops import aft, aft_conv, aft_local

x = torch.randn(2, 5, 3)  # [B, T, D]
w = torch.randn(5, 5)
qc = torch.randn(2, 5, 4, 2)  # [B, T, H, Dh]
kc = torch.randn(2, 5, 4)
wc = torch.randn(4, 3)
band = torch.randn(5, 2)  # [T, window]
simple_state = (torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3))

CASES = [
    ("q rank", lambda: aft(x[0], x[0], x[0]), ValueError, "q must be a 3-D tensor [B, T, D]"),
    ("k shape", lambda: aft(x, x[:, :4], x), ValueError, "k must have the same shape as q"),
    ("v shape", lambda: aft(x, x, x[..., :2]), ValueError, "v must have the same shape as q"),
    ("dtype mix", lambda: aft(x, x.double(), x), TypeError, "dtype"),
    ("int tensor", lambda: aft(x.long(), x.long(), x.long()), TypeError, "floating-point"),
    ("not tensor", lambda: aft([1.0], x, x), TypeError, "q must be a torch.Tensor"),
    ("empty", lambda: aft(x[:, :0], x[:, :0], x[:, :0]), ValueError, "non-empty"),
    ("bias smaller than T", lambda: aft(x, x, x, w[:4, :4]), ValueError, "w must have shape"),
    ("bias too few columns", lambda: aft(x, x, x, w[:, :4]), ValueError, "at least 5 columns"),
    ("bias rank", lambda: aft(x, x, x, w[0]), ValueError, "w must be a 2-D tensor"),
    ("bias int", lambda: aft(x, x, x, w.long()), TypeError, "w must be a floating-point"),
    ("causal not bool", lambda: aft(x, x, x, causal=1), TypeError, "causal must be a bool"),
    ("chunk 0", lambda: aft(x, x, x, w, chunk_size=0), ValueError, "chunk_size must be >= 1"),
    ("window negative", lambda: aft_local(x, x, x, band, window=-1), ValueError, "window must be >= 1"),
    ("window float", lambda: aft_local(x, x, x, band, window=2.0), TypeError, "window"),
    ("local band rows", lambda: aft_local(x, x, x, band[:3], window=2), ValueError,
     "w must have shape [T, window]"),
    ("local band bidirectional", lambda: aft_local(x, x, x, band, window=2, causal=False), ValueError,
     "w must have shape [T, 2 window - 1] = [5, 3]"),
    ("local bias missing", lambda: aft_local(x, x, x, None, window=2), TypeError, "w must be a torch.Tensor"),
    ("conv kernel heads", lambda: aft_conv(qc, kc, qc, wc[:3]), ValueError, "w must have shape [H, s] with H = 4"),
    ("conv kernel rank", lambda: aft_conv(qc, kc, qc, wc[0]), ValueError, "w must be a 2-D tensor [H, s]"),
    ("conv kernel empty", lambda: aft_conv(qc, kc, qc, wc[:, :0]), ValueError, "s >= 1"),
    ("conv even centred kernel", lambda: aft_conv(qc, kc, qc, torch.randn(4, 2), causal=False), ValueError,
     "odd kernel size"),
    ("conv k per channel", lambda: aft_conv(qc, qc, qc, wc), ValueError, "k must have shape [B, T, H]"),
    ("conv k wrong heads", lambda: aft_conv(qc, kc[..., :3], qc, wc), ValueError, "k must have shape [B, T, H]"),
    ("conv v shape", lambda: aft_conv(qc, kc, qc[..., :1], wc), ValueError, "v must have the same shape as q"),
    ("conv q rank", lambda: aft_conv(x, kc, x, wc), ValueError, "q must be a 4-D tensor"),
    ("conv dtype mix", lambda: aft_conv(qc, kc.double(), qc, wc), TypeError, "dtype"),
    ("mode", lambda: aft(x, x, x, mode="parallel"), ValueError, "mode must be one of"),
    ("flag", lambda: aft(x, x, x, output_final_state=None), TypeError,
     "output_final_state must be a bool"),
    ("simple state type", lambda: aft(x, x, x, initial_state=torch.zeros(2, 3)), TypeError,
     "initial_state must be a tuple (a, n, m)"),
    ("simple state shape", lambda: aft(x, x, x, initial_state=(torch.zeros(2, 4),) * 3),
     ValueError, "initial_state[0] (a)"),
    ("local band shape", lambda: aft_local(x, x, x, band[:, :1], window=2), ValueError,
     "w must have shape [T, window]"),
    ("local window 0", lambda: aft_local(x, x, x, band, window=0), ValueError, "window must be >= 1"),
    ("local state pos", lambda: aft_local(x, x, x, band, window=2,
                                          initial_state=(*simple_state, torch.zeros(2, 1, 3),
                                                         torch.zeros(2, 1, 3), 1.5)),
     TypeError, "initial_state[5] (pos) must be an int"),
    ("local state cache", lambda: aft_local(x, x, x, band, window=2,
                                            initial_state=(*simple_state, torch.zeros(2, 0, 3),
                                                           torch.zeros(2, 0, 3), 4)),
     ValueError, "initial_state[3] (k_cache)"),
    ("conv state cache too long", lambda: aft_conv(
        qc, kc, qc, wc, initial_state=(torch.zeros(2, 4), torch.zeros(2, 4, 2), torch.zeros(2, 4),
                                       torch.zeros(2, 3, 4), torch.zeros(2, 3, 4, 2))),
     ValueError, "c <= s - 1 = 2"),
    ("full bias rows packed", lambda: aft(x[:1], x[:1], x[:1], w[:4], cu_seqlens=torch.tensor([0, 5])),
     ValueError, "exactly T = 5 rows"),
    ("full bias columns with a cache", lambda: aft(
        x, x, x, torch.randn(5, 7), initial_state=(torch.zeros(2, 3, 3), torch.zeros(2, 3, 3))),
     ValueError, "at least 8 columns"),
    ("full cache", lambda: aft(
        x, x, x, w, initial_state=(torch.zeros(2, 0, 3), torch.zeros(2, 1, 3))), ValueError,
     "initial_state[1] (v_cache)"),
]


@pytest.mark.parametrize("call,exc,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    assert words in str(info.value)
