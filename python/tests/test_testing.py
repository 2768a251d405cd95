"""deltaref.testing: Hypothesis strategies draw only valid cases, a correct
kernel passes `check`, a planted head-mapping fault is caught and named."""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="deltaref.testing needs hypothesis (pip install hypothesis)")
from hypothesis import given, settings  # noqa: E402

from deltaref import testing  # noqa: E402

PAIRS = [(c, op) for c in ("fla", "flashkda", "flashinfer-gdn", "flashqla", "opengdn", "ggml")
         for op in testing.convention(c)["ops"]]


def gdn_ggml_numpy(t: dict, tiled: bool = True) -> dict:
    """ggml's GATED_DELTA_NET in numpy (float64): state [B,HV,V,K], value
    head j reads q/k head j % H (or, with tiled=False, FLA's j // (HV/H)),
    scale K^-0.5, g natural log, beta linear, dense batch."""
    q, k, v, g, beta = (t[n] for n in ("q", "k", "v", "g", "beta"))
    b, T, h, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    s0 = t.get("initial_state")
    state = np.zeros((b, hv, vd, kd)) if s0 is None else s0.copy()
    o = np.zeros((b, T, hv, vd))
    for n in range(b):
        for j in range(hv):
            i = j % h if tiled else j // (hv // h)
            m = state[n, j]  # [V, K] = FLA's S transposed
            for s in range(T):
                m = m * np.exp(g[n, s, j])
                delta = (v[n, s, j] - m @ k[n, s, i]) * beta[n, s, j]
                m = m + np.outer(delta, k[n, s, i])
                o[n, s, j] = m @ q[n, s, i] * kd ** -0.5
            state[n, j] = m
    return {"o": o, "final_state": state}


@pytest.mark.parametrize("conv,op", PAIRS)
def test_strategies_draw_only_valid_cases(conv, op):
    # Building a case runs the oracle's own validation and the convention's check.
    @settings(max_examples=40, deadline=None)
    @given(testing.cases(op=op, convention=conv, max_tokens=24))
    def draws(case):
        first = "x" if op in ("token_shift", "causal_conv1d") else "q"
        assert first in case.tensors and case.meta["op"] == op

    draws()


def test_cases_draw_every_op_of_the_registry_with_its_own_switches():
    """Every registry op, not only the KDA/GDN-shaped ones: each drawn case
    has only the sizes and switches its op has (no heads for token-shift or
    conv, no gate for DPLR's `lower_bound`-free draws unless the op has one,
    a conv width of 1 to 4), and together the draws reach the op's own
    switches (conv's SiLU and bias)."""
    names = testing.ops()
    assert {"kda", "dplr", "gdn", "gdn2", "token_shift", "causal_conv1d"} <= set(names)
    for op in names:
        has = testing.switches(op)
        seen = []

        @settings(max_examples=30, deadline=None)
        @given(testing.cases(op=op, convention="fla", max_tokens=24))
        def draws(case):
            p = case.params
            assert case.meta["op"] == op
            assert has["heads"] or p["h"] == p["hv"] == 1, p
            assert has["v"] or p["v"] == 1, p
            assert not has["width"] or 1 <= p["v"] <= 4, p
            for s in ("gate", "l2norm", "beta_sigmoid", "initial_state", "activation", "bias"):
                assert has[s] or not p[s], (s, p)
            assert p["regime"] in has["regimes"], p
            seen.append(p)

        draws()
        assert seen, op
        if op == "causal_conv1d":
            assert any(p["activation"] for p in seen) and any(p["bias"] for p in seen)


@settings(max_examples=60, deadline=None)
@given(testing.cases(op="gdn", convention="ggml", max_tokens=16))
def test_a_correct_kernel_passes_check(case):
    verdict = testing.check(gdn_ggml_numpy, case)
    assert not verdict["verdict"]["failing"]


@settings(max_examples=60, deadline=None)
@given(testing.cases(op="gdn", convention="ggml", max_tokens=16))
def test_the_grouped_head_mapping_under_ggml_is_caught_and_named(case):
    p = case.params
    wrong = lambda t: gdn_ggml_numpy(t, tiled=False)  # noqa: E731
    if p["hv"] > p["h"] > 1:
        with pytest.raises(AssertionError, match=r"`j // \(HV/H\)` \(grouped\)"):
            testing.check(wrong, case)
    else:
        testing.check(wrong, case)  # without GVA both mappings agree


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="unknown `nope`"):
        testing.convention("nope")
    with pytest.raises(ValueError, match="applies to op kda"):
        testing.cases(op="gdn", convention="flashkda")
    with pytest.raises(ValueError, match="unknown op `nope`"):
        testing.cases(op="nope")
    with pytest.raises(ValueError, match="has no heads"):
        testing.cases(op="token_shift", fix=(2, 8, 8))


def test_verify_forward_only_and_allow_partial():
    """``verify(forward_only=, allow_partial=)`` as the CLI's flags: a
    forward-only candidate passes on its outputs, a partial one lists the
    tensors it lacks as unchecked."""
    import deltaref as dr
    from conftest import FIXTURES

    case = dr.read_case(next(p for p in FIXTURES if p.stem == "kda_small"))
    truth = case.run()
    fwd = {n: truth[n] for n in ("o", "final_state") if n in truth}
    assert not dr.verify(case, fwd).passed
    r = dr.verify(case, fwd, forward_only=True)
    assert r.passed and r.forward_only
    r = dr.verify(case, fwd, allow_partial=True)
    assert r.passed and "dq" in r.unchecked
