"""backend= dispatch (ops/backend.py) and the flash-linear-attention adapter.

fla's kernels need a GPU; its pure-PyTorch reference forms (fla.ops.*.naive) import and run on
CPU. The tests put those references in place of fla's chunk functions (``fla_ops``), with the
chunk functions' own signatures (scale, initial_state, output_final_state, normalize,
use_qk_l2norm_in_kernel, g, layouts), mark CPU tensors as "CUDA" for the device check, and
compare the public ops with backend="fla" against our float64 oracles. fla's references compute
in float32 whatever the input dtype, so the inputs are float32 and the tolerance float32's.
"""

from __future__ import annotations

import itertools
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from fastweights.ops import backend as backends
from fastweights.ops import decay_linear_attn, delta_rule, gated_delta_rule, linear_attn, sum_norm

fla_naive_la = pytest.importorskip("fla.ops.linear_attn.naive")
fla_naive_dr = pytest.importorskip("fla.ops.delta_rule.naive")
fla_naive_gla = pytest.importorskip("fla.ops.simple_gla.naive")
fla_naive_gdn = pytest.importorskip("fla.ops.gated_delta_rule.naive")

TOL = 2e-5


def per_document(fn):
    """fla's variable-length convention over a reference without one: with ``cu_seqlens`` (B = 1)
    run each document on its own (its row of ``initial_state``), outputs joined along T and
    final states stacked along dim 0 ([N, ...]), as fla's kernels return them."""

    def run(q, k, v, *args, initial_state=None, output_final_state=False, cu_seqlens=None,
            cu_seqlens_cpu=None, **kw):
        if cu_seqlens is None:
            assert cu_seqlens_cpu is None
            return fn(q, k, v, *args, initial_state=initial_state,
                      output_final_state=output_final_state, **kw)
        assert q.shape[0] == 1 and cu_seqlens.dtype == torch.long
        bounds = cu_seqlens.tolist()
        if cu_seqlens_cpu is not None:
            assert cu_seqlens_cpu.device.type == "cpu" and cu_seqlens_cpu.tolist() == bounds
        outs, finals = [], []
        for i, (a, b) in enumerate(itertools.pairwise(bounds)):
            sliced = [x[:, a:b] if isinstance(x, torch.Tensor) else x for x in args]
            sliced_kw = {n: x[:, a:b] if n == "g" else x for n, x in kw.items()}
            o, S = fn(q[:, a:b], k[:, a:b], v[:, a:b], *sliced,
                      initial_state=None if initial_state is None else initial_state[i:i + 1],
                      output_final_state=output_final_state, **sliced_kw)
            outs.append(o)
            finals.append(S)
        return torch.cat(outs, dim=1), (torch.cat(finals) if output_final_state else None)

    return run


@per_document
def ref_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False,
                    normalize=True):
    """fla.ops.linear_attn.chunk_linear_attn's signature over fla's recurrent reference."""
    return fla_naive_la.naive_recurrent_linear_attn(q, k, v, scale, initial_state,
                                                    output_final_state, normalize)


@per_document
def ref_delta_rule(q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False):
    """chunk_delta_rule's signature ([B, T, H, D], scale default 1/sqrt(Dk)) over fla's
    head-first reference, whose scale is fixed at 1/sqrt(Dk). fla's kernel refuses float32."""
    assert q.dtype != torch.float32, "ChunkDeltaRuleFunction does not support float32"
    Dk = q.shape[-1]
    if scale is None:
        scale = Dk ** -0.5
    if use_qk_l2norm_in_kernel:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    q = q.float() * (scale / Dk ** -0.5)
    o, S = fla_naive_dr.delta_rule_recurrence(
        *(x.transpose(1, 2) for x in (q, k, v, beta)), initial_state=initial_state,
        output_final_state=output_final_state)
    return o.transpose(1, 2).to(v.dtype), S


@per_document
def ref_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                   output_final_state=False):
    assert g_gamma is None
    return fla_naive_gla.naive_recurrent_simple_gla(q, k, v, g, scale, initial_state,
                                                    output_final_state)


gdn_calls: list[dict] = []  # the arguments of every ref_gated_delta_rule call, as fla got them


