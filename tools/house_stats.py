#!/usr/bin/env python3
"""The house's figures (issue 48): per crate, lines, `unsafe` places, module
import levels and cycles, and the places that name an operator.

Usage: tools/house_stats.py [ROOT]   (ROOT: a checkout, default: this one)

Import graph: one node per module file (`lib.rs`, `a.rs`, `a/mod.rs`,
`a/b.rs`); an edge A -> B when A names a path of B (`use crate::…`, `super::…`,
`self::…` or an inline `crate::…` path; re-exports are followed to the module
that defines the item). A module naming its own descendants is its facade, not
a dependency, and is not an edge. Unit-test modules (`#[cfg(test)] mod …`) are
left out: they are not part of what the crate's code depends on. Levels: the
number of modules on the longest import chain, cycles counted once each as a
strongly connected component of two or more modules. Lines: every line of
the crate's `.rs` files, and those outside unit tests ("no tests").

Places that name an op: non-comment lines outside the operator's own folder
and the unit tests
that name an operator by its Rust or case name (`kda`, `Kda`, `KdaSpec`,
`"dplr"`, `gdn2`, `token_shift`, `causal_conv1d`, …).
"""
import re
import sys
from pathlib import Path

CRATES = {
    "reference": "reference/src",
    "verify": "verify/src",
    "cli": "verify/cli/src",
    "gpu": "gpu/src",
    "python": "python/src",
}
OPS = ["kda", "dplr", "gdn2", "gdn", "token_shift", "conv"]
OP_WORD = re.compile(
    r"(?<![A-Za-z0-9])(kda|dplr|gdn2?|token_shift|causal_conv1d|"
    r"Kda|Dplr|Gdn2?|TokenShift|CausalConv1d)(?=[A-Z_:\"'(\s.,;>)\]}-]|$)"
    r"|\bconv::"
)
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def strip_comments_and_strings(text, keep_strings=False):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    out = []
    for line in text.splitlines():
        if not keep_strings:
            line = re.sub(r'"(\\.|[^"\\])*"', '""', line)
        i = line.find("//")
        while i >= 0 and line[:i].count('"') % 2 == 1:
            i = line.find("//", i + 2)
        out.append(line if i < 0 else line[:i])
    return out


def drop_test_modules(lines):
    """Lines with every `#[cfg(test)] mod x { … }` block removed."""
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "#[cfg(test)]" and i + 1 < len(lines) and re.match(r"\s*(pub\S* )?mod ", lines[i + 1]):
            depth, j, opened = 0, i + 1, False
            while j < len(lines):
                depth += lines[j].count("{") - lines[j].count("}")
                opened = opened or "{" in lines[j]
                if (opened and depth <= 0) or (not opened and lines[j].rstrip().endswith(";")):
                    break
                j += 1
            i = j + 1
            continue
        out.append(lines[i])
        i += 1
    return out


def module_of(src, path):
    rel = path.relative_to(src).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


def expand_use(tree):
    """`a::{b, c::{d, e}}` -> ['a::b', 'a::c::d', 'a::c::e']."""
    tree = re.sub(r"\s+", "", tree)
    m = re.match(r"^(.*?)\{(.*)\}$", tree)
    if not m:
        return [re.sub(r"as\w+$", "", tree)] if tree else []
    prefix, inner = m.group(1), m.group(2)
    parts, depth, cur = [], 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    parts.append(cur)
    out = []
    for p in parts:
        for e in expand_use(p):
            out.append(prefix + e if e != "self" else prefix.rstrip(":"))
    return out


def resolve(path, here, modules):
    segs = path.split("::")
    if segs[0] == "crate":
        base, segs = (), segs[1:]
    elif segs[0] in ("super", "self"):
        base = here
        while segs and segs[0] in ("super", "self"):
            base = base[:-1] if segs[0] == "super" else base
            segs = segs[1:]
    else:
        # A path from the extern prelude or a sibling brought in scope.
        first = here + (segs[0],)
        if first not in modules and (segs[0],) not in modules:
            return None, None
        base = here if first in modules else ()
    mod = base
    for i, s in enumerate(segs):
        if mod + (s,) in modules:
            mod = mod + (s,)
        else:
            return mod, segs[i]
    return mod, None


def defines(code, name):
    kinds = r"(?:fn|struct|enum|trait|type|static|const|mod|macro_rules!)"
    return re.search(kinds + r"\s+" + re.escape(name) + r"\b", code) is not None


