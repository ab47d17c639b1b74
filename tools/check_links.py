#!/usr/bin/env python3
"""Checks that the repository's links and file references point at files that exist.

Two checks, over the files git tracks (`git ls-files`, run from the repository root, which is
found from this script's location, so it works from any directory):

  (a) Markdown: every relative link or image in a tracked *.md file -- [text](target),
      ![alt](target), [id]: target, and <a href> / <img src> -- must name a tracked file or a
      folder holding one. http(s):, mailto: and other scheme links and pure #anchors are
      ignored; a #anchor or ?query after a file name is stripped. A target is relative to the
      Markdown file's folder (a leading / means the repository root). Code blocks and inline
      code are not links and are skipped.
  (b) Comments: in tracked C++/CUDA (.cpp .hpp .h .cc .cu .cuh .inc), CMake (CMakeLists.txt,
      .cmake, .cmake.in), shell (.sh, or a bash/sh shebang) and Python (.py, or a python
      shebang) files, every path in a comment (and in a Python docstring) that starts with a
      top-level folder of the repository, or with a folder under include/ (oasiskv/...), and
      ends in a file extension, must name a tracked file: relative to the repository root, to
      the commenting file's folder, or to include/.

A file counts as existing when git tracks it and it is on disk (a file deleted but not yet
staged does not count; a new file counts once it is added). Exits 1 after listing every problem
as `file:line: what`, else prints `check_links: OK (N files)`, N being the files checked.
Standard library only. Usage: python3 tools/check_links.py
"""

from __future__ import annotations

import io
import os
import posixpath
import re
import subprocess
import sys
import tokenize
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent

CXX_SUFFIXES = (".cpp", ".hpp", ".h", ".cc", ".cu", ".cuh", ".inc")
CMAKE_SUFFIXES = (".cmake", ".cmake.in")
SHELL_SUFFIXES = (".sh",)
PYTHON_SUFFIXES = (".py",)


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    return [p for p in out.decode("utf-8", "surrogateescape").split("\0") if p]


class Tree:
    """The tracked files that are on disk, and the folders that hold them."""

    def __init__(self, files: list[str]):
        self.files = {p for p in files if (ROOT / p).is_file()}
        self.dirs: set[str] = set()
        for p in self.files:
            d = posixpath.dirname(p)
            while d and d not in self.dirs:
                self.dirs.add(d)
                d = posixpath.dirname(d)
        self.top_dirs = sorted({p.split("/", 1)[0] for p in self.files if "/" in p})
        self.include_dirs = sorted({p.split("/")[1] for p in self.files if p.startswith("include/") and p.count("/") >= 2})

    def has_file(self, path: str) -> bool:
        return path in self.files

    def has(self, path: str) -> bool:
        return path in self.files or path in self.dirs or path == ""


def normalise(path: str) -> str | None:
    """A repository-relative path, or None when it leaves the repository."""
    p = posixpath.normpath(path)
    if p == ".":
        return ""
    if p.startswith("../") or p == ".." or p.startswith("/"):
        return None
    return p


# ---- (a) Markdown -----------------------------------------------------------------------------

# [text](target) and ![alt](target); the target may hold one level of balanced parentheses and
# an optional "title".
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|(?:[^()\s]|\([^()\s]*\))+)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_ATTR = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*[\"']([^\"']+)[\"']", re.I)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")


def markdown_targets(text: str):
    """(line, target) of every link in the Markdown text, outside code."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            continue
        if m:
            fence = m.group(1)
            continue
        stripped = CODE_SPAN.sub(lambda c: " " * len(c.group(0)), line)
        for m in INLINE_LINK.finditer(stripped):
            yield number, m.group(1)
        m = REFERENCE_DEF.match(stripped)
        if m:
            yield number, m.group(1)
        for m in HTML_ATTR.finditer(stripped):
            yield number, m.group(1)


def check_markdown(path: str, tree: Tree, problems: list[str]) -> None:
    text = (ROOT / path).read_text(encoding="utf-8", errors="replace")
    base = posixpath.dirname(path)
    for number, raw in markdown_targets(text):
        target = raw.strip()
        if target.startswith("<") and target.endswith(">"):
            target = target[1:-1].strip()
        if not target or target.startswith("#") or SCHEME.match(target) or target.startswith("//"):
            continue
        target = unquote(target.split("#", 1)[0].split("?", 1)[0])
        if not target:
            continue
        joined = target.lstrip("/") if target.startswith("/") else posixpath.join(base, target)
        resolved = normalise(joined)
        if resolved is None:
            problems.append(f"{path}:{number}: link leaves the repository: {raw}")
        elif not tree.has(resolved):
            problems.append(f"{path}:{number}: link to a file that does not exist: {raw}")


# ---- (b) comments of source files -------------------------------------------------------------


def language(path: str) -> str | None:
    name = posixpath.basename(path)
    if name.endswith(CXX_SUFFIXES):
        return "cxx"
    if name == "CMakeLists.txt" or name.endswith(CMAKE_SUFFIXES):
        return "cmake"
    if name.endswith(SHELL_SUFFIXES):
        return "shell"
    if name.endswith(PYTHON_SUFFIXES):
        return "python"
    if "." not in name:
        try:
            with open(ROOT / path, "rb") as f:
                first = f.readline(200)
        except OSError:
            return None
        if first.startswith(b"#!"):
            if b"python" in first:
                return "python"
            if re.search(rb"\b(ba|da|z|k)?sh\b", first):
                return "shell"
    return None


def cxx_comments(text: str):
    """(line, comment text) of the // and /* */ comments, outside string and char literals."""
    i, n, line = 0, len(text), 1
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            yield line, text[i + 2:end]
            i = end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end
            body = text[i + 2:end]
            for k, part in enumerate(body.split("\n")):
                yield line + k, part
            line += body.count("\n")
            i = end + 2
        elif c == "R" and text.startswith('"', i + 1) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'R"([^()\\\s]{0,16})\(', text[i:])
            if not m:
                i += 1
                continue
            close = ")" + m.group(1) + '"'
            end = text.find(close, i + m.end())
            end = n if end < 0 else end + len(close)
            line += text.count("\n", i, end)
            i = end
        elif c == '"' or (c == "'" and not (i > 0 and (text[i - 1].isalnum() or text[i - 1] == "_"))):
            # a string or char literal (a ' after a digit or letter is a digit separator: 1'000)
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            i = j + 1
        else:
            i += 1


