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


# rl/ in rooms: each imports only the rooms before it (rl.cli sits on top of them all; rl.faults,
# the chaos suite's switches, is a leaf anyone may call).
RL_ROOMS = ["config", "learner", "observe", "sft", "run"]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in ALLOWED for p in sorted((ROOT / pkg).rglob("*.py"))}


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """Our modules `path` imports, at any depth in the file (function-level imports count):
    `from a.b import c` is a.b.c when that is a module of ours, else a.b."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in known:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            out.update(subs or {node.module})
    return out


def test_rl_rooms_import_only_rooms_below():
    problems = []
    for name, path in product_modules().items():
        parts = name.split(".")
        if parts[0] != "rl" or len(parts) < 3 or parts[1] not in RL_ROOMS:
            continue
        below = set(RL_ROOMS[: RL_ROOMS.index(parts[1]) + 1])
        for dep in imported_modules(path, set(product_modules())):
            dparts = dep.split(".")
            if dparts[0] != "rl" or dep in ("rl", "rl.faults"):  # the bare package: no code
                continue
            if len(dparts) < 2 or dparts[1] not in below:
                problems.append(f"{name} imports {dep}")
    assert not problems, "rl/ rooms out of order:\n" + "\n".join(problems)


def test_rl_is_only_rooms_and_the_cli():
    loose = {p.name for p in (ROOT / "rl").glob("*.py")} - {"__init__.py", "cli.py", "faults.py"}
    rooms = {p.name for p in (ROOT / "rl").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert not loose, f"rl/ modules outside a room: {sorted(loose)}"
    assert rooms == set(RL_ROOMS), rooms


def test_the_k3_model_never_imports_its_rollout_engine():
    modules = product_modules()
    offenders = [
        f"{name} imports {dep}"
        for name, path in modules.items()
        if name.startswith("policy.k3") and not name.startswith("policy.k3.engine")
        for dep in imported_modules(path, set(modules))
        if dep.startswith("policy.k3.engine")
    ]
    assert not offenders, offenders


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle in `graph`, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle_in_product_code():
    """Imports inside functions count too: a lazy import hides a circle, it does not open it.
    Importing one's own package, or a package's __init__ re-exporting its modules, is none."""
    modules = product_modules()

    def counts(name: str, dep: str) -> bool:
        own_module = modules[name].name == "__init__.py" and dep.startswith(name + ".")
        return not name.startswith(dep + ".") and not own_module

    graph = {
        name: {d for d in imported_modules(path, set(modules)) if counts(name, d)}
        for name, path in modules.items()
    }
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
