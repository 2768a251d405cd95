#!/usr/bin/env python3
"""A deltaref fuzz worker for ggml's delta-rule and conv kernels (forward, CPU).

- GATED_DELTA_NET (GDN and KDA), in ggml's own convention (below).
- RWKV_WKV7 (DPLR / RWKV-7) and SSM_CONV (causal conv1d), in FLA's layout:
  the mapping is this runner's (see `rwkv_wkv7`, `ssm_conv`), because
  deltaref's conventions other than FLA's cover KDA and GDN only.

Speaks the persistent-worker protocol of `deltaref fuzz --worker`: one JSON
request per line on stdin, {"case": PATH, "out": PATH}; one JSON answer per
line on stdout, {"ok": true} or {"ok": false, "error": "..."}; exits when
stdin closes. For GATED_DELTA_NET the case file is in ggml's convention (`--convention ggml`):
q, k [B,T,H,K], v [B,T,HV,V], g [B,T,HV] (GDN) or [B,T,HV,K] (KDA, natural
log), beta [B,T,HV] (linear), initial_state [B,HV,V,K] (optional), and the
results are written the same way: o [B,T,HV,V], final_state [B,HV,V,K].
The kernel itself decides the rest (value head j reads q/k head j % H, scale
1/sqrt(K)): nothing here maps conventions, so under another --convention
the fuzzer sees the kernel's own mistakes.

Needs numpy and ggml-python (0.0.45, built from the PyPI sdist); reads and
writes safetensors itself (no safetensors package).

    deltaref fuzz --op gdn --convention ggml --worker "python tools/ggml_runner.py"
    deltaref fuzz --op dplr --fix 2,16,16 --worker "python tools/ggml_runner.py"
    deltaref fuzz --op causal_conv1d --worker "python tools/ggml_runner.py"
"""
import json
import struct
import sys

import numpy as np

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64}


def read_safetensors(path):
    """The tensors (numpy, float64 for floats) and metadata of a file."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {}) or {}
    base = 8 + n
    out = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        raw = data[base + start:base + end]
        if info["dtype"] == "BF16":
            u = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
            x = u.view(np.float32)
        else:
            x = np.frombuffer(raw, dtype=DTYPES[info["dtype"]])
        x = x.reshape(info["shape"])
        out[name] = x if info["dtype"] == "I64" else x.astype(np.float64)
    return out, meta


def write_safetensors(path, tensors):
    """Writes float32 tensors (a deltaref candidate file)."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        b = np.ascontiguousarray(tensors[name], dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def compute(build, arrays, threads=2):
    """Runs `build(ctx, *tensors)` (a ggml graph over the float32 `arrays`)
    on the CPU and returns its result as a flat float32 array."""
    import ggml
    import ggml.utils as gu

    nbytes = sum(x.nbytes for x in arrays) * 4 + (1 << 24)
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=nbytes, mem_buffer=None, no_alloc=False))
    try:
        out = build(ctx, *[gu.from_numpy(np.ascontiguousarray(x, dtype=np.float32), ctx) for x in arrays])
        gf = ggml.ggml_new_graph(ctx)
        ggml.ggml_build_forward_expand(gf, out)
        ggml.ggml_graph_compute_with_ctx(ctx, gf, threads)
        return gu.to_numpy(out).copy().reshape(-1)
    finally:
        ggml.ggml_free(ctx)


def gated_delta_net(t, threads=2):
    """o [B,T,HV,V] and the final state [B,HV,V,K] of ggml's kernel."""
    import ggml

    if "cu_seqlens" in t:
        raise ValueError("ggml's GATED_DELTA_NET takes dense batches only (no cu_seqlens)")
    for opt in ("A_log", "dt_bias"):
        if opt in t:
            raise ValueError(f"ggml takes an activated gate: `{opt}` is not an input of GATED_DELTA_NET")
    q, k, v = (np.ascontiguousarray(t[n], dtype=np.float32) for n in ("q", "k", "v"))
    b, T, hv, vd = v.shape
    kd = q.shape[3]
    if kd != vd:
        raise ValueError(f"ggml needs S_k = S_v, got K = {kd}, V = {vd}")
    g = np.asarray(t["g"], dtype=np.float32)
    g = np.ascontiguousarray(g if g.ndim == 4 else g[..., None])
    beta = np.ascontiguousarray(np.asarray(t["beta"], dtype=np.float32)[..., None])
    s0 = t.get("initial_state")
    s0 = np.zeros((b, hv, vd, kd), np.float32) if s0 is None else np.ascontiguousarray(s0, dtype=np.float32)
    flat = compute(lambda ctx, *a: ggml.ggml_gated_delta_net(ctx, *a, 1), (q, k, v, g, beta, s0), threads)
    n_o = b * T * hv * vd
    o = flat[:n_o].reshape(b, T, hv, vd)
    state = flat[n_o:n_o + b * hv * vd * kd].reshape(b, hv, vd, kd)
    return o, state


