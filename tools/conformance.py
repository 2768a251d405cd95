#!/usr/bin/env python3
"""The conformance run: every installed runner over a plan of cases, judged by deltaref.

    python3 tools/conformance.py --plan tools/conformance_plan.json --deltaref ./deltaref \
        --work /tmp/conf --out rows.jsonl [--impls fla-chunk,flashkda] [--families kda-*] [--budget-s 500]

For each case of the plan (`name`, `family`, `gen`: the `deltaref gen`
arguments) it writes the case with its float64 truth, then for each runner
(tools/runners/registry.py) that can take it runs the kernel in this process
(compiled kernels and autotuning are kept between cases), writes the
candidate and judges it with `deltaref verify --json` (`--forward-only` for a
forward-only runner). One JSON line per (runner, case) goes to --out as soon
as it is known: the case, the runner, its convention, what served the call,
the worst tensor and every tensor's norm_ratio, or why it did not run.
`tools/conformance_table.py` turns the lines into docs/conformance.md.
"""

import argparse
import fnmatch
import json
import os
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tools.runners.common import load, save  # noqa: E402
from tools.runners.registry import IMPLS  # noqa: E402

# FLA's test bars (tests/ops/test_kda.py, test_gated_delta.py, test_dplr_delta.py, modules' tests).
BARS = {"kda": 8e-3, "gdn": 3e-3, "gdn2": 8e-3, "dplr": 8e-3, "token_shift": 1e-3, "causal_conv1d": 1e-3}


def sh(*args):
    p = subprocess.run([str(a) for a in args], capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


def gen(deltaref, case, path):
    if os.path.exists(path):
        return None
    rc, out, err = sh(deltaref, "gen", *case["gen"], "--expected", "--out", path)
    return None if rc == 0 else (err or out).strip()


def judge(deltaref, case_path, cand, forward_only, bar):
    args = ["verify", "--case", case_path, "--candidate", cand, "--json", "--max-ratio", bar, "--allow-partial"]
    if forward_only:
        args.append("--forward-only")
    rc, out, err = sh(deltaref, *args)
    if rc not in (0, 1):
        return None, (err or out).strip()
    rep = json.loads(out)
    return {r["tensor"]: r["norm_ratio"] for r in rep["rows"] if r.get("norm_ratio") is not None}, None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plan", required=True)
    ap.add_argument("--deltaref", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--families", default="*")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new cases after this many seconds")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    plan = [c for c in json.load(open(a.plan))["cases"]
            if any(fnmatch.fnmatch(c["family"], f) for f in a.families.split(","))]
    device = ""
    try:
        import torch
        device = torch.cuda.get_device_name()
    except Exception as e:  # the rows still say what could not run
        device = f"no GPU ({e})"
    start = time.time()
    with open(a.out, "a") as out:
        for case in plan:
            path = os.path.join(a.work, case["name"] + ".safetensors")
            err = gen(a.deltaref, case, path)
            for impl in a.impls.split(","):
                if time.time() - start > a.budget_s:
                    print(f"budget spent: stopping before {case['name']} / {impl}", flush=True)
                    return
                convention, why_not, run, forward_only = IMPLS[impl]
                row = dict(case=case["name"], family=case["family"], bug=case.get("bug"), impl=impl,
                           convention=convention, device=device, date=time.strftime("%Y-%m-%d"),
                           gen=" ".join(case["gen"]), forward_only=forward_only)
                if err:
                    row |= dict(status="case-error", error=err)
                    out.write(json.dumps(row) + "\n")
                    continue
                t, meta = load(path)
                bar = BARS[meta["op"]]
                why = why_not(meta, t)
                if why:
                    continue  # not this kernel's domain: no row
                t0 = time.time()
                try:
                    cand, served = run(meta, t)
                    import torch
                    torch.cuda.synchronize()
                    cand_path = os.path.join(a.work, f"{case['name']}.{impl}.safetensors")
                    save(cand, cand_path)
                except Exception as e:
                    traceback.print_exc()
                    row |= dict(status="run-error", error=f"{type(e).__name__}: {e}", seconds=time.time() - t0)
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    continue
                ratios, verr = judge(a.deltaref, path, cand_path, forward_only, bar)
                row |= dict(served=served, seconds=round(time.time() - t0, 1), bar=bar)
                if verr:
                    row |= dict(status="verify-error", error=verr)
                else:
                    worst = max(ratios, key=lambda n: ratios[n]) if ratios else None
                    row |= dict(status="pass" if all(r < bar for r in ratios.values()) else "fail",
                                ratios=ratios, worst=worst)
                print(f"{case['name']:28} {impl:22} {row['status']:6} {row.get('worst')} "
                      f"{ratios.get(row.get('worst')) if ratios else ''} ({row['seconds']} s, {served})", flush=True)
                out.write(json.dumps(row) + "\n")
                out.flush()


if __name__ == "__main__":
    main()
