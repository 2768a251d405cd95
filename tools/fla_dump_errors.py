#!/usr/bin/env python3
"""Where FLA's error sits, per token: a `tools/fla_fidelity.py --dump` file
against the case's f64 truth (and optionally an emulated candidate).

    python3 tools/fla_dump_errors.py CASE.safetensors DUMP.safetensors [--emulated CAND] [--chunk 64] [--tensors o,dg]

CASE is the case regenerated with its gen arguments and `--expected`
(`deltaref gen ... --expected --out CASE`); CAND a `deltaref run --case CASE
--impl chunk --precision fla-bf16 --out CAND` (use --chunk 16 for DPLR, FLA's
chunk size there). For each token tensor the dump and the truth share it
prints the norm_ratio, the rms error at each position inside a chunk (a
cumsum or a chunk-end term shows up as a trend or a constant over positions),
and the tokens with the largest share of the squared error (with their
sequence and position in it). Standard library only (slow on large cases:
pick tensors with --tensors).
"""

import argparse
import array
import json
import math
import struct


def load(path, names=None):
    """name -> (flat list of floats, shape), and the `case` metadata."""
    out = {}
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        meta = header.pop("__metadata__", None) or {}
        for name, v in header.items():
            if names is not None and name not in names:
                continue
            start, end = v["data_offsets"]
            f.seek(8 + n + start)
            raw = f.read(end - start)
            if v["dtype"] == "BF16":
                half = array.array("H")
                half.frombytes(raw)
                a = array.array("f")
                a.frombytes(array.array("I", (h << 16 for h in half)).tobytes())
            else:
                a = array.array({"F64": "d", "F32": "f", "I64": "q"}[v["dtype"]])
                a.frombytes(raw)
            out[name] = (list(a), v["shape"])
    return out, json.loads(meta["case"]) if "case" in meta else {}


def token_positions(cu, t, chunk):
    """Per token: (sequence, position in it, position in its chunk)."""
    pos = []
    for s, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        pos += [(s, i, i % chunk) for i in range(b - a)]
    return pos[:t]


def report(name, truth, x, shape, pos, chunk, label):
    per_tok = math.prod(shape[2:])
    n = len(truth)
    err = sum((a - b) ** 2 for a, b in zip(truth, x)) / n
    ref = sum(a * a for a in truth) / n
    print(f"{name} [{label}]: norm_ratio {math.sqrt(err) / (math.sqrt(ref) + 1e-8):.3e}")
    by_pos, count, tok = [0.0] * chunk, [0] * chunk, []
    for t in range(shape[1]):
        e = sum((truth[i] - x[i]) ** 2 for i in range(t * per_tok, (t + 1) * per_tok))
        by_pos[pos[t][2]] += e
        count[pos[t][2]] += per_tok
        tok.append((e, t))
    step = max(1, chunk // 16)
    cells = [f"{p}:{math.sqrt(by_pos[p] / count[p]):.1e}" for p in range(0, chunk, step) if count[p]]
    print("  rms error by position in chunk: " + " ".join(cells))
    total = sum(e for e, _ in tok) or 1.0
    top = sorted(tok, reverse=True)[:5]
    print("  largest: " + ", ".join(f"token {t} (seq {pos[t][0]} pos {pos[t][1]}) {e / total:.0%}" for e, t in top))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("case")
    ap.add_argument("dump")
    ap.add_argument("--emulated", help="an emulated candidate of the same case")
    ap.add_argument("--chunk", type=int, default=64, help="chunk size of the positions (DPLR in FLA: 16)")
    ap.add_argument("--tensors", help="comma-separated tensor names (default: every shared token tensor)")
    a = ap.parse_args()
    want = set(a.tensors.split(",")) if a.tensors else None
    dump, _ = load(a.dump, want)
    names = sorted(n for n, (_, s) in dump.items() if not n.startswith("stage/") and len(s) >= 3 and s[0] == 1)
    case, _ = load(a.case, set(names) | {"cu_seqlens"})
    emu = load(a.emulated, set(names))[0] if a.emulated else {}
    for name in names:
        if name not in case:
            continue
        truth, shape = case[name]
        t = shape[1]
        cu = case["cu_seqlens"][0] if "cu_seqlens" in case else [0, t]
        pos = token_positions(cu, t, a.chunk)
        report(name, truth, dump[name][0], shape, pos, a.chunk, "FLA")
        if name in emu:
            report(name, truth, emu[name][0], shape, pos, a.chunk, "emulated")


if __name__ == "__main__":
    main()
