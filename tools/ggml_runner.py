#!/usr/bin/env python3
"""A deltaref fuzz worker for ggml's GATED_DELTA_NET (GDN and KDA, forward).

Speaks the persistent-worker protocol of `deltaref fuzz --worker`: one JSON
request per line on stdin, {"case": PATH, "out": PATH}; one JSON answer per
line on stdout, {"ok": true} or {"ok": false, "error": "..."}; exits when
stdin closes. The case file is in ggml's convention (`--convention ggml`):
q, k [B,T,H,K], v [B,T,HV,V], g [B,T,HV] (GDN) or [B,T,HV,K] (KDA, natural
log), beta [B,T,HV] (linear), initial_state [B,HV,V,K] (optional), and the
results are written the same way: o [B,T,HV,V], final_state [B,HV,V,K].
The kernel itself decides the rest (value head j reads q/k head j % H, scale
1/sqrt(K)): nothing here maps conventions, so under another --convention
the fuzzer sees the kernel's own mistakes.

Needs numpy and ggml-python (0.0.45, built from the PyPI sdist); reads and
writes safetensors itself (no safetensors package).

    deltaref fuzz --op gdn --convention ggml --worker "python tools/ggml_runner.py"
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


def gated_delta_net(t, threads=2):
    """o [B,T,HV,V] and the final state [B,HV,V,K] of ggml's kernel."""
    import ggml
    import ggml.utils as gu

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
    nbytes = sum(x.nbytes for x in (q, k, v, g, beta, s0)) * 4 + (1 << 24)
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=nbytes, mem_buffer=None, no_alloc=False))
    try:
        args = [gu.from_numpy(x, ctx) for x in (q, k, v, g, beta, s0)]
        out = ggml.ggml_gated_delta_net(ctx, *args, 1)
        gf = ggml.ggml_new_graph(ctx)
        ggml.ggml_build_forward_expand(gf, out)
        ggml.ggml_graph_compute_with_ctx(ctx, gf, threads)
        flat = gu.to_numpy(out).copy().reshape(-1)
    finally:
        ggml.ggml_free(ctx)
    n_o = b * T * hv * vd
    o = flat[:n_o].reshape(b, T, hv, vd)
    state = flat[n_o:n_o + b * hv * vd * kd].reshape(b, hv, vd, kd)
    return o, state


def serve(stdin=sys.stdin, stdout=sys.stdout):
    for line in stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            tensors, _ = read_safetensors(req["case"])
            o, state = gated_delta_net(tensors)
            write_safetensors(req["out"], {"o": o, "final_state": state})
            answer = {"ok": True}
        except Exception as e:  # the fuzzer records it as this case's failure
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        stdout.write(json.dumps(answer) + "\n")
        stdout.flush()


if __name__ == "__main__":
    serve()
