"""reverse_patch against git itself: the reverse of a real `git diff` undoes it, and reversing twice is exact."""

import shutil
import subprocess

import pytest

from tsrl_cli.datasets.patches import patch_files, patch_language, reverse_patch

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo, *args, stdin=None):
    return subprocess.run(["git", "-C", str(repo), *args], input=stdin, capture_output=True, text=True,
                          check=True).stdout


def _tree(repo):
    return {p.relative_to(repo).as_posix(): p.read_bytes() for p in sorted(repo.rglob("*"))
            if p.is_file() and ".git" not in p.parts}


@pytest.fixture
def repo_pair(tmp_path):
    """A repo at commit A (the fixed code) and a diff A -> B that introduces a bug, SWE-smith style."""
    repo = tmp_path / "r"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@t")
    _git(repo, "config", "user.name", "t")
    (repo / "a.py").write_text("".join(f"line {i}\n" for i in range(30)))
    (repo / "gone.py").write_text("x = 1\n")
    (repo / "old_name.py").write_text("def f():\n    return 1\n")
    (repo / "noeol.txt").write_text("a\nb")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "A")
    fixed = _tree(repo)
    # the bug: edits in two hunks, a deleted file, a new file, a rename with an edit, a file without final newline
    lines = (repo / "a.py").read_text().splitlines(keepends=True)
    lines[3] = "line 3 changed\n"
    lines.insert(20, "inserted\n")
    del lines[25]
    (repo / "a.py").write_text("".join(lines))
    (repo / "gone.py").unlink()
    (repo / "new.py").write_text("y = 2\n")
    (repo / "old_name.py").rename(repo / "new_name.py")
    (repo / "new_name.py").write_text("def f():\n    return 2\n")
    (repo / "noeol.txt").write_text("a\nc")
    _git(repo, "add", "-A")
    bug_patch = _git(repo, "diff", "--cached", "-M", "HEAD")
    _git(repo, "commit", "-qm", "B")
    return repo, fixed, bug_patch


@needs_git
def test_reverse_undoes_the_bug(repo_pair):
    repo, fixed, bug_patch = repo_pair
    gold = reverse_patch(bug_patch)
    _git(repo, "apply", "--check", "-", stdin=gold)
    _git(repo, "apply", "-", stdin=gold)
    assert _tree(repo) == fixed


@needs_git
def test_reverse_twice_is_identity(repo_pair):
    _, _, bug_patch = repo_pair
    assert reverse_patch(reverse_patch(bug_patch)) == bug_patch


def test_reverse_plain_unified_diff():
    """Hunk line counts, not prefixes, end a hunk: a removed line "-- x" is not a file header."""
    p = "--- a/f.txt\n+++ b/f.txt\n@@ -1,2 +1,2 @@\n keep\n--- x\n+++ y\n"
    assert reverse_patch(p) == "--- a/f.txt\n+++ b/f.txt\n@@ -1,2 +1,2 @@\n keep\n+-- x\n-++ y\n"


def test_binary_patch_refused():
    with pytest.raises(ValueError, match="binary"):
        reverse_patch("diff --git a/x.png b/x.png\nindex 1..2 100644\nGIT binary patch\nliteral 1\n")


def test_files_and_language():
    p = ("diff --git a/src/a.go b/src/a.go\n--- a/src/a.go\n+++ b/src/a.go\n@@ -1 +1 @@\n-a\n+b\n"
         "diff --git a/src/b.go b/src/b.go\n--- a/src/b.go\n+++ b/src/b.go\n@@ -1 +1 @@\n-a\n+b\n"
         "diff --git a/README.md b/README.md\n--- a/README.md\n+++ b/README.md\n@@ -1 +1 @@\n-a\n+b\n")
    assert patch_files(p) == ["src/a.go", "src/b.go", "README.md"]
    assert patch_language(p) == "go"
    assert patch_language("diff --git a/README b/README\n") is None
