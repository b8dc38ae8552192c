#!/usr/bin/env python3
"""tests/docs/snippets_test.py — the C++ in the docs compiles.

Every ```cpp block of README.md, docs/*.md and the folders' README.md files is compiled
(-fsyntax-only: parsed and type-checked, no code made) with the include paths and
definitions of Troupe::app, as an app would see them. Each block becomes one namespace of
one translation unit: its #include lines go to the top, the rest inside `namespace
snippet_<n> { ... }`, so every block must be whole C++ at file scope (declarations and
definitions; a fragment of statements goes inside a function of the snippet). A block
preceded by the line `<!-- snippet: not compiled (<why>) -->` is left out; the reason is
printed. Exit status 0 when everything compiles; else the compiler's errors, each mapped
back to its file and line in the docs.

Usage: snippets_test.py --root SRC --flags FLAGS_FILE --compiler CXX [--out DIR]
"""
import argparse
import pathlib
import re
import subprocess
import sys
import tempfile


def blocks(path):
    """(first line number, text lines, skip reason) of each ```cpp block of `path`."""
    out = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() in ("```cpp", "```c++"):
            skip = None
            if i > 0:
                m = re.match(r"\s*<!--\s*snippet:\s*not compiled\s*\((.*)\)\s*-->", lines[i - 1])
                if m:
                    skip = m.group(1)
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            out.append((i + 2, lines[i + 1:j], skip))
            i = j
        i += 1
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--flags", required=True)
    ap.add_argument("--compiler", required=True)
    ap.add_argument("--out")
    a = ap.parse_args()
    root = pathlib.Path(a.root)
    docs = [root / "README.md"] + sorted((root / "docs").glob("*.md")) + sorted(root.glob("*/README.md")) + \
        sorted(root.glob("*/*/README.md"))
    # The project's own pages: not a build folder's, nor a hidden folder's (a copy of the
    # tree kept beside it, a tool's cache).
    docs = [d for d in docs if not any(part.startswith(".") or part.startswith("build")
                                       for part in d.relative_to(root).parts[:-1])]
    # The system include directory stays the compiler's own (an -I for it reorders the
    # standard headers' #include_next chain).
    flags = [f for f in pathlib.Path(a.flags).read_text().split("\n") if f.strip() and f.strip() != "-I/usr/include"]
    includes, body, origin = [], [], []  # origin[k]: (doc, line) of body line k (1-based in the TU)
    n = 0
    for doc in docs:
        for first, text, skip in blocks(doc):
            rel = doc.relative_to(root)
            if skip is not None:
                print(f"{rel}:{first}: not compiled ({skip})")
                continue
            n += 1
            body.append((f"namespace snippet_{n} {{  // {rel}:{first}", None))
            for k, line in enumerate(text):
                if line.lstrip().startswith("#include"):
                    includes.append(line)
                    body.append(("", None))
                else:
                    body.append((line, (rel, first + k)))
            body.append((f"}}  // namespace snippet_{n}", None))
    if n == 0:
        print("no C++ snippets found", file=sys.stderr)
        return 1
    tu = includes + [line for line, _ in body]
    where = [None] * len(includes) + [o for _, o in body]
    work = pathlib.Path(a.out) if a.out else pathlib.Path(tempfile.mkdtemp(prefix="troupe-snippets-"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / "docs_snippets.cc"
    src.write_text("\n".join(tu) + "\n")
    cmd = [a.compiler, "-std=c++20", "-fsyntax-only", "-Wall", "-Wno-unused", *flags, str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        def mapped(m):
            line = int(m.group(1))
            o = where[line - 1] if 0 < line <= len(where) else None
            return f"{o[0]}:{o[1]}" if o else f"{src}:{line}"
        print(re.sub(re.escape(str(src)) + r":(\d+)", mapped, r.stderr)[:20000], file=sys.stderr)
        print(f"docs snippets: the C++ of the docs does not compile ({src})", file=sys.stderr)
        return 1
    print(f"docs snippets: {n} C++ blocks from {len(docs)} pages compile ({src})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
