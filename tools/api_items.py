#!/usr/bin/env python3
"""Count the public items of the oracle crate as rustdoc pages.

Usage: tools/api_items.py [DOC_DIR...] [--list]

Each DOC_DIR is rustdoc's output for the crate (default target/doc/deltaref,
from `cargo doc -p deltaref --no-deps`). An item is one page:
struct/enum/trait/fn/constant/type/macro/static/union, plus one per module
index page (`index.html`, the crate root included); a page that only
redirects (an item re-exported from a private module) is not an item.
Several DOC_DIRs count the union of their items: `#[doc(hidden)]` items have
pages only when documented with `--document-hidden-items` (nightly), and
that run lists items re-exported from private modules as re-exports instead
of pages, so the really public items are the union of both runs
(tools/api_count.sh does both).
"""
import os
import re
import sys
from collections import defaultdict

KINDS = ("struct", "enum", "trait", "fn", "constant", "type", "macro", "static", "union")
PAGE = re.compile(r"^(%s)\.(\w+)\.html$" % "|".join(KINDS))


def redirect(path):
    """Whether a page only redirects to the item's canonical page (an item
    re-exported from a private module): not an item of its own."""
    with open(path, encoding="utf-8") as f:
        return 'http-equiv="refresh"' in f.read(2000)


def items(doc_dir):
    """Yield (module path, kind, name) for every item page under doc_dir."""
    root = os.path.basename(os.path.normpath(doc_dir))
    for dirpath, _, files in os.walk(doc_dir):
        rel = os.path.relpath(dirpath, os.path.dirname(os.path.normpath(doc_dir)))
        module = rel.replace(os.sep, "::")
        for f in sorted(files):
            if f == "index.html":
                yield module, "mod", module.split("::")[-1] if module != root else root
            m = PAGE.match(f)
            if m and not redirect(os.path.join(dirpath, f)):
                yield module, m.group(1), m.group(2)


def main():
    doc_dirs = [a for a in sys.argv[1:] if not a.startswith("--")] or ["target/doc/deltaref"]
    found = set()
    for doc_dir in doc_dirs:
        if not os.path.isdir(doc_dir):
            sys.exit(f"no rustdoc output at {doc_dir}: run `cargo doc -p deltaref --no-deps` first")
        found.update(items(doc_dir))
    by_module = defaultdict(list)
    for module, kind, name in found:
        by_module[module].append((kind, name))
    total = sum(len(v) for v in by_module.values())
    if "--list" in sys.argv:
        for module in sorted(by_module):
            entries = sorted(by_module[module])
            print(f"{module} ({len(entries)})")
            for kind, name in entries:
                print(f"  {kind} {name}")
    print(f"total {total}")


if __name__ == "__main__":
    main()
