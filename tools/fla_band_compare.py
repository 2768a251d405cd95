#!/usr/bin/env python3
"""Fidelity, restated: is FLA's measured norm_ratio inside the emulated band?

    python3 tools/fla_band_compare.py [FLA.json ...] [--bin target/debug/deltaref] [--precision fla-bf16]
        [--samples 16] [--only NAME,...] [--out TABLE.md] [--bands-json BANDS.json]
    python3 tools/fla_band_compare.py --bands-only --set all --bands-json BANDS.json [--jobs 2]

FLA.json (default: tools/fidelity/fla-0.6.0-h100.json) is `tools/fla_fidelity.py`'s
output: `{"cases": [{"name", "gen": [args], "fla": <deltaref verify --json report>}]}`.
Each case is regenerated here (`deltaref gen ARGS --expected`: deterministic, the same
bits as on the GPU machine) and `deltaref band --case … --precision P --json` gives,
per output and gradient, the band [p1, p99] of an ensemble of jittered emulation runs
(DPLR with --chunk-size 16, FLA's default). Every FLA row (outputs and gradients; FLA's
forward intermediates have no band) is `inside` or outside, with how far in band
widths. Prints a markdown table case x tensor x FLA x p1 x median x p99 x verdict and
the share of rows inside; exit status 0 when at least --target of the rows are inside.
With --bands-only it computes the bands of a case set of `tools/fla_fidelity.py`
(no FLA numbers needed: on a many-core machine beside the GPU run) into --bands-json.
Standard library only.
"""

import argparse
import concurrent.futures
import json
import os
import sys
import tempfile

from fla_fidelity import SETS, deltaref, fla_chunk_size  # same directory


def band(binary, gen, precision, samples, scratch):
    """`deltaref band --json` of one case, regenerated from `gen`."""
    case = os.path.join(tempfile.mkdtemp(dir=scratch), "case.safetensors")
    deltaref(binary, "gen", *gen, "--expected", "-q", "--out", case)
    out = deltaref(binary, "band", "--case", case, *fla_chunk_size(gen), "--precision", precision,
                   "--samples", str(samples), "--json", "-q")
    return json.loads(out)


# verify/src/band.rs's model_margin: bands written by a deltaref without the
# model margin (raw ensemble quantiles, no "margin" key) are widened here the
# same way.
MARGIN, MARGIN_DPLR, MARGIN_DECAY, NOISY_SPAN = 1.15, 1.25, 1.4, 2.0
DECAY_GRADIENTS = {"dg", "dgk", "dA_log", "ddt_bias"}


def published(row, op):
    """The band as `deltaref band` publishes it: the ensemble's [p1, p99] widened by the model margin."""
    if "margin" in row:
        return row
    noisy = row["p99"] > NOISY_SPAN * row["p1"]
    m = MARGIN_DECAY if noisy or row["tensor"] in DECAY_GRADIENTS else MARGIN_DPLR if op == "dplr" else MARGIN
    return dict(row, p1=row["p1"] / m, p99=row["p99"] * m, margin=m,
                ensemble_p1=row["p1"], ensemble_p99=row["p99"])


def position(x, row):
    """inside / above / below, and how far outside [p1, p99] in band widths
    (the width as `deltaref` judges it: p99 - p1, at least 0.3 p99)."""
    w = max(row["p99"] - row["p1"], 0.3 * row["p99"])
    if x > row["p99"]:
        return "above", (x - row["p99"]) / w
    if x < row["p1"]:
        return "below", (row["p1"] - x) / w
    return "inside", 0.0


def table(cases, bands):
    lines = [
        "| case | tensor | FLA | p1 | median | p99 | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    inside = total = 0
    outside = []
    for c in cases:
        op = c["gen"][c["gen"].index("--op") + 1]
        rows = {r["tensor"]: published(r, op) for r in bands[c["name"]]["rows"]}
        for r in c["fla"]["rows"]:
            t, x = r["tensor"], r.get("norm_ratio")
            b = rows.get(t)
            if x is None or b is None:
                lines.append(f"| {c['name']} | {t} | — | — | — | — | no band |")
                continue
            pos, k = position(x, b)
            total += 1
            inside += pos == "inside"
            verdict = "inside" if pos == "inside" else f"{pos} by {k:.2f} widths" + (
                "" if k <= 1 else " (OUT: verify --band fails it)" if pos == "above" else " (far below)")
            if pos != "inside":
                outside.append((c["name"], t, x, b, verdict))
            lines.append(
                f"| {c['name']} | {t} | {x:.2e} | {b['p1']:.2e} | {b['median']:.2e} | {b['p99']:.2e} | {verdict} |"
            )
    within = sum(1 for _, _, _, _, v in outside if "OUT" not in v)
    return lines, inside, total, outside, within


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("fla_json", nargs="*", default=[os.path.join(here, "fidelity", "fla-0.6.0-h100.json")])
    ap.add_argument("--bin", default=os.path.join(here, "..", "target", "release", "deltaref"))
    ap.add_argument("--precision", default="fla-bf16")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--only", help="comma-separated case names")
    ap.add_argument("--target", type=float, default=0.98, help="share of rows that must be inside")
    ap.add_argument("--out", help="also write the table here")
    ap.add_argument("--bands-json", help="read bands from / write them to this file (skips recomputing cases it holds)")
    ap.add_argument("--bands-only", action="store_true", help="only compute the bands of --set's cases")
    ap.add_argument("--set", choices=sorted(SETS), default="all", help="the case set for --bands-only")
    ap.add_argument("--jobs", type=int, default=1, help="cases computed at once")
    a = ap.parse_args()
    cases = []
    if a.bands_only:
        cases = [{"name": n, "gen": g} for n, g in SETS[a.set]]
    else:
        for path in a.fla_json:
            with open(path) as f:
                cases += json.load(f)["cases"]
    if a.only:
        cases = [c for c in cases if c["name"] in a.only.split(",")]
    bands = {}
    if a.bands_json and os.path.exists(a.bands_json):
        with open(a.bands_json) as f:
            bands = json.load(f)
    todo = [c for c in cases if c["name"] not in bands]
    with tempfile.TemporaryDirectory() as scratch, concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
        runs = {pool.submit(band, a.bin, c["gen"], a.precision, a.samples, scratch): c["name"] for c in todo}
        for run in concurrent.futures.as_completed(runs):
            print(f"band of {runs[run]} done", file=sys.stderr, flush=True)
            bands[runs[run]] = run.result()
            if a.bands_json:
                with open(a.bands_json, "w") as f:
                    json.dump(bands, f, indent=1)
    if a.bands_only:
        return
    lines, inside, total, outside, within = table(cases, bands)
    lines.append("")
    lines.append(
        f"{inside} of {total} rows inside the band [p1, p99] ({100 * inside / max(total, 1):.1f} %); "
        f"{inside + within} of {total} pass `verify --band` (within one band width of it); "
        f"precision {a.precision}, {a.samples} samples per case"
    )
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    raise SystemExit(0 if inside >= a.target * total else 1)


if __name__ == "__main__":
    main()
