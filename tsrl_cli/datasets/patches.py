"""Unified diffs: which files a patch touches, its language, and its reverse.

SWE-smith's `patch` introduces the bug, so the gold fix is that patch reversed
(swesmith/harness/utils.py: "gold patches = bug patches, so fix = revert"). reverse_patch
writes the reverse as text so the record carries both; tests check it against `git apply -R`.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

_HUNK = re.compile(r"^@@ -(\d+(?:,\d+)?) \+(\d+(?:,\d+)?) @@(.*)$")
_DIFF_GIT = re.compile(r"^diff --git a/(.*) b/(.*)$")

# header lines of a git diff that come in old/new pairs: reversing swaps the pair
_SWAP_PREFIX = [("old mode ", "new mode "), ("rename from ", "rename to "), ("copy from ", "copy to "),
                ("deleted file mode ", "new file mode ")]

EXT_LANGUAGE = {
    "py": "python", "pyx": "python", "go": "go", "rs": "rust", "java": "java", "kt": "kotlin",
    "js": "javascript", "jsx": "javascript", "mjs": "javascript", "cjs": "javascript",
    "ts": "typescript", "tsx": "typescript", "c": "c", "h": "c", "cc": "cpp", "cpp": "cpp", "cxx": "cpp",
    "hpp": "cpp", "hh": "cpp", "rb": "ruby", "php": "php", "cs": "csharp", "swift": "swift", "scala": "scala",
}


def looks_like_diff(text: str) -> bool:
    return text.startswith("diff --git ") or ("\n--- " in "\n" + text and "\n+++ " in text and "\n@@ " in text)


def patch_files(patch: str) -> list[str]:
    """Paths touched by a diff (the b/ side of `diff --git`, else the `+++` lines)."""
    files = [m.group(2) for m in map(_DIFF_GIT.match, patch.splitlines()) if m]
    if not files:
        files = [ln[4:].split("\t")[0].removeprefix("b/") for ln in patch.splitlines() if ln.startswith("+++ ")]
    return [f for f in files if f != "/dev/null"]


def patch_language(patch: str) -> str | None:
    """The language most of the patch's files are written in, by extension; None if none is known."""
    langs = Counter(EXT_LANGUAGE[f.rsplit(".", 1)[-1].lower()] for f in patch_files(patch)
                    if "." in f and f.rsplit(".", 1)[-1].lower() in EXT_LANGUAGE)
    return langs.most_common(1)[0][0] if langs else None


def reverse_patch(patch: str) -> str:
    """The diff that undoes `patch` (text diffs only; a binary patch raises ValueError)."""
    lines = patch.splitlines(keepends=True)
    out = []
    old_left = new_left = 0  # lines still due in the current hunk; the hunk ends when both are 0
    i = 0
    while i < len(lines):
        line = lines[i]
        body = line.rstrip("\n")
        if old_left > 0 or new_left > 0:
            tag = body[:1]
            if tag == "\\":  # "\ No newline at end of file" belongs to the line before: keep it there
                out.append(line)
            elif tag in ("+", "-"):
                # '-' lines form the old image and '+' the new one; swapping signs swaps the images
                # (git apply accepts '+' lines before '-' lines within a hunk)
                old_left -= tag == "-"
                new_left -= tag == "+"
                out.append(("-" if tag == "+" else "+") + line[1:])
            else:  # context (" " or an empty line some tools leave for a blank context line)
                old_left -= 1
                new_left -= 1
                out.append(line)
        elif (m := _HUNK.match(body)) is not None:
            old_left, new_left = _count(m.group(1)), _count(m.group(2))
            out.append(f"@@ -{m.group(2)} +{m.group(1)} @@{m.group(3)}\n")
        elif body.startswith(("GIT binary patch", "Binary files ")):
            raise ValueError("binary patch: cannot reverse as text")
        elif (m := _DIFF_GIT.match(body)) is not None:
            out.append(f"diff --git a/{m.group(2)} b/{m.group(1)}\n")
        elif body.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old, new = line[4:], lines[i + 1][4:]
            out += ["--- " + _swap_side(new, "b/", "a/"), "+++ " + _swap_side(old, "a/", "b/")]
            i += 1
        else:
            out.append(_reverse_header(line))
        i += 1
    return "".join(out)


def _count(rng: str) -> int:
    """Line count of a hunk range "start,count" ("start" alone means 1)."""
    return int(rng.split(",")[1]) if "," in rng else 1


def _reverse_header(line: str) -> str:
    for a, b in _SWAP_PREFIX:
        if line.startswith(a):
            return b + line[len(a):]
        if line.startswith(b):
            return a + line[len(b):]
    m = re.match(r"^index ([0-9a-f]+)\.\.([0-9a-f]+)(.*)$", line.rstrip("\n"), re.DOTALL)
    if m:
        return f"index {m.group(2)}..{m.group(1)}{m.group(3)}\n"
    return line


def _swap_side(path: str, frm: str, to: str) -> str:
    return to + path[len(frm):] if path.startswith(frm) else path


def parse_one_line_patch(patch: str) -> tuple[str, int, str, str]:
    """(file, line number, old line, new line) of a diff that replaces one line."""
    file, start, k, minus, plus, at = None, None, 0, None, None, None
    for ln in patch.splitlines():
        if ln.startswith("+++ "):
            file = ln[4:].strip().removeprefix("b/")
        elif ln.startswith("@@"):
            m = re.match(r"@@ -(\d+)", ln)
            start, k = int(m.group(1)), 0
        elif start is None or ln.startswith("--- "):
            continue
        elif ln.startswith("-"):
            if minus is not None:
                raise ValueError("patch changes more than one line")
            minus, at = ln[1:], start + k
            k += 1
        elif ln.startswith("+"):
            if plus is not None:
                raise ValueError("patch changes more than one line")
            plus = ln[1:]
        elif ln.startswith(" ") or ln == "":
            k += 1
    if file is None or minus is None or plus is None:
        raise ValueError("not a one-line replacement patch")
    return file, at, minus, plus


def apply_one_line_patch(root, patch: str) -> bool:
    """Apply a one-line replacement patch in place under root; False when it is not one or does not match."""
    try:
        file, line, old, new = parse_one_line_patch(patch)
        path = Path(root) / file
        lines = path.read_text().splitlines(keepends=True)
    except (ValueError, OSError):
        return False
    if not 0 < line <= len(lines) or lines[line - 1].rstrip("\r\n") != old:
        return False
    lines[line - 1] = new + lines[line - 1][len(old):]
    path.write_text("".join(lines))
    return True
