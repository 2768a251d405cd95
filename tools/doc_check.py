#!/usr/bin/env python3
"""Run the command blocks of the docs and check what they print (CI: docs that cannot rot).

    python3 tools/doc_check.py [--bin-dir target/release] [--update] README.md debug.md ...

Every fenced block tagged `console` runs, in order, in one scratch directory
per document (so a block may use the files an earlier block wrote; `fixtures/`,
`tools/` and `python/` of the repository are linked into it, and `--bin-dir`
leads PATH, so `deltaref` is the freshly built binary). In a `console` block a
line starting with `$ ` is a command (a trailing `\\` continues it on the next
line), the lines up to the next command are what it must print (stdout and
stderr together):

- words compare exactly after collapsing runs of blanks;
- numbers compare within a relative tolerance, 2 % unless the block says
  otherwise (```` ```console tol=0.1 ````), so a doc is not rewritten for a
  change in the last printed digit;
- a line `...` stands for any number of lines, `[..]` inside a line for any text;
- a command must exit 0, unless the block's first line after the fence is
  `# exit N` (then it must exit N).

A block tagged `sh`, `bash` or `python` must be marked as not runnable here by
an HTML comment on the line just above its fence, giving the reason:
`<!-- not run in CI: needs a GPU -->`. A block tagged otherwise (or untagged)
is text, not a command. Exit status 0 when every block ran and printed what
the doc says; each difference is shown with the document's line number.
`--update` rewrites the expected output of every `console` block with what the
commands printed (review the diff before committing).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?%?[,;:)]*$")
SKIP_MARK = re.compile(r"<!--\s*not run in CI:\s*(.+?)\s*-->")
RUNNABLE_TAGS = {"sh", "bash", "python", "shell"}


def blocks(path):
    """(line number of the fence, tag, options, lines, skip reason) of each fenced block."""
    lines = open(path).read().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*(.*)$", lines[i])
        if not m:
            i += 1
            continue
        start, tag, opts = i, m.group(1), m.group(2)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        skip = SKIP_MARK.search(lines[i - 1]) if i > 0 else None
        out.append((start + 1, tag, opts, lines[i + 1:j], skip.group(1) if skip else None))
        i = j + 1
    return out


def commands(body):
    """(offset in the block, command, expected lines, expected exit) of a console block."""
    exit_code = 0
    if body and body[0].startswith("# exit "):
        exit_code = int(body[0].split()[2])
        body = body[1:]
        first = 1
    else:
        first = 0
    out, i = [], 0
    while i < len(body):
        line = body[i]
        if not line.startswith("$ "):
            i += 1
            continue
        at, cmd = i + first, line[2:]
        while cmd.endswith("\\") and i + 1 < len(body):
            i += 1
            cmd = cmd[:-1] + " " + body[i].strip()
        i += 1
        expected = []
        while i < len(body) and not body[i].startswith("$ "):
            expected.append(body[i])
            i += 1
        while expected and not expected[-1].strip():
            expected.pop()
        out.append((at, cmd, expected, exit_code))
    return out


def same_word(want, got, tol):
    if want == got:
        return True
    if NUMBER.match(want) and NUMBER.match(got):
        w, g = float(want.rstrip("%,;:)")), float(got.rstrip("%,;:)"))
        return abs(w - g) <= tol * max(abs(w), abs(g)) or (w == 0 and g == 0)
    return False


def same_line(want, got, tol):
    if "[..]" in want:
        pattern = ".*".join(re.escape(" ".join(p.split())) for p in want.split("[..]"))
        if re.fullmatch(pattern, " ".join(got.split())):
            return True
        # wildcards and numbers together: compare the words around the wildcards
        parts = [p.split() for p in want.split("[..]")]
        words = got.split()
        head, tail = parts[0], parts[-1]
        return (len(words) >= len(head) + len(tail)
                and all(same_word(w, g, tol) for w, g in zip(head, words))
                and all(same_word(w, g, tol) for w, g in zip(tail, words[len(words) - len(tail):])))
    w, g = want.split(), got.split()
    return len(w) == len(g) and all(same_word(a, b, tol) for a, b in zip(w, g))


def matches(want, got, tol):
    """Whether `got` (lines) is what `want` (lines, with `...`) says; the first differing line if not."""
    def walk(i, j):
        while i < len(want):
            if want[i].strip() == "...":
                if any(walk(i + 1, k) is None for k in range(j, len(got) + 1)):
                    return None
                return (i, j)
            if j >= len(got) or not same_line(want[i], got[j], tol):
                return (i, j)
            i, j = i + 1, j + 1
        return None if j == len(got) else (i, j)
    return walk(0, 0)


def scratch_dir(repo, tmp):
    d = tempfile.mkdtemp(dir=tmp)
    for name in ("fixtures", "tools", "python"):
        os.symlink(os.path.join(repo, name), os.path.join(d, name))
    return d


def check(path, bin_dir, repo, tmp, update):
    failures, ran = [], 0
    work = scratch_dir(repo, tmp)
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"], COLUMNS="100", NO_COLOR="1")
    text = open(path).read().split("\n")
    edits = []
    for line_no, tag, opts, body, skip in blocks(path):
        if tag in RUNNABLE_TAGS and skip is None:
            failures.append(f"{path}:{line_no}: a `{tag}` block is neither run (tag it `console`, with `$ ` "
                            "before each command) nor marked `<!-- not run in CI: REASON -->` on the line above")
            continue
        if tag != "console":
            continue
        tol = float(dict(o.split("=", 1) for o in opts.split() if "=" in o).get("tol", 0.02))
        new_body = [body[0]] if body and body[0].startswith("# exit ") else []
        for at, cmd, expected, code in commands(body):
            ran += 1
            p = subprocess.run(["bash", "-c", cmd], cwd=work, env=env, capture_output=True, text=True)
            got = (p.stdout + p.stderr).rstrip("\n").split("\n") if (p.stdout + p.stderr).strip() else []
            got = [g.rstrip() for g in got]
            where = f"{path}:{line_no + 1 + at}"
            if p.returncode != code:
                failures.append(f"{where}: `{cmd}` exited {p.returncode}, the doc expects {code}\n"
                                + "\n".join("    | " + g for g in got[-15:]))
            elif (d := matches(expected, got, tol)) is not None:
                i, j = d
                failures.append(f"{where}: `{cmd}` printed something else (numbers within {tol:g})\n"
                                f"    doc line {i + 1}: {expected[i] if i < len(expected) else '(end)'}\n"
                                f"    printed:    {got[j] if j < len(got) else '(end)'}")
            new_body += ["$ " + cmd] + got
        if update:
            edits.append((line_no, len(body), new_body))
    if update:
        for line_no, n, new_body in reversed(edits):
            text[line_no:line_no + n] = new_body
        open(path, "w").write("\n".join(text))
    return ran, failures


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("docs", nargs="+")
    ap.add_argument("--bin-dir", default="target/release", help="put this first on PATH (default: %(default)s)")
    ap.add_argument("--update", action="store_true", help="rewrite the expected outputs with what was printed")
    a = ap.parse_args()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bin_dir = os.path.abspath(a.bin_dir)
    if not os.path.exists(os.path.join(bin_dir, "deltaref")):
        sys.exit(f"--bin-dir: no `deltaref` in {bin_dir} (build it: cargo build --release -p deltaref-cli)")
    total, bad = 0, []
    with tempfile.TemporaryDirectory() as tmp:
        for doc in a.docs:
            ran, failures = check(doc, bin_dir, repo, tmp, a.update)
            total += ran
            bad += failures
            print(f"{doc}: {ran} commands, {len(failures)} differences", flush=True)
    for f in bad:
        print(f, file=sys.stderr)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
