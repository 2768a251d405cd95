#!/usr/bin/env python3
"""Serve one runner over deltaref's runner protocol.

    python3 -m tools.runners.worker IMPL                      # persistent worker: JSON lines on stdin/stdout
    python3 -m tools.runners.worker IMPL --case C --out O     # one case (the command form)

Each request is one JSON line `{"case": PATH, "out": PATH}`; the answer is one
line `{"ok": true, "served": WHAT}` once the candidate file is written, or
`{"ok": false, "unsupported": true|false, "error": TEXT}`. The process keeps
its compiled kernels and autotuning between requests. IMPL is one of
tools/runners/registry.py's names.
"""

import argparse
import json
import sys
import traceback

from .common import load, save
from .registry import IMPLS


def serve(impl, case, out, device="cuda"):
    _, why_not, run, _ = IMPLS[impl]
    t, meta = load(case, device)
    why = why_not(meta, t)
    if why:
        return {"ok": False, "unsupported": True, "error": why}
    try:
        cand, served = run(meta, t)
    except Exception as e:  # the kernel's own refusal or crash is the answer, not the worker's end
        traceback.print_exc(file=sys.stderr)
        return {"ok": False, "unsupported": False, "error": f"{type(e).__name__}: {e}"}
    save(cand, out)
    return {"ok": True, "served": served}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("impl", choices=sorted(IMPLS))
    ap.add_argument("--case")
    ap.add_argument("--out")
    ap.add_argument("--device", default="cuda", help="where the case's tensors go (cpu for the pure-torch runners)")
    a = ap.parse_args()
    if a.case or a.out:
        if not (a.case and a.out):
            ap.error("the command form takes both --case and --out")
        answer = serve(a.impl, a.case, a.out, a.device)
        print(json.dumps(answer))
        raise SystemExit(0 if answer["ok"] else 2)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        print(json.dumps(serve(a.impl, req["case"], req["out"], a.device)), flush=True)


if __name__ == "__main__":
    main()
