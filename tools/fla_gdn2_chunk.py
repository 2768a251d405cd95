#!/usr/bin/env python3
"""Run FLA 0.6.0's `chunk_gdn2` kernels (bf16 by default) on deltaref GDN-2 case files; write candidates.

    python3 tools/fla_gdn2_chunk.py CASE.safetensors CAND.safetensors [CASE CAND ...] [--dtype bf16|f32] [--time N]
    deltaref verify --case CASE.safetensors --candidate CAND.safetensors

The GDN-2 companion of tools/fla_candidate.py (whose `load` and `Phases` it
imports): one process for all cases, so Triton compiles and autotunes each
kernel variant once. Install fla-core 0.6.0 first (`pip install --no-deps
fla_core-0.6.0-py3-none-any.whl`, plus einops). Needs a CUDA GPU.

For each case (`"op": "gdn2"`, FLA's option names in its `case` metadata)
it calls, forward and backward,

    chunk_gdn2(q, k, v, g, b, w, scale=..., initial_state=h0 (fp32),
               output_final_state=True, use_qk_l2norm_in_kernel=...,
               use_gate_in_kernel=..., cu_seqlens=..., safe_gate=...,
               lower_bound=... (only with use_gate_in_kernel),
               state_v_first=..., A_log=..., dt_bias=...)

with the token tensors (`q k v g b w` and `do`) in --dtype (default: the
dtype the case stores `q` in if bf16, else f32) and `A_log`, `dt_bias`,
`initial_state`, `dht` in fp32, as FLA requires. The loss is the case's,
Σ o·do + Σ final_state·dht; the candidate holds `o`, `final_state` and every
gradient whose input exists (`dq dk dv dg db dw dA_log ddt_bias dh0`), in
float32. FLA's chunk size is 64 whatever the case says (FLA refuses any
other); FLA's `chunk_gdn2` has no GVA (v has q's heads).

Autotuning keys include (H, K, V) and the gate variant: keep every case at
H = 4 and K = V = 64 (or 128) so that a batch triggers few variants, and keep
TRITON_CACHE_DIR between runs (see tools/fla_candidate.py's notes).
"""

import argparse
import time

import safetensors.torch as st
import torch

from fla_candidate import GRAD_NAME, Phases, load

TOKEN_INPUTS = ["q", "k", "v", "g", "b", "w"]
STATE_INPUTS = ["A_log", "dt_bias", "initial_state"]
PINNED = {(4, 64, 64), (4, 128, 128)}


def options(meta, p):
    """`chunk_gdn2`'s keyword arguments for a case's options and fp32 parameters `p`."""
    gate = meta.get("use_gate_in_kernel", False)
    kw = dict(
        scale=meta.get("scale"),
        use_qk_l2norm_in_kernel=meta.get("use_qk_l2norm_in_kernel", False),
        use_gate_in_kernel=gate,
        safe_gate=meta.get("safe_gate", False),
        state_v_first=meta.get("state_v_first", False),
    )
    if gate:
        kw |= dict(lower_bound=meta.get("lower_bound"), A_log=p.get("A_log"), dt_bias=p.get("dt_bias"))
    return kw


def run(meta, t, dtype):
    """FLA's forward on the case; returns (inputs, parameters, o, final_state, loss)."""
    from fla.ops.gdn2 import chunk_gdn2

    x = {n: t[n].to(dtype).requires_grad_() for n in TOKEN_INPUTS}
    p = {n: t[n].float().requires_grad_() for n in STATE_INPUTS if n in t}
    o, ht = chunk_gdn2(
        x["q"], x["k"], x["v"], x["g"], x["b"], x["w"],
        initial_state=p.get("initial_state"),
        output_final_state=True,
        cu_seqlens=t.get("cu_seqlens"),
        **options(meta, p),
    )
    loss = (o.float() * t["do"].to(dtype).float()).sum()
    if "dht" in t:
        loss = loss + (ht.float() * t["dht"].float()).sum()
    return x, p, o, ht, loss


def candidate(case, out, dtype_name, reps):
    ph = Phases(case)
    t, meta = load(case)
    ph.done("load")
    if meta["op"] != "gdn2":
        raise ValueError(f"op {meta['op']!r}: this script runs FLA's chunk_gdn2 (op gdn2)")
    H, K, V = t["q"].shape[2], t["q"].shape[3], t["v"].shape[3]
    if (H, K, V) not in PINNED:
        print(f"  note: H={H}, K={K}, V={V} is not one of the pinned {sorted(PINNED)}: a new autotune key")
    if meta.get("chunk_size", 64) != 64:
        print(f"  note: the case says chunk_size {meta['chunk_size']}; FLA's chunk_gdn2 runs 64")
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}.get(
        dtype_name, torch.bfloat16 if t["q"].dtype == torch.bfloat16 else torch.float32
    )
    x, p, o, ht, loss = run(meta, t, dtype)
    ph.done("forward")
    loss.backward()
    ph.done("backward")
    cand = {"o": o, "final_state": ht}
    cand |= {GRAD_NAME.get(n, "d" + n): a.grad for n, a in (x | p).items() if a.grad is not None}
    st.save_file({n: c.detach().float().contiguous().cpu() for n, c in cand.items()}, out)
    print(f"FLA chunk_gdn2 ({dtype}): wrote {out}: {', '.join(sorted(cand))}", flush=True)
    if reps > 0:
        best_f = best_b = float("inf")
        for _ in range(reps):
            s, m, e = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            s.record()
            *_, loss = run(meta, t, dtype)
            m.record()
            loss.backward()
            e.record()
            torch.cuda.synchronize()
            best_f, best_b = min(best_f, s.elapsed_time(m)), min(best_b, m.elapsed_time(e))
        print(f"FLA chunk_gdn2 ({dtype}) best of {reps}: forward {best_f:.3f} ms, backward {best_b:.3f} ms")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="+", metavar="CASE CAND")
    ap.add_argument("--dtype", choices=["bf16", "f32"])
    ap.add_argument("--time", type=int, default=0, metavar="N")
    a = ap.parse_args()
    if len(a.paths) % 2:
        ap.error("give case/candidate pairs: CASE CAND [CASE CAND ...]")
    failed, start = 0, time.time()
    pairs = list(zip(a.paths[::2], a.paths[1::2]))
    for i, (case, out) in enumerate(pairs):
        print(f"case {i + 1}/{len(pairs)}: {case}", flush=True)
        try:
            candidate(case, out, a.dtype, a.time)
        except Exception as e:  # one failing case must not hide the others
            failed += 1
            print(f"FLA chunk_gdn2 failed on {case}: {type(e).__name__}: {e}", flush=True)
    print(f"{len(pairs) - failed}/{len(pairs)} cases in {time.time() - start:.0f} s")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
