"""The torch-free half of the conformance run: cases written and candidates
judged by the `deltaref` binary (shared by tools/conformance.py, the GPU
kernels, and tools/ggml_conformance.py, ggml on the CPU)."""

import json
import os
import shutil
import subprocess

# FLA's test bars (tests/ops/test_kda.py, test_gated_delta.py, test_dplr_delta.py, modules' tests).
BARS = {"kda": 8e-3, "gdn": 3e-3, "gdn2": 8e-3, "dplr": 8e-3, "token_shift": 1e-3, "causal_conv1d": 1e-3}


def sh(*args):
    p = subprocess.run([str(a) for a in args], capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


def gen(deltaref, case, path):
    """Writes the case file: a committed fixture (`fixture`: its path) or
    `deltaref gen` with the case's arguments and the float64 truth."""
    if os.path.exists(path):
        return None
    if "fixture" in case:
        shutil.copy(case["fixture"], path)
        return None
    rc, out, err = sh(deltaref, "gen", *case["gen"], "--expected", "--out", path)
    return None if rc == 0 else (err or out).strip()


def ratios_of(report):
    """Tensor -> norm_ratio (None where the candidate is not finite), and the tensors that fail."""
    rows = report["rows"]
    return {r["tensor"]: r.get("norm_ratio") for r in rows}, sorted(r["tensor"] for r in rows if not r["pass"])


def worst_of(ratios):
    """The tensor with the largest norm_ratio (a non-finite one, None, first)."""
    return max(ratios, key=lambda n: float("inf") if ratios[n] is None else ratios[n]) if ratios else None


def judge(deltaref, case_path, cand, forward_only, bar, extra=()):
    args = ["verify", "--case", case_path, "--candidate", cand, "--json", "--max-ratio", bar, "--allow-partial", *extra]
    if forward_only:
        args.append("--forward-only")
    rc, out, err = sh(deltaref, *args)
    if rc not in (0, 1):
        return None, None, (err or out).strip()
    return (*ratios_of(json.loads(out)), None)