def hash_comments(text: str, quotes: str):
    """(line, comment text) of # comments outside quotes (shell, CMake). A # starts a comment at
    the start of a line or after whitespace or ; ( ) (shell words), not inside quotes."""
    quote = None
    for number, line in enumerate(text.split("\n"), 1):
        i, n = 0, len(line)
        while i < n:
            c = line[i]
            if quote:
                if c == "\\" and quote != "'":
                    i += 2
                    continue
                if c == quote:
                    quote = None
            elif c == "\\":
                i += 2
                continue
            elif c in quotes:
                quote = c
            elif c == "#" and (i == 0 or line[i - 1] in " \t;()"):
                yield number, line[i + 1:]
                break
            i += 1


def python_comments(text: str):
    """(line, text) of the comments and docstrings (a string that is a whole statement)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        yield from hash_comments(text, "\"'")
        return
    skip = (tokenize.COMMENT, tokenize.NL)
    significant = [t for t in tokens if t.type not in skip]
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string[1:]
    starts = (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    for k, tok in enumerate(significant):
        if tok.type != tokenize.STRING:
            continue
        before = significant[k - 1].type if k > 0 else tokenize.NEWLINE
        after = significant[k + 1].type if k + 1 < len(significant) else tokenize.ENDMARKER
        if before in starts and after in (tokenize.NEWLINE, tokenize.ENDMARKER):
            for j, part in enumerate(tok.string.split("\n")):
                yield tok.start[0] + j, part


def comment_path_pattern(tree: Tree) -> re.Pattern:
    roots = [re.escape(d) for d in tree.top_dirs + tree.include_dirs]
    return re.compile(r"(?<![\w./:@$~-])((?:" + "|".join(roots) + r")/[\w.+/-]*?\.[A-Za-z][A-Za-z0-9]*)(?![\w/-])")


def check_comments(path: str, kind: str, tree: Tree, pattern: re.Pattern, problems: list[str]) -> None:
    text = (ROOT / path).read_text(encoding="utf-8", errors="replace")
    if kind == "cxx":
        comments = cxx_comments(text)
    elif kind == "cmake":
        comments = hash_comments(text, '"')
    elif kind == "shell":
        comments = hash_comments(text, "\"'")
    else:
        comments = python_comments(text)
    base = posixpath.dirname(path)
    for number, comment in comments:
        for m in pattern.finditer(comment):
            ref = m.group(1)
            candidates = (ref, posixpath.join(base, ref), posixpath.join("include", ref))
            if not any((p := normalise(c)) is not None and tree.has_file(p) for c in candidates):
                problems.append(f"{path}:{number}: comment names a file that does not exist: {ref}")


def main() -> int:
    try:
        files = tracked_files()
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"check_links: cannot list the tracked files (git ls-files in {ROOT}): {e}", file=sys.stderr)
        return 2
    tree = Tree(files)
    pattern = comment_path_pattern(tree)
    problems: list[str] = []
    checked = 0
    for path in sorted(tree.files):
        if path.endswith(".md"):
            check_markdown(path, tree, problems)
            checked += 1
            continue
        kind = language(path)
        if kind:
            check_comments(path, kind, tree, pattern, problems)
            checked += 1
    if problems:
        for p in problems:
            print(p)
        print(f"check_links: {len(problems)} problem(s) in {checked} files", file=sys.stderr)
        return 1
    print(f"check_links: OK ({checked} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
