#!/usr/bin/env python3
"""ggml's rows of the conformance table, on the CPU (docs/conformance.md).

    python3 tools/ggml_conformance.py --deltaref target/release/deltaref --work /tmp/ggml-conf --out rows.jsonl

Each case (CASES: the `deltaref gen` arguments; GATED_DELTA_NET cases are
written in ggml's convention) is written with its float64 truth, run
through tools/ggml_runner.py in this process, and judged by `deltaref
verify --forward-only` against FLA's bar for the op (ggml has forward
kernels only). One JSON line per case, in tools/conformance.py's format,
so tools/conformance_table.py renders both. Needs numpy and ggml-python.
"""

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tools import ggml_runner  # noqa: E402
from tools.conformance_judge import BARS, gen, judge, worst_of  # noqa: E402

CASES = [
    ("ggml_gdn_k64", "ggml", None,
     "--op gdn --shape 2,256,4,4,64,64 --initial-state --dtype f32 --seed 21"),
    ("ggml_kda_gva_k64", "ggml", None,
     "--op kda --shape 2,256,2,4,64,64 --initial-state --dtype f32 --seed 22"),
    ("ggml_dplr_k64", "fla", None,
     "--op dplr --shape 1,512,2,64,64 --lengths 200,312 --initial-state --dtype f32 --seed 23"),
    ("ggml_dplr_k16", "fla", "ggml RWKV_WKV7 with a head size below the SIMD step (finding 7)",
     "--op dplr --shape 2,64,2,16,16 --dtype f32 --seed 24"),
    ("ggml_conv_silu_bias", "fla", None,
     "--op causal_conv1d --shape 1,600,256,4 --lengths 1,299,300 --activation silu --bias --initial-state "
     "--dtype f32 --seed 25"),
]
KERNEL = {"gdn": "GATED_DELTA_NET", "kda": "GATED_DELTA_NET", "dplr": "RWKV_WKV7", "causal_conv1d": "SSM_CONV"}


def row(deltaref, work, name, convention, bug, args):
    in_convention = ["--convention", convention] if convention != "fla" else []
    argv = args.split() + in_convention
    op = argv[argv.index("--op") + 1]
    r = dict(case=name, family=f"ggml-{op}", bug=bug, impl="ggml", convention=convention,
             device=f"CPU ({platform.machine()}), ggml-python 0.0.45", date=time.strftime("%Y-%m-%d"),
             gen=" ".join(argv), forward_only=True)
    path = os.path.join(work, name + ".safetensors")
    err = gen(deltaref, {"gen": argv}, path)
    if err:
        return r | dict(status="case-error", error=err)
    tensors, meta = ggml_runner.read_safetensors(path)
    t0 = time.time()
    try:
        cand = ggml_runner.results(tensors, json.loads(meta["case"]))
    except Exception as e:  # the kernel's refusal is this row's answer
        return r | dict(status="run-error", error=f"{type(e).__name__}: {e}")
    cand_path = os.path.join(work, name + ".ggml.safetensors")
    ggml_runner.write_safetensors(cand_path, cand)
    ratios, failing, verr = judge(deltaref, path, cand_path, True, BARS[op], in_convention)
    r |= dict(served=f"ggml {KERNEL[op]} (CPU)", seconds=round(time.time() - t0, 1), bar=BARS[op])
    if verr:
        return r | dict(status="verify-error", error=verr)
    return r | dict(status="fail" if failing else "pass", failing=failing, ratios=ratios, worst=worst_of(ratios))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deltaref", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    with open(a.out, "w") as out:
        for case in CASES:
            r = row(a.deltaref, a.work, *case)
            print(f"{r['case']:22} {r['status']:6} {r.get('worst', '')} "
                  f"{r.get('ratios', {}).get(r.get('worst'), r.get('error', ''))}", flush=True)
            out.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
