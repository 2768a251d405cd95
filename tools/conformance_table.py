#!/usr/bin/env python3
"""docs/conformance.md's table from tools/conformance.py's JSON lines.

    python3 tools/conformance_table.py ROWS.jsonl [ROWS.jsonl ...] > table.md   (later files win)

One row per (implementation, case): op family, what served the call, the
verdict against the bar, the worst tensor and its norm_ratio, then every
tensor's norm_ratio; rows that could not run say why.
"""

import json
import sys


def fmt(x):
    return "non-finite" if x is None else f"{x:.2e}"


def main(paths):
    # A later file's row for the same (implementation, case) replaces an earlier one.
    latest = {}
    for p in paths:
        for line in open(p):
            if line.strip():
                r = json.loads(line)
                latest[(r["impl"], r["case"])] = r
    rows = list(latest.values())
    rows.sort(key=lambda r: (r["impl"], r["family"], r["case"]))
    print("| implementation | case | bug | device, date | served by | verdict (bar) | worst | all tensors (and what bf16 storage costs a correct kernel) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        where = f"{r['device']}, {r['date']}"
        if r["status"] in ("pass", "fail"):
            ratios = r["ratios"]
            worst = f"`{r['worst']}` {fmt(ratios[r['worst']])}" if r.get("worst") else ""
            every = ", ".join(f"{n} {fmt(v)}" for n, v in sorted(ratios.items()))
            emu = r.get("emulated")
            if emu:
                every += " · fla-bf16 emulation: " + ", ".join(f"{n} {fmt(v)}" for n, v in sorted(emu.items()))
            fwd = " (forward only)" if r.get("forward_only") else ""
            verdict = f"**{r['status']}** ({fmt(r['bar'])}){fwd}"
            print(f"| {r['impl']} | {r['case']} | {r.get('bug') or ''} | {where} | {r.get('served', '')} | "
                  f"{verdict} | {worst} | {every} |")
        else:
            err = r.get("error", "").replace("|", "\\|").replace("\n", " ")[:300]
            print(f"| {r['impl']} | {r['case']} | {r.get('bug') or ''} | {where} | | {r['status']} | | {err} |")


if __name__ == "__main__":
    main(sys.argv[1:])
