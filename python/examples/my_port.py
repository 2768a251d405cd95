"""A stand-in for "your kernel": KDA's forward in float32 NumPy, FLA's conventions.

    python python/examples/my_port.py CASE.safetensors CANDIDATE.safetensors

Reads the inputs of a deltaref case file, runs the recurrence token by token in
float32 and writes `o` and `final_state` as a candidate file that
`deltaref verify --case CASE --candidate CANDIDATE --forward-only` judges.
Replace `kda_forward` with a call into your own port.
"""

import sys

import numpy as np

import deltaref


def kda_forward(q, k, v, g, beta, scale, h0, cu_seqlens):
    """q, k, g: [1, T, H, K]; v: [1, T, H, V]; beta: [1, T, H]; h0: [N, H, K, V] or None.
    Returns o [1, T, H, V] and final_state [N, H, K, V] (float32)."""
    _, T, H, K = q.shape
    V = v.shape[-1]
    o = np.zeros((1, T, H, V), np.float32)
    final = np.zeros((len(cu_seqlens) - 1, H, K, V), np.float32)
    for n, (start, end) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        for h in range(H):
            S = np.zeros((K, V), np.float32) if h0 is None else h0[n, h].copy()
            for t in range(start, end):
                S *= np.exp(g[0, t, h])[:, None]
                u = beta[0, t, h] * (v[0, t, h] - k[0, t, h] @ S)
                S += np.outer(k[0, t, h], u)
                o[0, t, h] = (scale * q[0, t, h]) @ S
            final[n, h] = S
    return o, final


def main(case_path, out_path):
    case = deltaref.read_case(case_path)
    if case.op != "kda" or case.meta.get("use_gate_in_kernel") or case.meta.get("use_qk_l2norm_in_kernel"):
        sys.exit("this example runs plain KDA cases (gen --op kda without --gate/--l2norm)")
    f32 = {n: case[n].astype(np.float32) for n in ("q", "k", "v", "g", "beta")}
    T = f32["q"].shape[1]
    cu = case.cu_seqlens or [0, T]
    if f32["q"].shape[0] != 1:  # a dense batch: pack it as sequences of equal length
        B = f32["q"].shape[0]
        f32 = {n: x.reshape((1, B * T) + x.shape[2:]) for n, x in f32.items()}
        cu = [b * T for b in range(B + 1)]
    h0 = case["initial_state"].astype(np.float32) if "initial_state" in case else None
    scale = case.meta.get("scale") or f32["q"].shape[-1] ** -0.5
    o, final_state = kda_forward(**f32, scale=scale, h0=h0, cu_seqlens=cu)
    o = o.reshape(case["q"].shape[:3] + (o.shape[-1],))
    candidate = deltaref.Case(case.meta, {"o": o, "final_state": final_state},
                              dtypes={"o": "f32", "final_state": "f32"}, cu_seqlens=case.cu_seqlens)
    candidate.write(out_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