def rows(t):
    """The case's sequences as (row, start, end): the rows of a dense batch,
    or the packed sequences of row 0 under `cu_seqlens`."""
    if "cu_seqlens" in t:
        cu = [int(c) for c in t["cu_seqlens"]]
        return [(0, a, b) for a, b in zip(cu[:-1], cu[1:])]
    first = next(iter(t[n] for n in ("x", "q") if n in t))
    return [(r, 0, first.shape[1]) for r in range(first.shape[0])]


def rwkv_wkv7(t, meta, threads=2):
    """DPLR through ggml's RWKV_WKV7: o [B,T,H,V] and final_state [N,H,K,V].

    ggml's recurrence (ggml-cpu/ops.cpp, rwkv_wkv7_f32) on a state
    `[H, V, K]` (V first): `S = S·diag(w) + v kᵀ + (S a) bᵀ`, `o = S r`,
    which is FLA's DPLR with `w = exp(gk)` (a linear decay), `r = scale·q`
    (no scale in the kernel) and the state transposed. It takes K = V and
    sequences of equal length: a packed batch runs one sequence a call.
    """
    import ggml

    q, k, v, a, b, gk = (t[n] for n in ("q", "k", "v", "a", "b", "gk"))
    B, T, H, K = q.shape
    V = v.shape[3]
    if K != V:
        raise ValueError(f"ggml's RWKV_WKV7 needs K = V (one head size), got K = {K}, V = {V}")
    scale = meta.get("scale") or K ** -0.5
    seqs = rows(t)
    h0 = t.get("initial_state")
    o = np.zeros((B, T, H, V))
    final = np.zeros((len(seqs), H, K, V))
    for n, (r, s, e) in enumerate(seqs):
        L = e - s
        state = np.zeros((1, H, V, K)) if h0 is None else h0[n].transpose(0, 2, 1)[None]
        if L == 0:  # an empty sequence passes its state through (ggml would abort on it)
            final[n] = state[0].transpose(0, 2, 1)
            continue
        tok = lambda x: x[r, s:e].reshape(L, H, K)  # noqa: E731
        args = (tok(q) * scale, np.exp(tok(gk)), tok(k), tok(v), tok(a), tok(b), state.reshape(1, -1))
        flat = compute(lambda ctx, *x: ggml.ggml_rwkv_wkv7(ctx, *x), args, threads)
        o[r, s:e] = flat[:L * H * V].reshape(L, H, V)
        final[n] = flat[L * H * V:].reshape(H, V, K).transpose(0, 2, 1)
    return o, final


def ssm_conv(t, meta, threads=2):
    """Causal conv1d through ggml's SSM_CONV: y [B,T,D] and final_state [N,D,W].

    SSM_CONV (ggml-cpu/ops.cpp, ssm_conv_f32) slides the `[D, W]` weight over
    `[cache | x]`, the cache holding the W − 1 tokens before x; bias and
    SiLU are ggml's `add` and `silu` in the same graph, as llama.cpp's Mamba
    layers do. The W-column final state FLA returns is the last W tokens of
    `[initial_state | x]`: the runner takes it from the inputs (a model keeps
    the last W − 1 of them as its next cache), so only `y` is the kernel's.
    """
    import ggml

    x, w = t["x"], t["weight"]
    B, T, D = x.shape
    W = w.shape[1]
    act = meta.get("activation", "none")
    if act not in ("none", "silu", "swish"):
        raise ValueError(f"ggml has no activation {act} after SSM_CONV")
    bias = t.get("bias")
    h0 = t.get("initial_state")
    seqs = rows(t)
    y = np.zeros((B, T, D))
    final = np.zeros((len(seqs), D, W))

    def graph(ctx, sx, c, *rest):
        out = ggml.ggml_ssm_conv(ctx, sx, c)
        if rest:
            out = ggml.ggml_add(ctx, out, rest[0])
        return ggml.ggml_silu(ctx, out) if act != "none" else out

    for n, (r, s, e) in enumerate(seqs):
        cache = np.zeros((D, W)) if h0 is None else h0[n]
        padded = np.concatenate([cache, x[r, s:e].T], axis=1)  # [D, W + L]
        final[n] = padded[:, -W:]
        if e > s:  # ggml refuses an empty tensor
            args = (padded[None, :, 1:], w) + (() if bias is None else (bias,))
            y[r, s:e] = compute(graph, args, threads).reshape(e - s, D)
    return y, final


def results(tensors, meta):
    """The op's results under the case's FLA names."""
    op = meta.get("op")
    if op == "dplr":
        o, state = rwkv_wkv7(tensors, meta)
        return {"o": o, "final_state": state}
    if op == "causal_conv1d":
        y, state = ssm_conv(tensors, meta)
        return {"y": y, "final_state": state}
    if op in ("gdn", "kda"):
        o, state = gated_delta_net(tensors)
        return {"o": o, "final_state": state}
    raise ValueError(f"ggml has no kernel here for op {op}")


def serve(stdin=sys.stdin, stdout=sys.stdout):
    for line in stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            tensors, meta = read_safetensors(req["case"])
            case = json.loads(meta.get("case", "{}"))
            write_safetensors(req["out"], results(tensors, case))
            answer = {"ok": True}
        except Exception as e:  # the fuzzer records it as this case's failure
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        stdout.write(json.dumps(answer) + "\n")
        stdout.flush()


if __name__ == "__main__":
    serve()
