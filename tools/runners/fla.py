"""FLA (fla-core 0.6.0): the chunked kernels of every op (forward and
backward, through `tools/fla_candidate.py`) and the fused recurrent KDA and
GDN kernels (forward).

FLA 0.6.0 may hand a call to another backend (FlashKDA, FlashQLA, TileLang)
when one is installed and accepts it (`fla/backends.py`); each result says
what served it, from the `fla.backends` log ("[FLA Backend] … -> …"). Set
FLA_DISABLE_BACKEND_DISPATCH=1 before the import for FLA's own Triton kernels.
"""

import logging
import os
import sys

import torch

from .common import grads, token_dtype

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import fla_candidate  # noqa: E402
import fla_gdn2_chunk  # noqa: E402

CONVENTION = "fla"


class Served(logging.Handler):
    """Collects the `fla.backends` log lines of one call."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def __enter__(self):
        log = logging.getLogger("fla.backends")
        log.setLevel(logging.INFO)
        log.addHandler(self)
        return self

    def __exit__(self, *_):
        logging.getLogger("fla.backends").removeHandler(self)

    def said(self, default):
        hits = [m.split("] ", 1)[-1] for m in self.lines if "rejected" not in m]
        return "; ".join(hits) if hits else default


def chunk_why_not(meta, t):
    if meta["op"] not in fla_candidate.TOKEN_INPUTS:
        return f"fla_candidate.py has no {meta['op']}"
    return None


def chunk_run(meta, t):
    op = meta["op"]
    first = fla_candidate.TOKEN_INPUTS[op][0]
    with Served() as s:
        x, p, out, last, total = fla_candidate.run(op, meta, t, token_dtype(t, first))
        total.backward()
    names = fla_candidate.RESULT_NAMES.get(op, ("o", "final_state"))
    return {names[0]: out, names[1]: last} | grads(x | p), s.said(f"triton chunk ({op})")


def chunk_fwd_run(meta, t):
    """The chunked kernel's forward alone: `o` and `final_state` (for a
    backward FLA refuses to run on this machine)."""
    op = meta["op"]
    first = fla_candidate.TOKEN_INPUTS[op][0]
    dt = token_dtype(t, first)
    x = {n: t[n].to(dt) for n in fla_candidate.TOKEN_INPUTS[op]}
    p = {n: t[n].float() for n in fla_candidate.STATE_INPUTS[op] if n in t}
    with torch.no_grad(), Served() as s:
        out, last = fla_candidate.forward(op, meta, x, p, t.get("cu_seqlens"))
    names = fla_candidate.RESULT_NAMES.get(op, ("o", "final_state"))
    return {names[0]: out, names[1]: last}, s.said(f"triton chunk forward ({op})")


def recurrent_why_not(meta, t):
    if meta["op"] not in ("kda", "gdn"):
        return "fused_recurrent exists for KDA and GDN"
    if meta.get("cp"):
        return "no CP in the fused recurrent path"
    return None


def recurrent_run(meta, t):
    """Forward only: `o` and `final_state`."""
    op = meta["op"]
    dt = token_dtype(t)
    x = {n: t[n].to(dt) for n in ("q", "k", "v", "g", "beta")}
    opts = dict(
        scale=meta.get("scale"),
        initial_state=t["initial_state"].float() if "initial_state" in t else None,
        output_final_state=True,
        use_qk_l2norm_in_kernel=meta.get("use_qk_l2norm_in_kernel", False),
        cu_seqlens=t.get("cu_seqlens"),
    )
    with torch.no_grad(), Served() as s:
        if op == "kda":
            from fla.ops.kda import fused_recurrent_kda

            gate = meta.get("gate", "none")
            if gate != "none":
                opts |= dict(use_gate_in_kernel=True, A_log=t.get("A_log"), dt_bias=t.get("dt_bias"),
                             lower_bound=meta.get("lower_bound") if gate == "lowerbound" else None)
            if meta.get("use_beta_sigmoid_in_kernel"):
                opts["use_beta_sigmoid_in_kernel"] = True
            o, ht = fused_recurrent_kda(**x, **opts)
        else:
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

            if meta.get("use_gate_in_kernel"):
                opts |= dict(use_gate_in_kernel=True, A_log=t.get("A_log"), dt_bias=t.get("dt_bias"))
            if meta.get("use_beta_sigmoid_in_kernel"):
                opts["use_beta_sigmoid_in_kernel"] = True
            o, ht = fused_recurrent_gated_delta_rule(**x, **opts)
    return {"o": o, "final_state": ht}, s.said(f"triton fused_recurrent ({op})")


def gdn2_why_not(meta, t):
    return None if meta["op"] == "gdn2" else "chunk_gdn2 runs GDN-2"


def gdn2_run(meta, t):
    """FLA's `chunk_gdn2`, forward and backward, through tools/fla_gdn2_chunk.py."""
    with Served() as s:
        x, p, o, ht, total = fla_gdn2_chunk.run(meta, t, token_dtype(t))
        total.backward()
    return {"o": o, "final_state": ht} | grads(x | p), s.said("triton chunk_gdn2")
