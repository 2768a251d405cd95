#!/usr/bin/env python3
"""Compare FLA's measured error with the emulation's (the fidelity table).

    python3 tools/fla_fidelity_compare.py [FLA.json] [--bin target/release/deltaref] [--preset fla-bf16] [--out TABLE.md]
    python3 tools/fla_fidelity_compare.py [FLA.json] --stored [--preset fla-bf16]

FLA.json (default: tools/fidelity/fla-0.6.0-h100.json, measured on an H100)
is `tools/fla_fidelity.py`'s output (the GPU side):
`{"cases": [{"name", "gen": [args], "fla": <deltaref verify --json report>, ...}]}`.
By default each case is regenerated here (`deltaref gen ARGS --expected`:
deterministic, the same bits as on the GPU machine) and the emulated side is
computed by that binary: `deltaref run --impl chunk --precision P
--intermediates` then `deltaref verify --candidate` for KDA (so FLA's forward
intermediates g_cumsum, Aqk, Akk, w, u, qg, kg, v_new, h are compared too),
`deltaref verify --impl chunk --precision P` otherwise. With --stored the
emulated reports stored in FLA.json (`"emulated": {P: report}`, computed on
the GPU machine by the binary of that run) are used instead.

Prints a markdown table, case x tensor x FLA x emulated x ratio x verdict:
`ok` when emulated/FLA is within x1.3 (--factor) and both pass or both fail
at 5e-3 (--bar), or when both are below 1e-6 (--floor: fp32-level noise such
as g_cumsum's, where the ratio of two roundings says nothing); otherwise what
is off. DPLR is emulated with --chunk-size 16, FLA's default for
`chunk_dplr_delta_rule`. Exit status 0 when every row is ok,
1 otherwise. Standard library only.
"""

import argparse
import json
import os
import sys
import tempfile

# The deltaref runner of the GPU side (stdlib only at import: no torch needed).
from fla_fidelity import deltaref, fla_chunk_size, report  # same directory


def emulate(binary, gen, preset, scratch):
    """The emulated verify report of one case (regenerated from `gen`)."""
    case = os.path.join(scratch, "case.safetensors")
    deltaref(binary, "gen", *gen, "--expected", "-q", "--out", case)
    if gen[gen.index("--op") + 1] != "kda":
        return report(binary, case, "--impl", "chunk", *fla_chunk_size(gen), "--precision", preset)
    cand = os.path.join(scratch, "emulated.safetensors")
    deltaref(binary, "run", "--case", case, "--impl", "chunk", "--precision", preset, "-q", "--intermediates", cand)
    return report(binary, case, "--candidate", cand)


def ratios(report):
    """tensor -> norm_ratio (None where the report has none), outputs and
    gradients first, then FLA's forward intermediates (KDA)."""
    rows = report["rows"] + (report.get("intermediates") or [])
    return {r["tensor"]: r.get("norm_ratio") for r in rows}


def verdict(fla, emu, bar, factor, floor):
    if fla is None or emu is None:
        return "missing"
    if fla < floor and emu < floor:
        return f"ok (both < {floor:g})"
    if (fla < bar) != (emu < bar):
        return f"verdict differs at {bar:g}"
    if fla == 0 or emu == 0:
        return "ok" if fla == emu else "off"
    r = emu / fla
    if r > factor:
        return "too pessimistic"
    if r < 1 / factor:
        return "too optimistic"
    return "ok"


def table(cases, emulated, bar, factor, floor):
    """Markdown lines and the number of rows that are not ok."""
    lines = [
        "| case | tensor | FLA | emulated | emulated/FLA | verdict |",
        "|---|---|---|---|---|---|",
    ]
    bad = 0
    for c in cases:
        fla, emu = ratios(c["fla"]), ratios(emulated[c["name"]])
        for t in fla:
            f, e = fla[t], emu.get(t)
            v = verdict(f, e, bar, factor, floor)
            bad += not v.startswith("ok")
            fmt = lambda x: "—" if x is None else f"{x:.2e}"  # noqa: E731
            ratio = f"{e / f:.2f}" if f and e is not None else "—"
            lines.append(f"| {c['name']} | {t} | {fmt(f)} | {fmt(e)} | {ratio} | {v} |")
    return lines, bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument(
        "fla_json",
        nargs="?",
        default=os.path.join(here, "fidelity", "fla-0.6.0-h100.json"),
        help="tools/fla_fidelity.py's output (default: %(default)s)",
    )
    src = ap.add_mutually_exclusive_group()
    src.add_argument(
        "--bin",
        default=os.path.join(here, "..", "target", "release", "deltaref"),
        help="deltaref binary computing the emulated side here (default: %(default)s)",
    )
    src.add_argument("--stored", action="store_true", help="use the emulated reports stored in the JSON")
    ap.add_argument("--preset", default="fla-bf16")
    ap.add_argument("--bar", type=float, default=5e-3, help="pass/fail bar (FLA's bf16 KCP noise bar)")
    ap.add_argument("--factor", type=float, default=1.3, help="allowed emulated/FLA ratio either way")
    ap.add_argument(
        "--floor",
        type=float,
        default=1e-6,
        help="rows where both are below this are ok (fp32-level noise such as g_cumsum's; default %(default)g)",
    )
    ap.add_argument("--only", help="comma-separated case names")
    ap.add_argument("--out", help="also write the table here")
    a = ap.parse_args()
    with open(a.fla_json) as f:
        cases = json.load(f)["cases"]
    if a.only:
        cases = [c for c in cases if c["name"] in a.only.split(",")]
    emulated = {}
    with tempfile.TemporaryDirectory() as scratch:
        for c in cases:
            if a.stored:
                emulated[c["name"]] = c["emulated"][a.preset]
            else:
                print(f"emulating {c['name']} ...", file=sys.stderr, flush=True)
                emulated[c["name"]] = emulate(a.bin, c["gen"], a.preset, scratch)
    lines, bad = table(cases, emulated, a.bar, a.factor, a.floor)
    total = len(lines) - 2
    lines.append("")
    lines.append(
        f"{total - bad} of {total} rows ok (emulated within x{a.factor:g} of FLA and the same verdict at {a.bar:g}, "
        f"or both below {a.floor:g}); "
        f"preset {a.preset}"
    )
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
