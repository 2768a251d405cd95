"""Shared helpers: the committed fixtures, the `deltaref` CLI, and calls of
the FLA-named functions with a case's tensors and options."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import deltaref

REPO = Path(__file__).resolve().parents[2]
FIXTURES = sorted((REPO / "fixtures").glob("*.safetensors"))
# The package has FLA-named functions for these ops only; GDN and causal
# conv1d cases go through `Case.run` / `deltaref.verify` like the CLI.
FLA_FUNCTION_OPS = ("kda", "dplr", "token_shift")
FUNCTION_FIXTURES = [p for p in FIXTURES if deltaref.read_case(p).op in FLA_FUNCTION_OPS]


def cli_path() -> Path:
    p = Path(os.environ.get("DELTAREF_BIN", REPO / "target" / "release" / "deltaref"))
    if not p.exists():
        pytest.skip(
            f"the deltaref CLI is not built at {p}: run `cargo build --release -p deltaref-verify` "
            "or set DELTAREF_BIN"
        )
    return p


@pytest.fixture
def cli():
    """Runs the CLI; returns the CompletedProcess (text mode)."""
    exe = cli_path()

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True)

    return run


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return a.shape == b.shape and np.array_equal(a.view(np.uint64), b.view(np.uint64))


def fla_kwargs(case: deltaref.Case) -> dict:
    """The FLA keyword arguments that express a case's inputs and options."""
    m, t = case.meta, case.tensors
    kw = {"scale": m.get("scale"), "initial_state": t.get("initial_state")}
    if case.cu_seqlens is not None:
        kw["cu_seqlens"] = np.asarray(case.cu_seqlens, dtype=np.int64)
    if case.op == "kda":
        gate = m.get("gate", "none")
        kw.update(
            use_qk_l2norm_in_kernel=m.get("use_qk_l2norm_in_kernel", False),
            use_gate_in_kernel=gate != "none",
            lower_bound=m.get("lower_bound") if gate == "lowerbound" else None,
            use_beta_sigmoid_in_kernel=m.get("use_beta_sigmoid_in_kernel", False),
            allow_neg_eigval=m.get("allow_neg_eigval", False),
            A_log=t.get("A_log"),
            dt_bias=t.get("dt_bias"),
        )
    return kw


def backward_of(case: deltaref.Case, engine: str, upstream=True, **extra) -> deltaref.Results:
    """Outputs and gradients of a case through the FLA-named `*_backward`
    companion of `engine` ("naive" or "chunk"); the outputs alone (forward
    pass only) without `upstream`."""
    t = dict(case.tensors)
    if not upstream:
        t["do"] = t["dy"] = None
    if case.op == "token_shift":
        extra.pop("chunk_size", None)  # token-shift has no chunked engine
        return deltaref.token_shift_backward(
            t["x"], t["dy"], t.get("dfinal_cache") if upstream else None, cu_seqlens=fla_kwargs(case).get("cu_seqlens"),
            cache=t.get("cache"), **extra,
        )
    kw = fla_kwargs(case) | extra
    if case.op == "kda":
        fn = deltaref.naive_recurrent_kda_backward if engine == "naive" else deltaref.chunk_kda_backward
        return fn(t["q"], t["k"], t["v"], t["g"], t["beta"], t["do"], t.get("dht") if upstream else None, **kw)
    fn = (
        deltaref.naive_recurrent_dplr_delta_rule_backward
        if engine == "naive"
        else deltaref.chunk_dplr_delta_rule_backward
    )
    return fn(t["q"], t["k"], t["v"], t["a"], t["b"], t["gk"], t["do"], t.get("dht") if upstream else None, **kw)
