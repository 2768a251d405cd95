"""Property tests of your own kernel with Hypothesis (issue 49).

``cases(op="kda", convention="fla", max_tokens=64)`` is a Hypothesis
strategy of valid fuzz cases for the op in the kernel's convention (any op
of ``ops()``: kda, dplr, gdn, gdn2, token_shift, causal_conv1d; the same
draws as ``deltaref fuzz``, shrunk by Hypothesis); ``check(fn, case)``
runs a callable on it and raises ``AssertionError`` with the verdict
(per-tensor and per-head errors, the likely cause) when a result fails::

    from hypothesis import given, settings
    from deltaref.testing import cases, check

    @settings(max_examples=200, deadline=None)
    @given(cases(op="gdn", convention="ggml", max_tokens=64))
    def test_my_kernel(case):
        check(my_kernel, case)          # my_kernel(dict of arrays) -> dict

``fn`` gets a dict of numpy arrays (FLA's names, the convention's layout;
``cu_seqlens`` as int64 when varlen; ``case.meta`` holds the options such as
``scale``) and returns a dict with at least ``o`` and ``final_state`` (numpy
or torch tensors).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from . import _deltaref as _core

REGIMES = ("fla-test", "long-memory", "mixed", "sharp")
EXTRAS = ("none", "slow-decay", "large-gate-in-chunk", "correlated-keys")


@dataclass
class FuzzCase:
    """One drawn case: its parameters, and its tensors in the convention's layout."""

    op: str
    convention: str
    params: dict
    dtype: str
    meta: dict = field(repr=False)
    tensors: dict = field(repr=False)

    def inputs(self) -> dict:
        """The tensors a kernel reads (copies), ``cu_seqlens`` included when varlen."""
        return {n: x.copy() for n, x in self.tensors.items()}


def convention(name: str) -> dict:
    """A built-in convention's declaration (gate space, state layout, heads, …)."""
    return json.loads(_core.convention_json(name))


def ops() -> list[str]:
    """Every operator of the registry (``deltaref gen --op``)."""
    return list(_core.op_names())


def switches(op: str) -> dict:
    """What ``deltaref fuzz`` draws for ``op``: its sizes (``heads``,
    ``value_heads``, ``v``, ``width``), switches (``gate``, ``l2norm``,
    ``beta_sigmoid``, ``initial_state``, ``activation``, ``bias``), whether
    the extra gate/key shapes apply (``extras``) and its ``regimes``."""
    return json.loads(_core.fuzz_switches(op))


def _case(op: str, conv: str, params: dict, dtype: str) -> FuzzCase:
    meta, tensors, cu = _core.fuzz_case(op, conv, json.dumps(params), dtype)
    t = dict(tensors)
    if cu is not None:
        t["cu_seqlens"] = np.asarray(cu, dtype=np.int64)
    return FuzzCase(op, conv, params, dtype, json.loads(meta), t)


