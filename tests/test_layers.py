"""The dependency direction: rl > reward > rollout > (envs | policy); only rl imports ray."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {
    "envs": set(),
    "policy": set(),
    "rollout": {"envs", "policy"},
    "reward": {"rollout", "envs", "policy"},
    "rl": {"reward", "rollout", "envs", "policy"},
}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_packages_import_only_layers_below():
    problems = []
    for package, allowed in ALLOWED.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            ours = imports_of(path) & set(ALLOWED)
            for name in ours - allowed - {package}:
                problems.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not problems, "layering violations:\n" + "\n".join(problems)


def test_only_rl_imports_ray():
    offenders = [
        str(path.relative_to(ROOT))
        for package in ALLOWED
        if package != "rl"
        for path in (ROOT / package).rglob("*.py")
        if "ray" in imports_of(path)
    ]
    assert not offenders, f"only rl/ may import ray: {offenders}"
