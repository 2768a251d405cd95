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
import platform
import shutil
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tools.conformance_judge import BARS, gen, judge, ratios_of, sh, worst_of  # noqa: E402
from tools.runners.common import load, save  # noqa: E402
from tools.runners.registry import IMPLS  # noqa: E402

def emulated(deltaref, case_path, meta, bar):
    """What FLA's bf16 storage costs a correct kernel on this case: the
    oracle under the `fla-bf16` preset (only for cases stored in bf16)."""
    if meta.get("dtype") != "bf16":
        return None
    impl = "chunk" if meta["op"] in ("kda", "gdn", "gdn2", "dplr") else "naive"
    rc, out, _ = sh(deltaref, "verify", "--case", case_path, "--impl", impl, "--precision", "fla-bf16",
                    "--json", "--max-ratio", bar)
    return ratios_of(json.loads(out))[0] if rc in (0, 1) else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plan", required=True)
    ap.add_argument("--deltaref", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--families", default="*")
    ap.add_argument("--device", default="cuda", help="where the runners get the case's tensors")
    ap.add_argument("--keep", default="", help="CASE.IMPL patterns whose candidate files are copied to --keep-dir")
    ap.add_argument("--keep-dir", default=".")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new cases after this many seconds")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    plan = [c for c in json.load(open(a.plan))["cases"]
            if any(fnmatch.fnmatch(c["family"], f) for f in a.families.split(","))]
    if a.device == "cuda":
        import torch
        device = torch.cuda.get_device_name()
    else:
        device = f"CPU ({platform.processor() or platform.machine()})"
    start = time.time()
    with open(a.out, "a") as out:
        for case in plan:
            path = os.path.join(a.work, case["name"] + ".safetensors")
            err = gen(a.deltaref, case, path)
            emulation = {}  # the case's fla-bf16 emulation, computed once for all its runners
            for impl in a.impls.split(","):
                if time.time() - start > a.budget_s:
                    print(f"budget spent: stopping before {case['name']} / {impl}", flush=True)
                    return
                convention, why_not, run, forward_only = IMPLS[impl]
                row = dict(case=case["name"], family=case["family"], bug=case.get("bug"), impl=impl,
                           convention=convention, device=device, date=time.strftime("%Y-%m-%d"),
                           gen=" ".join(case["gen"]) if "gen" in case else case["fixture"], forward_only=forward_only)
                if err:
                    row |= dict(status="case-error", error=err)
                    out.write(json.dumps(row) + "\n")
                    continue
                t, meta = load(path, a.device)
                bar = BARS[meta["op"]]
                why = why_not(meta, t)
                if why:
                    continue  # not this kernel's domain: no row
                t0 = time.time()
                try:
                    cand, served = run(meta, t)
                    import torch
                    if a.device == "cuda":
                        torch.cuda.synchronize()
                    cand_path = os.path.join(a.work, f"{case['name']}.{impl}.safetensors")
                    save(cand, cand_path)
                except Exception as e:
                    traceback.print_exc()
                    row |= dict(status="run-error", error=f"{type(e).__name__}: {e}", seconds=time.time() - t0)
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    continue
                ratios, failing, verr = judge(a.deltaref, path, cand_path, forward_only, bar)
                row |= dict(served=served, seconds=round(time.time() - t0, 1), bar=bar)
                if verr:
                    row |= dict(status="verify-error", error=verr)
                else:
                    worst = worst_of(ratios)
                    row |= dict(status="fail" if failing else "pass", failing=failing, ratios=ratios,
                                worst=worst)
                    if "ratios" not in emulation:
                        emulation["ratios"] = emulated(a.deltaref, path, meta, bar)
                    row["emulated"] = emulation["ratios"]
                if any(fnmatch.fnmatch(f"{case['name']}.{impl}", k) for k in a.keep.split(",") if k):
                    shutil.copy(cand_path, os.path.join(a.keep_dir, os.path.basename(cand_path)))
                print(f"{case['name']:28} {impl:22} {row['status']:6} {row.get('worst')} "
                      f"{ratios.get(row.get('worst')) if ratios else ''} ({row['seconds']} s, {served})", flush=True)
                out.write(json.dumps(row) + "\n")
                out.flush()


if __name__ == "__main__":
    main()
