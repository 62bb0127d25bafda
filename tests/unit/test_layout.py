"""The shape of the code, as ``docs/architecture.md``'s module map states it: imports point down the
floors only, no module is over 700 lines, the package root holds at most six modules, no test
module imports another, and the README stays a newcomer's page whose layout names every package.

Why a test: these are the properties a reader relies on to find their way (issue 28); each one
drifted once when nothing checked it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "rolloutpipe"

# lower floors are imported by higher ones, never the other way; two packages on one floor do not
# import each other (the model and the tasks, the trainer and the rollout side)
FLOORS = {
    "errors": 0, "plugins": 1, "runtime": 1, "metrics": 1,
    "config": 2,
    "broker": 3,
    "rl": 4,
    "model": 5, "tasks": 5, "scheduling": 5, "agents": 5,
    "engines": 6,
    "roles": 7, "roles.trainer": 7,
    "tools": 8,
    "launch": 9,
    "bench": 10,
    "cli": 11, "__main__": 12,
}  # fmt: skip


def _unit(module: str) -> str:
    """``rolloutpipe.roles.trainer.step`` -> ``roles.trainer``; ``rolloutpipe.errors`` -> ``errors``."""
    parts = module.split(".")[1:]
    if parts[:2] == ["roles", "trainer"]:
        return "roles.trainer"
    return parts[0]


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rolloutpipe"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("rolloutpipe")}
    return found


def test_every_package_and_root_module_has_a_floor() -> None:
    units = {_unit(m) for m in _modules() if m != "rolloutpipe"}
    assert units == set(FLOORS), f"give these a floor in FLOORS and in the module map: {units ^ set(FLOORS)}"


def test_imports_point_down_the_floors() -> None:
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        if name == "rolloutpipe":
            continue
        src = _unit(name)
        for target in _imports(path):
            if target not in modules or target == "rolloutpipe":
                continue  # a name imported from a module, or the package itself
            dst = _unit(target)
            if dst != src and FLOORS[dst] >= FLOORS[src]:
                wrong.append(f"{name} -> {target}")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(sorted(wrong))


def test_the_root_holds_at_most_six_modules_and_none_is_over_700_lines() -> None:
    root = sorted(p.name for p in PKG.glob("*.py") if p.name != "__init__.py")
    assert len(root) <= 6, root
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in PKG.rglob("*.py")}
    long = {name: n for name, n in lines.items() if n > 700}
    assert not long, long


def test_no_test_module_imports_another() -> None:
    bad = []
    for p in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n.split(".")[-1].startswith("test_") for n in names):
                bad.append(f"{p.relative_to(ROOT)}: {names[0]}")
    assert not bad, bad


def test_the_readme_is_short_and_its_layout_names_every_package() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text) <= 20_000, len(text)
    layout = text.split("## Layout", 1)[1]
    folders = sorted(str(p.parent.relative_to(ROOT)) for p in PKG.rglob("__init__.py"))
    missing = [f for f in folders if f"`{f}/`" not in layout]
    assert not missing, f"the README's layout does not name {missing}"


def test_the_module_map_names_every_module() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    table = doc.split("## Module map", 1)[1].split("\n## ", 1)[0]
    missing = []
    for name, path in _modules().items():
        rel = path.parent.relative_to(PKG).as_posix()
        if path.name == "__init__.py":  # a package: its folder is a row
            if name != "rolloutpipe" and f"`{rel}/`" not in table:
                missing.append(name)
        elif not re.search(rf"`{re.escape(path.stem)}`", table):
            missing.append(name)
    assert not missing, f"docs/architecture.md's module map does not name {missing}"
    assert "roles/trainer/step.py" in table
