"""deltaref.torch: autograd wrappers whose .backward() gives the analytic
float64 gradients. Skipped (visibly) where PyTorch is not installed."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the autograd wrappers are untested here")

import deltaref  # noqa: E402
import deltaref.torch as dt  # noqa: E402


def kda_inputs(seed=0, B=1, T=9, H=1, HV=2, K=4, V=3, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    return dict(
        q=r(B, T, H, K), k=r(B, T, H, K) / 2, v=r(B, T, HV, V), g=r(B, T, HV, K),
        beta=r(B, T, HV), A_log=r(HV) / 2, dt_bias=r(HV * K) / 2, initial_state=r(B, HV, K, V),
    )


OPTS = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def test_kda_backward_equals_the_companion():
    x = {n: t.clone().requires_grad_() for n, t in kda_inputs().items()}
    o, ht = dt.chunk_kda(**x, output_final_state=True, chunk_size=16, **OPTS)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    ((o * do).sum() + (ht * dht).sum()).backward()
    want = deltaref.chunk_kda_backward(**{n: t.detach() for n, t in x.items()}, do=do, dht=dht,
                                       chunk_size=16, **OPTS)
    assert torch.equal(o.detach(), want.o) and torch.equal(ht.detach(), want.final_state)
    grad = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "A_log": "dA_log",
            "dt_bias": "ddt_bias", "initial_state": "dh0"}
    for n, g in grad.items():
        assert torch.equal(x[n].grad, want[g]), n


def test_kda_gradcheck_against_finite_differences():
    x = {n: t.requires_grad_() for n, t in kda_inputs(seed=1, T=6).items()}
    names = list(x)

    def f(*ts):
        return dt.naive_recurrent_kda(**dict(zip(names, ts)), output_final_state=True, **OPTS)

    assert torch.autograd.gradcheck(f, tuple(x.values()), eps=1e-6, atol=1e-7, rtol=1e-6)


def test_dplr_and_token_shift_gradcheck():
    gen = torch.Generator().manual_seed(2)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    kk = torch.nn.functional.normalize(r(1, 7, 1, 4), dim=-1)
    d = dict(q=r(1, 7, 1, 4), k=r(1, 7, 1, 4) / 2, v=r(1, 7, 1, 3), a=-kk,
             b=kk * torch.sigmoid(r(1, 7, 1, 1)), gk=-0.6 * torch.sigmoid(r(1, 7, 1, 4)),
             initial_state=r(1, 1, 4, 3))
    d = {n: t.requires_grad_() for n, t in d.items()}
    names = list(d)
    f = lambda *ts: dt.chunk_dplr_delta_rule(**dict(zip(names, ts)), output_final_state=True)  # noqa: E731
    assert torch.autograd.gradcheck(f, tuple(d.values()), eps=1e-6, atol=1e-7, rtol=1e-6)
    x, cache = r(1, 8, 3).requires_grad_(), r(2, 3).requires_grad_()
    cu = torch.tensor([0, 3, 8])
    g = lambda x, c: dt.token_shift(x, cu, c, output_cache=True)  # noqa: E731
    assert torch.autograd.gradcheck(g, (x, cache), eps=1e-6, atol=1e-7, rtol=1e-6)


def test_float32_and_device_are_kept():
    x = {n: t.float().requires_grad_() for n, t in kda_inputs().items()}
    o, ht = dt.chunk_kda(**x, output_final_state=True, **OPTS)
    assert o.dtype == torch.float32 and ht.dtype == torch.float32
    o.sum().backward()
    assert x["q"].grad.dtype == torch.float32
    if torch.cuda.is_available():
        y = {n: t.detach().cuda().requires_grad_() for n, t in kda_inputs().items()}
        o, _ = dt.chunk_kda(**y, **OPTS)
        o.sum().backward()
        assert o.device.type == "cuda" and y["g"].grad.device.type == "cuda"


def test_functions_take_torch_tensors_and_return_torch_tensors():
    x = kda_inputs()
    o, ht = deltaref.naive_recurrent_kda(**x, output_final_state=True, **OPTS)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.float64
    with pytest.raises(ValueError, match="tensor `q`: dtype torch.bfloat16"):
        deltaref.chunk_kda(**(x | {"q": x["q"].bfloat16()}), **OPTS)