def cases(op: str = "kda", convention: str = "fla", max_tokens: int = 64, max_dim: int = 8,
          dtype: str = "f32", fix: tuple[int, int, int] | None = None):
    """A Hypothesis strategy of valid cases (``FuzzCase``) for ``op`` in
    ``convention``: any operator of the registry (``ops()``), with the
    sizes and switches it has (``switches(op)``), as ``deltaref fuzz``
    draws them."""
    from hypothesis import strategies as st

    if op not in ops():
        raise ValueError(f"op: unknown op `{op}` (available: {', '.join(ops())})")
    c = globals()["convention"](convention)
    if op not in c["ops"]:
        raise ValueError(f"convention {convention} applies to op {', '.join(c['ops'])}, not {op}")
    if max_tokens < 1 or max_dim < 1:
        raise ValueError(f"max_tokens and max_dim must be >= 1, got {max_tokens}, {max_dim}")
    has = switches(op)
    if fix is not None and not has["heads"]:
        raise ValueError(f"fix=(H, K, V) pins the heads and head sizes of a delta rule; {op} has no heads")

    def switch(rule_either: bool, forced: bool):
        return st.booleans() if rule_either else st.just(forced)

    def sizes(d):
        if fix is not None:
            return fix
        h = d(st.integers(1, 3)) if has["heads"] else 1
        k = d(st.integers(1, max_dim))
        if not has["v"]:
            v = 1
        elif has["width"]:
            v = d(st.integers(1, 4))  # FLA's causal_conv1d takes widths up to 4
        elif c["k_equals_v"]:
            v = k
        else:
            v = d(st.integers(1, max_dim))
        return h, k, v

    @st.composite
    def draw(d):
        varlen = d(st.booleans()) if c["varlen"] and c["dense"] else bool(c["varlen"])
        if varlen:
            lengths = d(st.lists(st.integers(0, max_tokens), min_size=1, max_size=4)
                        .filter(lambda l: 1 <= sum(l) <= max_tokens))
        else:
            n = d(st.integers(1, 3))
            lengths = [d(st.integers(1, max(1, max_tokens // n)))] * n
        h, k, v = sizes(d)
        grouped = c["heads"] != "equal" and has["value_heads"]
        ratio = d(st.integers(1, 3)) if grouped else 1
        act = c["activation"]
        gate = has["gate"] and d(switch(act == "either", act == "raw"))
        beta_sigmoid = has["beta_sigmoid"] and (act == "raw" or d(switch(act == "either", False)))
        l2norm = has["l2norm"] and d(switch(c["l2norm"] == "either", c["l2norm"] == "inside"))
        extras = has["extras"] and not gate
        return {
            "lengths": lengths, "varlen": varlen, "h": h, "hv": h * ratio, "k": k, "v": v,
            "regime": d(st.sampled_from(has["regimes"])),
            "extra": d(st.sampled_from(EXTRAS)) if extras else "none",
            "gate": gate, "l2norm": l2norm, "beta_sigmoid": beta_sigmoid,
            "initial_state": has["initial_state"] and d(st.booleans()),
            "activation": has["activation"] and d(st.booleans()),
            "bias": has["bias"] and d(st.booleans()),
            "seed": d(st.integers(0, 2**63 - 1)),
        }

    return draw().map(lambda p: _case(op, convention, p, dtype))


def _numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def check(fn: Callable[[dict], Mapping[str, Any]], case: FuzzCase, tolerance: float = 1e-4) -> dict:
    """Runs ``fn`` on ``case`` and judges its results against the float64
    truth (FLA's ``assert_close``: max_abs <= 1e-6 or norm_ratio < tolerance).
    Returns the verdict; raises ``AssertionError`` with it when a tensor fails."""
    out = fn(case.inputs())
    results = {n: _numpy(x) for n, x in dict(out).items()}
    text, ok = _core.fuzz_judge(case.op, case.convention, json.dumps(case.params), case.dtype,
                                results, float(tolerance))
    verdict = json.loads(text)
    if not ok:
        raise AssertionError(_describe(case, verdict))
    return verdict


def _describe(case: FuzzCase, v: dict) -> str:
    lines = [f"{case.op} in convention {case.convention} fails on {case.params}"]
    if v.get("runner_error"):
        lines.append(f"  error: {v['runner_error']}")
    for c in v["verdict"]["checks"]:
        if not c["pass"]:
            why = c["problem"] or (f"norm_ratio {c['norm_ratio']:.3e}, max_abs {c['max_abs']:.3e}, "
                                   f"per head {['%.1e' % x for x in c['per_head']]}")
            lines.append(f"  {c['name']}: {why}")
    cause = v["verdict"].get("cause")
    lines.append(f"  likely cause: {cause['sentence']}" if cause else
                 "  likely cause: none of the usual convention mistakes explains it")
    return "\n".join(lines)
