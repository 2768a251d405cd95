"""Analytic gradients against central finite differences of the forward
functions (float64), for every op and option family."""

from __future__ import annotations

import numpy as np
import pytest

import deltaref

H_STEP = 1e-6


def loss(forward, inputs, do, dht):
    o, ht = forward(**inputs)
    return float(np.sum(o * do) + (np.sum(ht * dht) if dht is not None else 0.0))


def check(forward, grads, inputs, do, dht, names, rng, per_tensor=6):
    """Each named input's gradient at a few random entries against
    (f(x+h) − f(x−h)) / 2h."""
    for name, gname in names.items():
        x = inputs[name]
        for flat in rng.choice(x.size, size=min(per_tensor, x.size), replace=False):
            idx = np.unravel_index(flat, x.shape)
            plus, minus = dict(inputs), dict(inputs)
            plus[name], minus[name] = x.copy(), x.copy()
            plus[name][idx] += H_STEP
            minus[name][idx] -= H_STEP
            fd = (loss(forward, plus, do, dht) - loss(forward, minus, do, dht)) / (2 * H_STEP)
            an = grads[gname][idx]
            scale = max(1.0, np.abs(grads[gname]).max())
            assert abs(fd - an) <= 1e-6 * scale, (gname, idx, fd, an)


KDA_OPTIONS = {
    "plain": dict(),
    "kda_gate_l2norm": dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True),
    "lowerbound_beta_sigmoid": dict(
        use_gate_in_kernel=True, lower_bound=-5.0, use_beta_sigmoid_in_kernel=True,
        allow_neg_eigval=True,
    ),
}


@pytest.mark.parametrize("engine", ["naive", "chunk"])
@pytest.mark.parametrize("opt", KDA_OPTIONS, ids=list(KDA_OPTIONS))
def test_kda_gradients(engine, opt):
    rng = np.random.default_rng(7)
    B, T, H, HV, K, V = 1, 11, 1, 2, 4, 3
    kw = KDA_OPTIONS[opt]
    x = dict(
        q=rng.standard_normal((B, T, H, K)),
        k=rng.standard_normal((B, T, H, K)) / 2,
        v=rng.standard_normal((B, T, HV, V)),
        g=(rng.standard_normal((B, T, HV, K)) if kw.get("use_gate_in_kernel")
           else -rng.uniform(0.01, 0.5, (B, T, HV, K))),
        beta=(rng.standard_normal((B, T, HV)) if kw.get("use_beta_sigmoid_in_kernel")
              else rng.uniform(0.1, 0.9, (B, T, HV))),
        initial_state=rng.standard_normal((B, HV, K, V)),
    )
    if kw.get("use_gate_in_kernel"):
        x["A_log"] = rng.uniform(-1, 0.5, HV)
        x["dt_bias"] = rng.standard_normal(HV * K) / 2
    do, dht = rng.standard_normal((B, T, HV, V)), rng.standard_normal((B, HV, K, V))
    fwd_fn = deltaref.naive_recurrent_kda if engine == "naive" else deltaref.chunk_kda
    bwd_fn = (deltaref.naive_recurrent_kda_backward if engine == "naive"
              else deltaref.chunk_kda_backward)
    chunk = {} if engine == "naive" else {"chunk_size": 16}

    def forward(**inp):
        return fwd_fn(**inp, output_final_state=True, **kw, **chunk)

    grads = bwd_fn(**x, do=do, dht=dht, **kw, **chunk)
    names = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "initial_state": "dh0"}
    if "A_log" in x:
        names |= {"A_log": "dA_log", "dt_bias": "ddt_bias"}
    assert set(names.values()) <= set(grads)
    check(forward, grads, x, do, dht, names, rng)


