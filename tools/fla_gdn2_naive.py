#!/usr/bin/env python3
"""Run FLA's OWN GDN-2 naive reference in float64 on deltaref case files; write candidates.

    python3 tools/fla_gdn2_naive.py CASE.safetensors CAND.safetensors [CASE CAND ...] [--form recurrent|chunk] [--device cpu|cuda]

The companion of tools/fla_naive_refs.py (whose helpers it imports) for GDN-2
(`op: "gdn2"`, fla-core 0.6.0 `fla/ops/gdn2/`). Install fla-core 0.6.0 first,
e.g. `pip install --no-deps fla_core-0.6.0-py3-none-any.whl` (plus einops).

It runs `fla.ops.gdn2.naive.naive_recurrent_gdn2` (--form recurrent, the
default) or `naive_chunk_gdn2` (--form chunk, the case's `chunk_size`, 64 when
absent). Those functions cast to float32 (`.float()`, `dtype=torch.float32`);
they run here under `float64_everywhere()`, which makes `torch.float32`,
`torch.float` and `Tensor.float` mean float64 for the call (every result is
checked to be float64). What they do not take, this script does around them,
in float64 torch with autograd, the way `chunk_gdn2` does it:
- varlen: one call per sequence of `cu_seqlens` (a sequence without tokens
  passes its initial state through);
- `use_qk_l2norm_in_kernel`: FLA's `x / sqrt(Σx² + 1e-6)` on q and k;
- `use_gate_in_kernel`: FLA's own torch gates from `fla.ops.kda.gate`,
  `naive_kda_lowerbound_gate` when `lower_bound` is set (A_log optional),
  else `naive_kda_gate` (`chunk_gdn2` picks by `lower_bound`, not `safe_gate`;
  `safe_gate` changes no maths and is ignored);
- `state_v_first`: `initial_state`, `final_state`, `dht` and `dh0` are `[N, H, V, K]`.
No GVA: `chunk_gdn2` requires `v` to have as many heads as `q`.

The case's metadata `case` is a JSON object with `"op": "gdn2"` and FLA's
option names: `scale`, `use_qk_l2norm_in_kernel`, `use_gate_in_kernel`,
`lower_bound`, `safe_gate`, `state_v_first`, `chunk_size`. Tensors: `q k v g b
w` (`[B, T, H, K|V]`), optional `A_log [H]`, `dt_bias [H*K]`,
`initial_state`, `cu_seqlens`, and the upstream gradients `do`, `dht`. The loss
is Σ o·do + Σ final_state·dht; the candidate holds `o`, `final_state` and the
gradients `dq dk dv dg db dw dA_log ddt_bias dh0` (those whose input exists),
in float64.
"""

import argparse

import safetensors.torch as st
import torch

from fla_naive_refs import F64, float64_everywhere, l2norm, load, sequences

TOKEN_INPUTS = ["q", "k", "v", "g", "b", "w"]
STATE_INPUTS = ["A_log", "dt_bias", "initial_state"]
GRAD_NAME = {"A_log": "dA_log", "dt_bias": "ddt_bias", "initial_state": "dh0"}


def gate(meta, g, p):
    """The decay from the raw `g` by FLA's torch gates, in float64."""
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate

    lower_bound = meta.get("lower_bound")
    with float64_everywhere():
        if lower_bound is not None:
            return naive_kda_lowerbound_gate(
                g, p.get("A_log"), p.get("dt_bias"), lower_bound=lower_bound, output_dtype=F64
            )
        if "A_log" not in p:
            raise ValueError("use_gate_in_kernel without lower_bound needs A_log (FLA raises too)")
        return naive_kda_gate(g, p["A_log"], p.get("dt_bias"), output_dtype=F64)


def gdn2_forward(meta, x, p, seqs, form, packed):
    """(o [B,T,H,V], final_state) from FLA's naive GDN-2, one sequence at a time."""
    from fla.ops.gdn2.naive import naive_chunk_gdn2, naive_recurrent_gdn2

    q, k, v, g, b, w = (x[n] for n in TOKEN_INPUTS)
    if v.shape[2] != q.shape[2]:
        raise ValueError(f"v has {v.shape[2]} heads, q {q.shape[2]}: chunk_gdn2 has no GVA")
    if meta.get("use_qk_l2norm_in_kernel", False):
        q, k = l2norm(q), l2norm(k)
    if meta.get("use_gate_in_kernel", False):
        g = gate(meta, g, p)
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    h0 = p.get("initial_state")
    v_first = meta.get("state_v_first", False)
    if h0 is not None and v_first:
        h0 = h0.transpose(-1, -2)
    outs, finals = [], []
    for n, (bi, s, e) in enumerate(seqs):
        init = h0[n : n + 1] if h0 is not None else None
        if e == s:  # no tokens: the state passes through (the naive loops do not run)
            outs.append(v.new_zeros(1, 0, H, V))
            finals.append(init if init is not None else v.new_zeros(1, H, K, V))
            continue
        args = [a[bi : bi + 1, s:e] for a in (q, k, v, g, b, w)]
        kw = dict(scale=meta.get("scale"), initial_state=init, output_final_state=True)
        with float64_everywhere():
            if form == "chunk":
                o, ht = naive_chunk_gdn2(*args, chunk_size=meta.get("chunk_size", 64), **kw)
            else:
                o, ht = naive_recurrent_gdn2(*args, **kw)
        outs.append(o)
        finals.append(ht)
    o = torch.cat(outs, dim=1 if packed else 0)
    ht = torch.cat(finals, dim=0)
    return o, (ht.transpose(-1, -2) if v_first else ht)


def candidate(case, out, form, device):
    t, meta = load(case, device)
    if meta["op"] != "gdn2":
        raise ValueError(f"op {meta['op']!r}: this script runs FLA's GDN-2 naive reference (op gdn2)")
    x = {n: t[n].to(F64).requires_grad_() for n in TOKEN_INPUTS}
    p = {n: t[n].to(F64).requires_grad_() for n in STATE_INPUTS if n in t}
    seqs = sequences(t, x["q"].shape[0], x["q"].shape[1])
    o, ht = gdn2_forward(meta, x, p, seqs, form, "cu_seqlens" in t)
    for name, r in (("o", o), ("final_state", ht)):
        if r.dtype != F64:
            raise RuntimeError(f"{name} came back {r.dtype}: the float64 patch did not take")
    loss = (o * t["do"].to(F64)).sum()
    if "dht" in t:
        loss = loss + (ht * t["dht"].to(F64)).sum()
    loss.backward()
    cand = {"o": o, "final_state": ht}
    cand |= {GRAD_NAME.get(n, "d" + n): a.grad for n, a in (x | p).items() if a.grad is not None}
    st.save_file({n: c.detach().to(F64).contiguous().cpu() for n, c in cand.items()}, out)
    print(f"FLA naive gdn2 ({form}, float64): wrote {out}: {', '.join(sorted(cand))}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="+", metavar="CASE CAND")
    ap.add_argument("--form", choices=["recurrent", "chunk"], default="recurrent", help="which FLA naive")
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
