"""The tree names no machine's absolute paths: a clone anywhere reads the same (the K3 reference
is `../shared/reference/...`, beside the repository)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ABSOLUTE = re.compile(r"(?<![\w.~-])/(?:work|home|root|Users)/")
# The sandbox tests name paths a sandboxed program must not read: the point of those tests.
ALLOWED = {"tests/envs/test_sandbox.py", "tests/test_tree.py"}


def test_no_absolute_paths_in_the_tree():
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    hits = []
    for name in sorted(set(files) - ALLOWED):
        path = ROOT / name
        if not path.is_file() or path.suffix not in {".py", ".md", ".yaml", ".toml", ".sh", ""}:
            continue
        text = path.read_text(errors="replace")
        hits += [f"{name}:{text.count(chr(10), 0, m.start()) + 1}" for m in ABSOLUTE.finditer(text)]
    assert not hits, f"absolute paths: {hits}"