@per_document
def ref_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                         output_final_state=False, **flags):
    """chunk_gated_delta_rule's signature (g before beta; grouped value heads: value head i_hv
    reads key head i_hv // (HV // H), fla's kernel indexing) over fla's recurrent reference,
    which has neither grouped heads nor the flags and returns float32 (fla's kernel returns o in
    q's dtype). Records what fla was given."""
    gdn_calls.append({"g": g.dtype, "beta": beta.dtype, "scale": scale,
                      "state": None if initial_state is None else initial_state.dtype, **flags})
    assert not any(flags.values()), flags  # in-kernel l2norm / beta sigmoid / neg-eigval stay off
    H, HV = q.shape[2], v.shape[2]
    heads = torch.arange(HV) // (HV // H)
    o, S = fla_naive_gdn.naive_recurrent_gated_delta_rule(
        q[:, :, heads], k[:, :, heads], v, beta, g, scale, initial_state, output_final_state)
    return o.to(q.dtype), S


REFS = SimpleNamespace(linear_attn=ref_linear_attn, delta_rule=ref_delta_rule,
                       simple_gla=ref_simple_gla, gated_delta_rule=ref_gated_delta_rule)


@pytest.fixture
def fla_on_cpu(monkeypatch):
    """fla's references in place of its kernels; CPU tensors pass the CUDA check."""
    calls = []

    def recording(name):
        fn = getattr(REFS, name)
        return lambda *a, **kw: calls.append(name) or fn(*a, **kw)

    stand_ins = SimpleNamespace(**{n: recording(n) for n in vars(REFS)})
    monkeypatch.setattr(backends, "fla_ops", lambda: stand_ins)
    monkeypatch.setattr(backends, "_on_cuda", lambda q: True)
    monkeypatch.setattr(backends, "_logged", set())
    monkeypatch.setattr(backends, "_trials", {})
    monkeypatch.delenv("FASTWEIGHTS_BACKEND", raising=False)
    return calls


