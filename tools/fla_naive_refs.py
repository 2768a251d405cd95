#!/usr/bin/env python3
"""Run FLA's OWN naive references in float64 on deltaref case files; write candidates.

    python3 tools/fla_naive_refs.py CASE.safetensors CAND.safetensors [CASE CAND ...] [--form recurrent|chunk] [--device cpu|cuda]
    deltaref verify --case CASE.safetensors --candidate CAND.safetensors --max-ratio 1e-10

GDN (`op: "gdn"`) runs fla-core's `fla.ops.gated_delta_rule.naive`:
`naive_recurrent_gated_delta_rule` (--form recurrent, the default) or
`naive_chunk_gated_delta_rule` (--form chunk, the case's `chunk_size`, 64 when
absent), and the in-kernel gate through `fla.ops.gated_delta_rule.gate.naive_gdn_gate`.
Those functions cast to float32 (`.to(torch.float32)`, `.float()`,
`dtype=torch.float`); they run here under `float64_everywhere()`, which makes
`torch.float32`, `torch.float` and `Tensor.float` mean float64 for the call
(every result is checked to be float64). What the naive functions do not
take, this script does around them, in float64 torch with autograd:
varlen (one call per sequence of `cu_seqlens`), GVA (q/k head h repeated for
value heads h·G … h·G+G−1, FLA's convention), `use_qk_l2norm_in_kernel`
(FLA's `x / sqrt(Σx² + 1e-6)`), `use_beta_sigmoid_in_kernel` (`sigmoid(beta)`,
`2·sigmoid` with `allow_neg_eigval`) and `state_v_first` (states transposed).

Causal conv1d (`op: "causal_conv1d"`): fla-core 0.6.0 ships no torch reference
in `fla/modules/causal_conv1d/` (only Triton, CUDA and CP kernels), so the
reference is torch's own `F.conv1d` (depthwise, `groups=D`) over each sequence
extended on the left by its `initial_state [N, D, W]` (zeros when absent), plus
bias and SiLU, in float64; `final_state` is the last W columns of that extended
sequence — FLA's documented semantics.

The loss is the case's: Σ o·do + Σ final_state·dht (conv: Σ y·dy + Σ final_state·dht);
gradients come from autograd. Candidates are written in float64.
"""

import argparse
import contextlib
import json

import safetensors
import safetensors.torch as st
import torch
import torch.nn.functional as F

F64 = torch.float64
TOKEN_INPUTS = {
    "gdn": ["q", "k", "v", "g", "beta"],
    "causal_conv1d": ["x"],
}
STATE_INPUTS = {
    "gdn": ["A_log", "dt_bias", "initial_state"],
    "causal_conv1d": ["weight", "bias", "initial_state"],
}
GRAD_NAME = {"A_log": "dA_log", "dt_bias": "ddt_bias", "initial_state": "dh0"}
RESULTS = {"gdn": ("o", "final_state"), "causal_conv1d": ("y", "final_state")}
UPSTREAM = {"gdn": ("do", "dht"), "causal_conv1d": ("dy", "dht")}


@contextlib.contextmanager
def float64_everywhere():
    """`torch.float32`, `torch.float` and `Tensor.float()` mean float64 inside."""
    saved = (torch.float32, torch.float, torch.Tensor.float)
    torch.float32 = torch.float = F64
    torch.Tensor.float = lambda self, *a, **k: self.to(F64)
    try:
        yield
    finally:
        torch.float32, torch.float, torch.Tensor.float = saved


def load(path, device):
    t = st.load_file(path, device=device)
    with safetensors.safe_open(path, "pt") as f:
        meta = json.loads(f.metadata()["case"])
    return t, meta


def sequences(t, n_rows, length):
    """(batch row, start, end) of each sequence (varlen: B = 1)."""
    cu = t.get("cu_seqlens")
    if cu is None:
        return [(b, 0, length) for b in range(n_rows)]
    cu = cu.tolist()
    return [(0, s, e) for s, e in zip(cu[:-1], cu[1:])]