def graph(src):
    files = sorted(src.rglob("*.rs"))
    modules = {module_of(src, f): f for f in files}
    codes = {m: "\n".join(drop_test_modules(strip_comments_and_strings(f.read_text()))) for m, f in modules.items()}
    # name -> defining module, for each module's `pub use` re-exports.
    reexports, globs = {}, {}
    for m, code in codes.items():
        for u in re.finditer(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]+);", code):
            for p in expand_use(u.group(1)):
                name = p.split("::")[-1]
                if name == "*":
                    target, _ = resolve(p[:-3], m, modules)
                    globs.setdefault(m, []).append(target)
                    continue
                target, _ = resolve(p, m, modules)
                if target is not None and target != m:
                    reexports[(m, name)] = target
    edges = {m: set() for m in modules}
    for m, code in codes.items():
        uses = [p for u in re.finditer(r"\buse\s+([^;]+);", code) for p in expand_use(u.group(1).replace(" as ", "as"))]
        body = re.sub(r"\buse\s+[^;]+;", "", code)
        # A module brought into scope by name (`use crate::registry::{self, …}`)
        # is not a dependency by itself; the paths through its name are.
        aliases = {}
        for p in uses:
            target, item = resolve(p, m, modules)
            if target is not None and item is None and target != m:
                aliases[target[-1]] = target
        paths = [p for p in uses if p.split("::")[-1] not in aliases or resolve(p, m, modules)[1]]
        paths += re.findall(r"\b((?:crate|super|self)(?:::" + IDENT + r")+)", body)
        for name, target in aliases.items():
            paths += ["crate::" + "::".join(target) + rest for rest in re.findall(r"(?<![:\w])" + name + r"((?:::" + IDENT + r")+)", body)]
        for p in paths:
            target, item = resolve(p, m, modules)
            seen = set()
            while target is not None and (target, item) not in seen:
                seen.add((target, item))
                if (target, item) in reexports:
                    target = reexports[(target, item)]
                elif item and target in globs and not defines(codes[target], item):
                    target = globs[target][0]
                else:
                    break
            if target is None or target == m or target[: len(m)] == m:
                continue
            edges[m].add(target)
    return modules, edges


def sccs(edges):
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)

    for v in edges:
        if v not in index:
            visit(v)
    return out


def levels(edges, comps):
    comp_of = {v: i for i, c in enumerate(comps) for v in c}
    memo = {}

    def depth(i):
        if i not in memo:
            memo[i] = len(comps[i]) + max(
                (depth(comp_of[w]) for v in comps[i] for w in edges[v] if comp_of[w] != i), default=0
            )
        return memo[i]

    return max(depth(i) for i in range(len(comps)))


def op_places(root, src, crate):
    count, files = 0, set()
    for f in sorted(src.rglob("*.rs")):
        rel = f.relative_to(src)
        if crate == "reference" and rel.parts[0] in OPS:
            continue  # an operator's own folder names itself
        if rel.name == "tests.rs" or "tests" in rel.parts[:-1]:
            continue  # unit tests, as in the import graph
        for line in drop_test_modules(strip_comments_and_strings(f.read_text(), keep_strings=True)):
            if OP_WORD.search(line):
                count += 1
                files.add(rel)
    return count, len(files)


def main():
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent)
    print(f"{'crate':<10} {'lines':>7} {'no tests':>9} {'unsafe':>7} {'modules':>8} {'levels':>7} {'cycles':>7} {'op places':>10}")
    for crate, rel in CRATES.items():
        src = root / rel
        if not src.exists():
            continue
        lines = sum(len(f.read_text().splitlines()) for f in src.rglob("*.rs"))
        code = sum(
            len(drop_test_modules(f.read_text().splitlines()))
            for f in src.rglob("*.rs")
            if not (f.name == "tests.rs" or "tests" in f.relative_to(src).parts[:-1])
        )
        unsafe = sum(
            len(re.findall(r"\bunsafe\b", "\n".join(strip_comments_and_strings(f.read_text()))))
            for f in src.rglob("*.rs")
        )
        modules, edges = graph(src)
        comps = sccs(edges)
        cycles = [sorted("::".join(m) or "lib" for m in c) for c in comps if len(c) > 1]
        places, nfiles = op_places(root, src, crate)
        print(
            f"{crate:<10} {lines:>7} {code:>9} {unsafe:>7} {len(modules):>8} {levels(edges, comps):>7} "
            f"{len(cycles):>7} {places:>5} in {nfiles}"
        )
        for c in cycles:
            print(f"    cycle: {' <-> '.join(c)}")


if __name__ == "__main__":
    main()