def data(B=2, T=45, H=3, Dk=8, Dv=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(B, T, H, Dk, generator=g)
    k = torch.rand(B, T, H, Dk, generator=g)
    v = torch.randn(B, T, H, Dv, generator=g)
    beta = torch.rand(B, T, H, generator=g)
    S0 = torch.randn(B, H, Dk, Dv, generator=g)
    z0 = torch.rand(B, H, Dk, generator=g)
    return q, k, v, beta, S0, z0


def err(a, b):
    return (a.double() - b.double()).abs().max().item()


def test_fla_references_import_without_a_gpu():
    assert backends.fla_ops() is not None  # fla imports on a CPU-only machine


@pytest.mark.parametrize("normalize", [False, True], ids=["unnorm", "norm"])
def test_linear_attn_fla_matches_oracle(fla_on_cpu, normalize):
    """scale 0.7 (fla's default would be 1/sqrt(Dk)), our eps 1e-3 (fla's is 1e-10), initial and
    final (S, z) in our layout."""
    q, k, v, _, S0, z0 = data()
    kw = {"normalize": normalize, "eps": 1e-3, "scale": 0.7, "output_final_state": True,
          "initial_state": (S0, z0)}
    o, (S, z) = linear_attn(q, k, v, backend="fla", **kw)
    ref, (Sr, zr) = linear_attn(q.double(), k.double(), v.double(), mode="naive",
                                **{**kw, "initial_state": (S0.double(), z0.double())})
    assert fla_on_cpu == ["linear_attn"]
    assert o.dtype == q.dtype and S.dtype == z.dtype == torch.float32
    assert S.shape == S0.shape and z.shape == z0.shape
    assert max(err(o, ref), err(S, Sr), err(z, zr)) <= TOL * max(1.0, ref.abs().max().item())


def test_fla_own_normalisation_differs_from_ours():
    """Why the adapter does not use fla's normalize=True: its eps is fixed at 1e-10 (ours is an
    argument) and it takes no z0 without a tuple state; with eps=1e-2 the outputs differ."""
    q, k, v, _, _, _ = data(T=9)
    q, k = q * 1e-2, k * 1e-2  # small denominators: eps matters
    fla_o, _ = ref_linear_attn(q, k, v, scale=1.0, normalize=True)
    ours, _ = linear_attn(q.double(), k.double(), v.double(), normalize=True, eps=1e-2,
                          mode="naive")
    assert err(fla_o, ours) > 1e-2


@pytest.mark.parametrize("keys", ["sum_norm", "l2"])
def test_delta_rule_fla_matches_oracle(fla_on_cpu, keys):
    """Keys as the caller normalised them (fla's in-kernel L2 norm stays off), scale explicit,
    a float32 beta for float16 inputs (fla's delta rule refuses float32 ones), initial and final
    state. The oracle runs on the same float16-rounded inputs: what differs is o's rounding."""
    q, k, v, beta, S0, _ = data()
    k = sum_norm(k) if keys == "sum_norm" else F.normalize(k, dim=-1)
    q, k, v = (x.half() for x in (q, k, v))
    kw = {"scale": 0.5, "output_final_state": True}
    o, S = delta_rule(q, k, v, beta, backend="fla", initial_state=S0, **kw)
    ref, Sr = delta_rule(*(x.double() for x in (q, k, v, beta.half())),
                         initial_state=S0.double(), mode="naive", **kw)
    assert fla_on_cpu == ["delta_rule"]
    assert o.dtype == torch.float16 and S.dtype == torch.float32
    scale = max(1.0, ref.abs().max().item())
    assert err(o, ref) <= torch.finfo(torch.float16).eps * scale
    assert err(S, Sr) <= TOL * max(1.0, Sr.abs().max().item())


def test_decay_linear_attn_fla_matches_oracle(fla_on_cpu):
    """decay lambda_h as simple GLA's log-decay g = log(lambda_h) at every token."""
    q, k, v, _, S0, _ = data()
    decay = torch.tensor([0.9, 0.5, 1.0])
    kw = {"scale": 1.3, "output_final_state": True}
    o, S = decay_linear_attn(q, k, v, decay, backend="fla", initial_state=S0, **kw)
    ref, Sr = decay_linear_attn(q.double(), k.double(), v.double(), decay.double(),
                                initial_state=S0.double(), mode="naive", **kw)
    assert fla_on_cpu == ["simple_gla"]
    assert max(err(o, ref), err(S, Sr)) <= TOL * max(1.0, ref.abs().max().item())


def test_fla_gradients_match_oracle(fla_on_cpu):
    """The adapter's own pieces (the normaliser, z) are differentiable like the oracle."""
    q, k, v, _, S0, z0 = data(T=20)
    xs = [x.clone().requires_grad_() for x in (q, k, v, S0, z0)]
    x64 = [x.double().clone().requires_grad_() for x in (q, k, v, S0, z0)]
    w = torch.randn(2, 20, 3, 11, dtype=torch.float64)
    for inp, mode in ((xs, "chunk"), (x64, "naive")):
        o, (S, z) = linear_attn(*inp[:3], normalize=True, initial_state=(inp[3], inp[4]),
                                output_final_state=True, mode=mode,
                                **({"backend": "fla"} if mode == "chunk" else {}))
        ((o.double() * w).sum() + S.double().sum() + z.double().square().sum()).backward()
    for a, b in zip(xs, x64):
        assert err(a.grad, b.grad) <= 1e-4 * max(1.0, b.grad.abs().max().item())


def test_automatic_choice_prefers_fla_and_logs_once(fla_on_cpu, caplog):
    """The first automatic choice per (op, dtype, device, gradients) runs a trial call first (the
    extra fla call below); the choice is logged once at INFO, and fla's first-call autotuning
    once per op at WARNING."""
    q, k, v, beta, _, _ = data(T=12)
    with caplog.at_level(logging.INFO, logger="fastweights.ops.backend"):
        linear_attn(q, k, v)
        linear_attn(q, k, v)
        delta_rule(q.half(), sum_norm(k).half(), v.half(), beta)
    assert fla_on_cpu == ["linear_attn"] * 3 + ["delta_rule"] * 2
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(infos) == 2 and all("fla backend" in m for m in infos)
    assert len(warnings) == 2 and all("autotune on their first call" in m for m in warnings)
    # fla's delta rule refuses float32 inputs: the automatic choice passes it over, saying why.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fastweights.ops.backend"):
        assert backends.choose_backend("delta_rule", q, None, "chunk", 64) != "fla"
    assert "fla's chunk_delta_rule refuses them" in caplog.records[0].getMessage()
    # chunk_size other than fla's 64: the automatic choice moves on (fla's chunk is fixed).
    assert backends.choose_backend("linear_attn", q, None, "chunk", 32) != "fla"
    linear_attn(q, k, v, mode="naive")
    assert fla_on_cpu == ["linear_attn"] * 3 + ["delta_rule"] * 2


def test_explicit_backend_that_cannot_run_is_an_error(fla_on_cpu, monkeypatch):
    q, k, v, beta, _, _ = data(T=12)
    with pytest.raises(ValueError, match="chunks of 64"):
        linear_attn(q, k, v, backend="fla", chunk_size=32)
    with pytest.raises(ValueError, match="mode='chunk'"):
        delta_rule(q, k, v, beta, backend="fla", mode="recurrent")
    with pytest.raises(ValueError, match="float32 inputs: fla's chunk_delta_rule refuses"):
        delta_rule(q, k, v, beta, backend="fla")
    with pytest.raises(ValueError, match="no Triton kernel for decay_linear_attn"):
        decay_linear_attn(q, k, v, torch.ones(3), backend="triton")
    with pytest.raises(ValueError, match="backend must be one of"):
        linear_attn(q, k, v, backend="cuda")
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        linear_attn(q.double(), k.double(), v.double(), backend="fla")
    monkeypatch.setenv("FASTWEIGHTS_BACKEND", "nope")
    with pytest.raises(ValueError, match="FASTWEIGHTS_BACKEND must be one of"):
        linear_attn(q, k, v)
    monkeypatch.setenv("FASTWEIGHTS_BACKEND", "torch")
    linear_attn(q, k, v)
    assert fla_on_cpu == []
    monkeypatch.setattr(backends, "_on_cuda", lambda q: q.is_cuda)
    monkeypatch.setenv("FASTWEIGHTS_BACKEND", "fla")
    with pytest.raises(ValueError, match="need CUDA tensors"):
        linear_attn(q, k, v)


@pytest.mark.parametrize("op", ["linear", "linear_norm", "delta", "decay"])
def test_packed_batch_reaches_fla_whole(fla_on_cpu, op):
    """A packed batch goes to fla in one call with its cu_seqlens (int64, with the CPU copy where
    fla takes one) and the initial states stacked per document ([N, ...], zeros for a None);
    the outputs and the per-document final states match the float64 oracle run one document at
    a time. The normaliser's running sum restarts per document: the first document's keys are
    1000 times larger, so a float32 running sum over the whole batch would lose the later
    documents' digits."""
    bounds = [0, 7, 8, 30, 45]  # a one-token document too
    cu = torch.tensor(bounds, dtype=torch.int32)
    q, k, v, beta, S0, z0 = data(B=1, T=45)
    k[:, :7] *= 1e3 if op == "linear_norm" else 1.0
    if op == "delta":
        k = sum_norm(k)
        q, k, v = (x.half() for x in (q, k, v))
        beta = beta.half().float()  # the adapter passes beta in q's dtype
    n = len(bounds) - 1
    kw = {"scale": 0.7, "output_final_state": True, "cu_seqlens": cu}

    def initial(dtype):  # one per document, the second None
        S = [None if i == 1 else (S0 * (i + 1)).to(dtype) for i in range(n)]
        return [s if s is None or not op.startswith("linear") else (s, z0.to(dtype)) for s in S]

    def run(x, **extra):
        x = list(x)
        init = initial(torch.float64 if x[0].dtype == torch.float64 else torch.float32)
        if op.startswith("linear"):
            return linear_attn(*x[:3], normalize=op == "linear_norm", eps=1e-3,
                               initial_state=init, **kw, **extra)
        op_fn = delta_rule if op == "delta" else decay_linear_attn
        return op_fn(*x, initial_state=init, **kw, **extra)

    last = beta if op == "delta" else torch.tensor([0.9, 0.5, 1.0])
    o, states = run((q, k, v, last), backend="fla")
    ref, ref_states = run((x.double() for x in (q, k, v, last)), mode="naive")
    assert fla_on_cpu == [{"linear": "linear_attn", "linear_norm": "linear_attn",
                           "delta": "delta_rule", "decay": "simple_gla"}[op]]
    assert o.dtype == q.dtype and len(states) == n
    tol = (torch.finfo(torch.float16).eps if op == "delta" else TOL) * max(1.0, ref.abs().max().item())
    assert err(o, ref) <= tol
    for got, want in zip(states, ref_states):
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for g, w in zip(got, want):
            assert g.dtype == torch.float32 and g.shape[0] == 1
            assert err(g, w) <= TOL * max(1.0, w.abs().max().item())


def gdn_data(B=2, T=45, Hk=2, H=4, Dk=8, Dv=11, seed=1):
    """Gated DeltaNet inputs: L2-normalised q, k with Hk heads, v/beta/g with H value heads,
    g = logsigmoid (down to about -6 per token), an initial state."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, Hk, Dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, Hk, Dk, generator=gen), dim=-1)
    v = torch.randn(B, T, H, Dv, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    g = F.logsigmoid(3 * torch.randn(B, T, H, generator=gen))
    S0 = torch.randn(B, H, Dk, Dv, generator=gen)
    return q, k, v, beta, g, S0


@pytest.mark.parametrize("heads", ["Hk2-H4", "Hk3-H3"])
def test_gated_delta_rule_fla_matches_oracle(fla_on_cpu, heads):
    """scale 0.35 passed explicitly (fla's default is 1/sqrt(Dk)), g in float32 and beta in q's
    dtype, fla's in-kernel flags off, grouped value heads, initial and final state in our
    [B, H, Dk, Dv] layout: equal to the float64 literal recurrence to float32 rounding (fla's
    reference computes in float32)."""
    Hk, H = (2, 4) if heads == "Hk2-H4" else (3, 3)
    q, k, v, beta, g, S0 = gdn_data(Hk=Hk, H=H)
    gdn_calls.clear()
    kw = {"scale": 0.35, "output_final_state": True}
    o, S = gated_delta_rule(q, k, v, beta, g.half(), backend="fla", initial_state=S0, **kw)
    ref, Sr = gated_delta_rule(*(x.double() for x in (q, k, v, beta, g.half())),
                               initial_state=S0.double(), mode="naive", **kw)
    assert fla_on_cpu == ["gated_delta_rule"]
    assert gdn_calls == [{"g": torch.float32, "beta": torch.float32, "scale": 0.35,
                          "state": torch.float32, "use_qk_l2norm_in_kernel": False,
                          "use_beta_sigmoid_in_kernel": False, "allow_neg_eigval": False}]
    assert o.dtype == q.dtype and S.dtype == torch.float32 and S.shape == S0.shape
    assert err(o, ref) <= TOL * max(1.0, ref.abs().max().item())
    assert err(S, Sr) <= TOL * max(1.0, Sr.abs().max().item())


def test_gated_delta_rule_fla_half_inputs_and_gradients(fla_on_cpu):
    """bfloat16 q, k, v: beta reaches fla in bfloat16 (q's dtype), the output comes back in
    bfloat16; gradients of q, k, v, beta, g and the initial state flow through the adapter's
    casts like the oracle's (fla's reference is differentiable)."""
    q, k, v, beta, g, S0 = gdn_data(T=20)
    gdn_calls.clear()
    o, _ = gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), beta, g, backend="fla")
    assert o.dtype == torch.bfloat16 and gdn_calls[0]["beta"] == torch.bfloat16
    xs = [x.clone().requires_grad_() for x in (q, k, v, beta, g, S0)]
    x64 = [x.double().clone().requires_grad_() for x in (q, k, v, beta, g, S0)]
    w = torch.randn(2, 20, 4, 11, dtype=torch.float64)
    for inp, extra in ((xs, {"backend": "fla"}), (x64, {"mode": "naive"})):
        o, S = gated_delta_rule(*inp[:5], initial_state=inp[5], output_final_state=True,
                                scale=0.5, **extra)
        ((o.double() * w).sum() + S.double().square().sum()).backward()
    for a, b in zip(xs, x64):
        assert err(a.grad, b.grad) <= 1e-4 * max(1.0, b.grad.abs().max().item())


def test_gated_delta_rule_packed_batch_reaches_fla_whole(fla_on_cpu):
    """A packed batch (a one-token document among them) goes to fla in one call with int64
    cu_seqlens and its CPU copy, initial states stacked ([N, H, Dk, Dv], zeros for a None); the
    outputs and per-document final states equal the float64 oracle's."""
    bounds = [0, 7, 8, 30, 45]
    q, k, v, beta, g, S0 = gdn_data(B=1)
    n = len(bounds) - 1
    kw = {"scale": 0.7, "output_final_state": True,
          "cu_seqlens": torch.tensor(bounds, dtype=torch.int32)}

    def initial(dtype):
        return [None if i == 1 else (S0 * (i + 1)).to(dtype) for i in range(n)]

    o, states = gated_delta_rule(q, k, v, beta, g, initial_state=initial(torch.float32),
                                 backend="fla", **kw)
    ref, ref_states = gated_delta_rule(*(x.double() for x in (q, k, v, beta, g)),
                                       initial_state=initial(torch.float64), mode="naive", **kw)
    assert fla_on_cpu == ["gated_delta_rule"]
    assert err(o, ref) <= TOL * max(1.0, ref.abs().max().item())
    assert len(states) == n
    for got, want in zip(states, ref_states):
        assert got.dtype == torch.float32 and got.shape == (1, 4, 8, 11)
        assert err(got, want) <= TOL * max(1.0, want.abs().max().item())


def test_gated_delta_rule_backend_choice(fla_on_cpu):
    """Automatic: fla for a chunked call at chunk_size 64 (float32 included: fla's gated delta
    rule takes it), torch for other chunk sizes, mode="recurrent"/"naive" and one-token steps;
    an explicit fla that cannot run the call is a ValueError saying why, before any work."""
    q, k, v, beta, g, _ = gdn_data(T=12)
    gated_delta_rule(q, k, v, beta, g)
    assert fla_on_cpu == ["gated_delta_rule"] * 2  # the trial, then the call
    fla_on_cpu.clear()
    gated_delta_rule(q, k, v, beta, g, chunk_size=32)
    gated_delta_rule(q, k, v, beta, g, mode="recurrent")
    gated_delta_rule(q[:, :1], k[:, :1], v[:, :1], beta[:, :1], g[:, :1])
    assert fla_on_cpu == []
    with pytest.raises(ValueError, match="chunk_size=32: fla's kernels use chunks of 64"):
        gated_delta_rule(q, k, v, beta, g, backend="fla", chunk_size=32)
    with pytest.raises(ValueError, match="mode='chunk'"):
        gated_delta_rule(q, k, v, beta, g, backend="fla", mode="naive")
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        gated_delta_rule(*(x.double() for x in (q, k, v, beta, g)), backend="fla")
    with pytest.raises(ValueError, match="g must be <= 0"):  # the op's checks come first
        gated_delta_rule(q, k, v, beta, -g, backend="fla")
    assert fla_on_cpu == []


def test_gated_delta_rule_cpu_tensors_stay_on_torch(fla_on_cpu, monkeypatch):
    """Real device check: CPU tensors take torch automatically (fla installed or not), and an
    explicit fla is refused, naming the device."""
    monkeypatch.setattr(backends, "_on_cuda", lambda q: q.is_cuda)
    q, k, v, beta, g, _ = gdn_data(T=12)
    ref, _ = gated_delta_rule(q, k, v, beta, g, mode="recurrent")
    o, _ = gated_delta_rule(q, k, v, beta, g)
    assert fla_on_cpu == [] and err(o, ref) <= TOL
    with pytest.raises(ValueError, match="inputs on cpu, the fla kernels need CUDA tensors"):
        gated_delta_rule(q, k, v, beta, g, backend="fla")


# fla 0.6's gated backward kernel refuses Triton >= 3.4, < 3.7.1 on Hopper GPUs (its guard
# in fla.ops.common.chunk_o.chunk_bwd_dqkwg): the forward runs, the backward raises.
HOPPER_GUARD = ("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results for "
                "gated chunk_bwd_dqkwg (see #640).")


class _BackwardRefuses(torch.autograd.Function):
    """Identity whose backward raises fla's guard."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(HOPPER_GUARD)


@pytest.fixture
def fla_refuses(fla_on_cpu, monkeypatch):
    """fla's gated delta rule whose backward raises the Hopper guard, and delta rule whose
    forward raises (an unsupported-shape refusal); Triton off, so the next backend is torch."""
    forward_ok = backends.fla_ops().gated_delta_rule

    def gated(*args, **kwargs):
        o, S = forward_ok(*args, **kwargs)
        return _BackwardRefuses.apply(o), S

    def delta(*args, **kwargs):
        fla_on_cpu.append("delta_rule")
        raise NotImplementedError("head dim 11 is not supported")

    stand_ins = SimpleNamespace(**{**vars(backends.fla_ops()), "gated_delta_rule": gated,
                                   "delta_rule": delta})
    monkeypatch.setattr(backends, "fla_ops", lambda: stand_ins)
    monkeypatch.setenv("FASTWEIGHTS_TRITON", "0")
    return fla_on_cpu


def _gdn_run(inputs, **kw):
    q, k, v, beta, g, S0 = inputs
    o, S = gated_delta_rule(q, k, v, beta, g, initial_state=S0, output_final_state=True,
                            scale=0.5, **kw)
    return o, S


def _leaves(dtype=torch.float32):
    return [x.to(dtype).clone().requires_grad_() for x in gdn_data(T=70)]


def test_fla_backward_refusal_falls_back_with_the_right_result(fla_refuses, caplog):
    """The automatic choice's trial meets fla's backward refusal: the call runs on the next
    backend (torch here) and its outputs and gradients equal the float64 oracle's; the refusal
    is logged once at WARNING with fla's reason and remembered (no fla call afterwards, no
    second trial); forward-only calls, which fla can run, still take fla."""
    xs, x64 = _leaves(), _leaves(torch.float64)
    w = torch.randn(2, 70, 4, 11, dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="fastweights.ops.backend"):
        for inputs, extra in ((xs, {}), (x64, {"mode": "naive"})):
            o, S = _gdn_run(inputs, **extra)
            ((o.double() * w).sum() + S.double().square().sum()).backward()
    assert fla_refuses == ["gated_delta_rule"]  # the trial only
    refusals = [r.getMessage() for r in caplog.records if "failed a trial" in r.getMessage()]
    assert len(refusals) == 1 and "RuntimeError: Triton >= 3.4.0 and < 3.7.1" in refusals[0]
    for a, b in zip(xs, x64):
        assert err(a.grad, b.grad) <= 1e-4 * max(1.0, b.grad.abs().max().item())
    _gdn_run(_leaves())[0].sum().backward()  # remembered: neither trial nor call
    assert fla_refuses == ["gated_delta_rule"]
    with torch.no_grad():
        _gdn_run(_leaves())
    assert fla_refuses == ["gated_delta_rule"] * 3  # a forward-only trial, then the call
    # An explicit fla is not tried: its refusal reaches the caller.
    o, _ = _gdn_run(_leaves(), backend="fla")
    with pytest.raises(RuntimeError, match="Hopper GPUs"):
        o.sum().backward()


def test_fla_forward_refusal_falls_back(fla_refuses):
    """A refusal in fla's forward (an unsupported shape): the automatic choice takes torch, whose
    result equals the oracle's; an explicit fla raises fla's error."""
    q, k, v, beta, S0, _ = data(T=20)
    q, k, v = (x.half() for x in (q, sum_norm(k), v))
    o, S = delta_rule(q, k, v, beta, initial_state=S0, output_final_state=True)
    ref, Sr = delta_rule(*(x.double() for x in (q, k, v, beta)), initial_state=S0.double(),
                         output_final_state=True, mode="naive")
    assert fla_refuses == ["delta_rule"]  # the trial
    assert err(o, ref) <= torch.finfo(torch.float16).eps * max(1.0, ref.abs().max().item())
    assert err(S, Sr) <= 1e-3 * max(1.0, Sr.abs().max().item())
    with pytest.raises(NotImplementedError, match="head dim 11"):
        delta_rule(q, k, v, beta, backend="fla")


def test_out_of_memory_in_a_trial_is_not_a_refusal(fla_on_cpu, monkeypatch):
    """Running out of memory says nothing about the backend: it reaches the caller and nothing is
    remembered."""
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(backends, "fla_ops", lambda: SimpleNamespace(linear_attn=oom))
    q, k, v, _, _, _ = data(T=12)
    with pytest.raises(torch.OutOfMemoryError):
        linear_attn(q, k, v)
    assert backends._trials == {}


def test_layer_trains_through_an_fla_refusal(fla_refuses, monkeypatch):
    """GatedDeltaNet in a bfloat16 model, automatic backend, fla refusing its backward: the
    layer's forward and backward run (on torch) and equal the same layer with backend torch."""
    from fastweights.layers import GatedDeltaNet

    torch.manual_seed(0)
    layer = GatedDeltaNet(32, 2, chunk_size=64).bfloat16()
    x = torch.randn(2, 70, 32, dtype=torch.bfloat16, requires_grad=True)
    y, _ = layer(x)
    y.float().square().sum().backward()
    got = [x.grad] + [p.grad for p in layer.parameters()]
    assert fla_refuses == ["gated_delta_rule"]
    layer.zero_grad()
    x2 = x.detach().clone().requires_grad_()
    monkeypatch.setenv("FASTWEIGHTS_BACKEND", "torch")
    y2, _ = layer(x2)
    y2.float().square().sum().backward()
    assert torch.equal(y, y2)
    for a, b in zip(got, [x2.grad] + [p.grad for p in layer.parameters()]):
        assert torch.equal(a, b)