def l2norm(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def candidate(case, out, form, device):
    t, meta = load(case, device)
    op = meta["op"]
    if op not in TOKEN_INPUTS:
        raise ValueError(f"op {op!r}: this script runs FLA's naive references of gdn and causal_conv1d")
    x = {n: t[n].to(F64).requires_grad_() for n in TOKEN_INPUTS[op]}
    p = {n: t[n].to(F64).requires_grad_() for n in STATE_INPUTS[op] if n in t}
    first = x[TOKEN_INPUTS[op][0]]
    seqs = sequences(t, first.shape[0], first.shape[1])
    packed = "cu_seqlens" in t
    if op == "gdn":
        main, last = gdn_forward(meta, x, p, seqs, form, packed)
    else:
        main, last = conv_forward(meta, x, p, seqs, packed)
    for name, r in zip(RESULTS[op], (main, last)):
        if r.dtype != F64:
            raise RuntimeError(f"{name} came back {r.dtype}: the float64 patch did not take")
    d_main, d_last = UPSTREAM[op]
    loss = (main * t[d_main].to(F64)).sum()
    if d_last in t:
        loss = loss + (last * t[d_last].to(F64)).sum()
    loss.backward()
    cand = dict(zip(RESULTS[op], (main, last)))
    cand |= {GRAD_NAME.get(n, "d" + n): a.grad for n, a in (x | p).items() if a.grad is not None}
    st.save_file({n: v.detach().to(F64).contiguous().cpu() for n, v in cand.items()}, out)
    print(f"FLA naive {op} ({form if op == 'gdn' else 'F.conv1d'}, float64): wrote {out}: {', '.join(sorted(cand))}")


def gdn_forward(meta, x, p, seqs, form, packed):
    """(o [B,T,HV,V], final_state) from FLA's naive GDN, one sequence at a time."""
    from fla.ops.gated_delta_rule.gate import naive_gdn_gate
    from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule

    q, k, v, g, beta = (x[n] for n in TOKEN_INPUTS["gdn"])
    if meta.get("use_qk_l2norm_in_kernel", False):
        q, k = l2norm(q), l2norm(k)
    if meta.get("use_beta_sigmoid_in_kernel", False):
        beta = torch.sigmoid(beta) * (2.0 if meta.get("allow_neg_eigval", False) else 1.0)
    if meta.get("use_gate_in_kernel", False):
        with float64_everywhere():
            g = naive_gdn_gate(g, p["A_log"], p.get("dt_bias"), output_dtype=F64)
    groups = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    HV, K, V = v.shape[2], k.shape[-1], v.shape[-1]
    h0 = p.get("initial_state")
    v_first = meta.get("state_v_first", False)
    if h0 is not None and v_first:
        h0 = h0.transpose(-1, -2)
    outs, finals = [], []
    for n, (b, s, e) in enumerate(seqs):
        init = h0[n : n + 1] if h0 is not None else None
        if e == s:  # no tokens: the state passes through (the naive loops do not run)
            outs.append(v.new_zeros(1, 0, HV, V))
            finals.append(init if init is not None else v.new_zeros(1, HV, K, V))
            continue
        qq, kk, vv, gg, bb = (a[b : b + 1, s:e] for a in (q, k, v, g, beta))
        with float64_everywhere():
            if form == "chunk":
                o, ht = naive_chunk_gated_delta_rule(
                    qq, kk, vv, gg, bb, chunk_size=meta.get("chunk_size", 64),
                    scale=meta.get("scale"), initial_state=init, output_final_state=True,
                )
            else:
                o, ht = naive_recurrent_gated_delta_rule(
                    qq, kk, vv, bb, gg, scale=meta.get("scale"), initial_state=init, output_final_state=True,
                )
        outs.append(o)
        finals.append(ht)
    o = torch.cat(outs, dim=1 if packed else 0)
    ht = torch.cat(finals, dim=0)
    return o, (ht.transpose(-1, -2) if v_first else ht)


def conv_forward(meta, x, p, seqs, packed):
    """(y [B,T,D], final_state [N,D,W]) by torch's F.conv1d over each extended sequence."""
    xx, w = x["x"], p["weight"]
    D, W = w.shape
    act = meta.get("activation", "none")
    if act not in ("none", "silu", "swish"):
        raise ValueError(f"unknown activation {act!r}")
    h0 = p.get("initial_state")
    ys, finals = [], []
    for n, (b, s, e) in enumerate(seqs):
        seq = xx[b, s:e].transpose(0, 1)  # [D, L]
        prefix = h0[n] if h0 is not None else xx.new_zeros(D, W)
        ext = torch.cat([prefix, seq], dim=1)  # [D, W + L]
        # y_t = Σ_i w[:, i]·ext[:, t + 1 + i]: drop ext's oldest column, convolve unpadded.
        y = F.conv1d(ext[None, :, 1:], w[:, None, :], bias=p.get("bias"), groups=D)[0]
        if act != "none":
            y = F.silu(y)
        ys.append(y.transpose(0, 1))
        finals.append(ext[:, ext.shape[1] - W :])
    y = torch.cat(ys, dim=0)[None] if packed else torch.stack(ys, dim=0)
    return y, torch.stack(finals, dim=0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="+", metavar="CASE CAND")
    ap.add_argument("--form", choices=["recurrent", "chunk"], default="recurrent", help="GDN: which FLA naive")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    if len(a.paths) % 2:
        ap.error("give case/candidate pairs: CASE CAND [CASE CAND ...]")
    failed = 0
    for case, out in zip(a.paths[::2], a.paths[1::2]):
        try:
            candidate(case, out, a.form, a.device)
        except Exception as e:  # one failing case must not hide the others
            failed += 1
            print(f"FLA naive failed on {case}: {type(e).__name__}: {e}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
