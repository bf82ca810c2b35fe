"""Bad arguments to infini_attention raise clear errors naming the argument."""

from __future__ import annotations

import pytest
import torch

from fastweights.ops import infini_attention

B, T, H, Dk, Dv, N = 2, 5, 3, 4, 6, 3
q = torch.randn(B, T, H, Dk)
v = torch.randn(B, T, H, Dv)
gate = torch.zeros(H)
M, z = torch.zeros(B, H, Dk, Dv), torch.zeros(B, H, Dk)


def cache(n, dk=Dk, dv=Dv):
    return torch.zeros(B, n, H, dk), torch.zeros(B, n, H, dv), torch.zeros(B, n, H, dk)


def call(**kw):
    args = {"q": q, "k": q, "v": v, "gate": gate}
    args.update({name: kw.pop(name) for name in list(kw) if name in args})
    kw.setdefault("segment_len", N)
    return infini_attention(args["q"], args["k"], args["v"], args["gate"], **kw)


CASES = [
    ("segment_len 0", lambda: call(segment_len=0), ValueError, "segment_len must be >= 1"),
    ("segment_len float", lambda: call(segment_len=2.5), TypeError, "segment_len"),
    ("segment_len missing", lambda: infini_attention(q, q, v, gate), TypeError, "segment_len"),
    ("update unknown", lambda: call(update="sum"), ValueError, "update must be one of"),
    ("gate too long", lambda: call(gate=torch.zeros(H + 1)), ValueError, "gate must have shape [H]"),
    ("gate per token", lambda: call(gate=torch.zeros(B, T, H)), ValueError, "gate must have shape [H]"),
    ("gate not tensor", lambda: call(gate=0.0), TypeError, "gate must be a torch.Tensor"),
    ("gate int", lambda: call(gate=torch.zeros(H, dtype=torch.long)), TypeError, "gate must be a floating"),
    ("mode unknown", lambda: call(mode="fast"), ValueError, "mode must be one of"),
    ("q rank", lambda: call(q=q[0], k=q[0], v=v[0]), ValueError, "q must be a 4-D"),
    ("v shape", lambda: call(v=v[:, :4]), ValueError, "v must have shape"),
    ("q_mem shape", lambda: call(q_mem=q[..., :2]), ValueError, "q_mem must have shape"),
    ("k_mem dtype", lambda: call(k_mem=q.double()), TypeError, "k_mem has dtype"),
    ("eps zero", lambda: call(eps=0.0), ValueError, "eps must be > 0"),
    ("eps negative", lambda: call(eps=-1e-6), ValueError, "eps must be"),
    ("scale nan", lambda: call(scale=float("nan")), ValueError, "scale must be finite"),
    ("output_final_state", lambda: call(output_final_state=1), TypeError, "output_final_state"),
    ("state length", lambda: call(initial_state=(M, z, M)), TypeError, "initial_state must be"),
    ("state tensor", lambda: call(initial_state=M), TypeError, "initial_state must be"),
    ("state M shape", lambda: call(initial_state=(M[..., :2], z)), ValueError, "initial_state[0] (M)"),
    ("state z shape", lambda: call(initial_state=(M, z[:1])), ValueError, "initial_state[1] (z)"),
    ("open segment full", lambda: call(initial_state=(M, z, *cache(N))), ValueError,
     "n must be < segment_len"),
    ("v_seg length", lambda: call(initial_state=(M, z, cache(1)[0], cache(2)[1], cache(1)[2])),
     ValueError, "initial_state[3] (v_seg)"),
    ("k_mem_seg dim", lambda: call(initial_state=(M, z, *cache(1)[:2], cache(1, dk=Dk + 1)[2])),
     ValueError, "initial_state[4] (k_mem_seg)"),
]


@pytest.mark.parametrize("fn,exc,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(fn, exc, words):
    with pytest.raises(exc) as info:
        fn()
    assert words in str(info.value)
