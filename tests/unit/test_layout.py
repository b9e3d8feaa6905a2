"""The README's Layout block against the tree: it names every module, every path it names exists, no module of the
three packages is over 500 lines, and their modules import each other without a cycle (../shared/STYLE.md)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("bcg_core", "router", "deployments")
MAX_LINES = 500


def _layout_block() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Layout\n", 1)[1]
    return section.split("```\n", 1)[1].split("```", 1)[0].splitlines()


def _entries() -> list[tuple[Path, str]]:
    """``(path, description)`` of each entry of the block; continuation lines join the entry above. A top-level
    path is relative to the repository, an indented one to the last top-level folder."""
    entries: list[tuple[Path, str]] = []
    top = ROOT
    for line in _layout_block():
        m = re.match(r"^( *)(\S+)( {2,}(.*))?$", line)
        if m is None or len(m.group(1)) > 2:  # a continuation of the description above
            path, desc = entries[-1]
            entries[-1] = (path, desc + " " + line.strip())
            continue
        base = ROOT if not m.group(1) else top
        path = base / m.group(2)
        if not m.group(1) and m.group(2).endswith("/"):
            top = path
        entries.append((path, m.group(4) or ""))
    return entries


def _named_modules() -> set[Path]:
    """Every module the block names: its own entries, and ``x.py`` words of a description (of the entry's folder,
    or of the folder it sits in)."""
    named = set()
    for path, desc in _entries():
        folder = path if path.is_dir() else path.parent
        if path.suffix == ".py":
            named.add(path)
        named.update(folder / word for word in re.findall(r"\b(\w+\.py)\b", desc))
    return named


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_every_path_the_layout_names_exists():
    missing = [str(p.relative_to(ROOT)) for p, _ in _entries() if not p.exists()]
    missing += [str(p.relative_to(ROOT)) for p in _named_modules() if not p.is_file()]
    assert not missing, f"README's Layout names paths that do not exist: {missing}"


def test_the_layout_names_every_module_and_package():
    named = _named_modules()
    listed = {p for p, _ in _entries()}
    left_out = [str(p.relative_to(ROOT)) for p in _modules() if p.name != "__init__.py" and p not in named]
    packages = {p.parent for p in _modules() if p.name == "__init__.py"} - {ROOT / pkg for pkg in PACKAGES}
    left_out += [str(p.relative_to(ROOT)) + "/" for p in sorted(packages) if p not in listed]
    assert not left_out, f"README's Layout leaves out: {left_out}"


def test_no_module_of_the_three_packages_is_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Module -> the modules of the three packages it imports (anywhere in the file, lazily too). An import of a
    package's ``__init__`` counts only where it names a submodule (an ``__init__`` only re-exports names)."""
    files = {_module_name(p): p for p in _modules()}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        if path.name == "__init__.py":
            continue
        package = name.rsplit(".", 1)[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                if t in files and files[t].name != "__init__.py" and t != name:
                    out.add(t)
        graph[name] = out
    return graph


def test_the_three_packages_have_no_import_cycle():
    graph = _imports()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_two_test_modules_share_a_file_name():
    """The test folders have no ``__init__.py``: pytest imports each test module by its file name, so two of one
    name (``tests/engine/test_x.py`` and ``tests/families/test_x.py``) stop the whole run at collection."""
    names: dict[str, list[str]] = {}
    for p in (ROOT / "tests").rglob("test_*.py"):
        names.setdefault(p.name, []).append(str(p.relative_to(ROOT)))
    assert not {n: ps for n, ps in names.items() if len(ps) > 1}
