#!/usr/bin/env python3
"""Who outside the oracle crate names each public item of `deltaref`.

Usage: tools/api_users.py ITEMS_LIST

ITEMS_LIST is the output of `tools/api_items.py DOC_DIR... --list`. Reads
every .rs file of the workspace's other crates (verify/, verify/cli/, gpu/,
python/, tests/) and of the oracle's own tests (reference/tests/,
reference/benches/), expands their `use deltaref::…` trees (aliases, `self`)
and follows the names they bind (`kda::KdaInputs` after `use deltaref::kda`),
then prints each item with the places that name it. A name reached only by
type inference (a returned value whose type is never written) is not seen:
the compiler is the final word, this is the map.
"""
import os
import re
import sys
from collections import defaultdict

CONSUMERS = [
    ("verify/cli", "cli"),
    ("verify", "verify"),
    ("gpu", "gpu"),
    ("python", "python"),
    ("tests", "tests"),
    ("reference/tests", "oracle-tests"),
    ("reference/benches", "benches"),
]
# The crate root's re-exports (reference/src/lib.rs).
ROOT = {"Dtype": "dtype::Dtype", "Error": "error::Error", "Result": "error::Result",
        "Gate": "gates::Gate", "Scalar": "scalar::Scalar"}


def consumer(path):
    for prefix, name in CONSUMERS:
        if path.startswith(prefix + "/"):
            return name
    return None


def rs_files():
    for prefix, _ in CONSUMERS:
        for dirpath, _, files in os.walk(prefix):
            if "/target" in dirpath:
                continue
            for f in files:
                if f.endswith(".rs"):
                    yield os.path.join(dirpath, f)


def strip_comments(src):
    src = re.sub(r"/\*.*?\*/", "", src, flags=re.S)
    return re.sub(r"//[^\n]*", "", src)


def expand(tree, prefix):
    """Expand a use tree (`a::{b, c::{d as e}, self}`) into (local, path)."""
    tree = tree.strip()
    if not tree:
        return []
    parts, depth, cur = [], 0, ""
    if tree.startswith("{") and tree.endswith("}"):
        for ch in tree[1:-1]:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
            else:
                cur += ch
        parts.append(cur)
        out = []
        for p in parts:
            out += expand(p, prefix)
        return out
    m = re.match(r"^(\w+)\s*::\s*(.*)$", tree, flags=re.S)
    if m:
        return expand(m.group(2), prefix + [m.group(1)])
    m = re.match(r"^(\w+|\*)(?:\s+as\s+(\w+))?$", tree)
    if not m:
        return []
    name, alias = m.group(1), m.group(2)
    if name == "self":
        return [(alias or prefix[-1], prefix)]
    if name == "*":
        return [("*", prefix)]
    return [(alias or name, prefix + [name])]


def canonical(path):
    """deltaref::Error → error::Error; the path without the crate name."""
    path = path[1:]
    if len(path) >= 1 and path[0] in ROOT:
        path = ROOT[path[0]].split("::") + path[1:]
    return "::".join(path)


def uses(src):
    """Every deltaref path a file names (crate name dropped)."""
    src = strip_comments(src)
    found = set()
    bound = {}
    for m in re.finditer(r"\buse\s+(deltaref\s*::[^;]*);", src):
        for local, path in expand(m.group(1), []):
            found.add(canonical(path))
            if local != "*":
                bound[local] = path
    for m in re.finditer(r"\bdeltaref((?:::\w+)+)", src):
        found.add(canonical(["deltaref"] + m.group(1).strip(":").split("::")))
    for local, path in bound.items():
        for m in re.finditer(r"(?<![\w:])%s((?:::\w+)+)" % re.escape(local), src):
            found.add(canonical(path + m.group(1).strip(":").split("::")))
    return found


def main():
    items = []
    module = None
    for line in open(sys.argv[1]):
        if line.startswith("total"):
            continue
        if not line.startswith(" "):
            module = line.split()[0]
            continue
        kind, name = line.split()
        path = module.split("::")[1:]
        if kind == "mod":
            items.append((module, kind, name, "::".join(path)))
        else:
            items.append((module, kind, name, "::".join(path + [name])))
    named = defaultdict(set)
    for f in rs_files():
        who = consumer(f)
        for p in uses(open(f, encoding="utf-8").read()):
            named[p].add(who)
    total = unused = 0
    current = None
    for module, kind, name, path in sorted(items):
        if module != current:
            print(f"{module}")
            current = module
        users = set()
        for p, who in named.items():
            if p == path or p.startswith(path + "::") or (path == "" and p):
                users |= who
        total += 1
        if not users:
            unused += 1
        print(f"  {kind} {name}: {', '.join(sorted(users)) or '-'}")
    print(f"total {total}, named outside: {total - unused}, by nobody outside: {unused}")


if __name__ == "__main__":
    main()