@pytest.mark.parametrize("engine", ["naive", "chunk"])
def test_dplr_gradients_varlen(engine):
    rng = np.random.default_rng(3)
    T, H, K, V = 13, 2, 4, 3
    cu = np.array([0, 6, 6, 13])
    kk = rng.standard_normal((1, T, H, K))
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    x = dict(
        q=rng.standard_normal((1, T, H, K)),
        k=rng.standard_normal((1, T, H, K)) / 2,
        v=rng.standard_normal((1, T, H, V)),
        a=-kk,
        b=kk * rng.uniform(0.2, 0.9, (1, T, H, 1)),
        gk=-rng.uniform(0.05, 0.6, (1, T, H, K)),
        initial_state=rng.standard_normal((3, H, K, V)),
    )
    do, dht = rng.standard_normal((1, T, H, V)), rng.standard_normal((3, H, K, V))
    fwd_fn = (deltaref.naive_recurrent_dplr_delta_rule if engine == "naive"
              else deltaref.chunk_dplr_delta_rule)
    bwd_fn = (deltaref.naive_recurrent_dplr_delta_rule_backward if engine == "naive"
              else deltaref.chunk_dplr_delta_rule_backward)

    def forward(**inp):
        return fwd_fn(**inp, output_final_state=True, cu_seqlens=cu)

    grads = bwd_fn(**x, do=do, dht=dht, cu_seqlens=cu)
    names = {"q": "dq", "k": "dk", "v": "dv", "a": "da", "b": "db", "gk": "dgk",
             "initial_state": "dh0"}
    check(forward, grads, x, do, dht, names, rng)


def test_token_shift_gradients_under_cp():
    rng = np.random.default_rng(5)
    x = dict(x=rng.standard_normal((1, 10, 3)), cache=rng.standard_normal((2, 3)))
    cu = np.array([0, 4, 10])
    dy, dfc = rng.standard_normal((1, 10, 3)), rng.standard_normal((2, 3))

    def forward(**inp):
        return deltaref.token_shift(inp["x"], cu, inp["cache"], output_cache=True, cp={"cuts": [3, 7]})

    grads = deltaref.token_shift_backward(x["x"], dy, dfc, cu_seqlens=cu, cache=x["cache"],
                                          cp={"cuts": [3, 7]})
    check(forward, grads, x, dy, dfc, {"x": "dx", "cache": "dcache"}, rng, per_tensor=10)


def test_cp_and_chunk_agree_with_naive():
    case = deltaref.gen("kda", lengths=[37, 1, 90], use_qk_l2norm_in_kernel=True, gate="lowerbound",
                        initial_state=True)
    t = case.tensors
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"], t["do"], t["dht"])
    kw = dict(cu_seqlens=case.cu_seqlens, initial_state=t["initial_state"],
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0,
              A_log=t.get("A_log"), dt_bias=t.get("dt_bias"))
    naive = deltaref.naive_recurrent_kda_backward(*args, **kw)
    for extra in ({"chunk_size": 16}, {"cp": {"cuts": [20, 50, 100]}},
                  {"cp": {"world": 4, "engine": "naive"}}):
        other = deltaref.chunk_kda_backward(*args, **kw, **extra)
        assert set(other) == set(naive)
        for n in naive:
            assert deltaref.norm_ratio(naive[n], other[n]) < 1e-10, (extra, n)


def test_f32_in_gives_f32_out_of_the_same_code():
    case = deltaref.gen("kda", shape=[1, 40, 2, 2, 8, 8], use_qk_l2norm_in_kernel=True)
    t = case.tensors
    names = ("q", "k", "v", "g", "beta")
    o64, ht64 = deltaref.chunk_kda(*(t[n] for n in names), output_final_state=True,
                                   use_qk_l2norm_in_kernel=True)
    o32, ht32 = deltaref.chunk_kda(*(t[n].astype(np.float32) for n in names),
                                   output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert o64.dtype == np.float64 and o32.dtype == np.float32 and ht32.dtype == np.float32
    assert 0 < deltaref.norm_ratio(o64, o32) < 1e-5
    # The f32 run is the CLI's --compute f32 on the same inputs.
    r = case.run("chunk", compute="f32")
    assert np.array_equal(r.o.astype(np.float32), o32)


class OnlyDlpack:
    """An array known only through DLPack (like a JAX array on the CPU)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


class OnlyArray:
    def __init__(self, a):
        self._a = a

    def __array__(self, dtype=None, copy=None):
        return self._a if dtype is None else self._a.astype(dtype)


def test_dlpack_and_array_protocol_inputs():
    case = deltaref.gen("dplr", shape=[1, 20, 2, 8, 8])
    t = case.tensors
    names = ("q", "k", "v", "a", "b", "gk")
    want, _ = deltaref.chunk_dplr_delta_rule(*(t[n] for n in names))
    for wrap in (OnlyDlpack, OnlyArray):
        got, _ = deltaref.chunk_dplr_delta_rule(*(wrap(t[n]) for n in names))
        assert isinstance(got, np.ndarray) and np.array_equal(got, want)
