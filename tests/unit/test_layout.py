"""The README's Layout block against the tree: it names every module, every path it names exists, no module of the
three packages is over 500 lines, and their modules import each other without a cycle (../shared/STYLE.md); nothing
in bcg_core below the pipeline imports it, and the pipeline imports nothing above it; no family, padding adapter or
runner is asked what it has by ``hasattr``/``getattr`` outside the declarations of ``bcg_core/capabilities.py``."""

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
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
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


ABOVE_PIPELINE = ("bcg_core.scheduler",)
"""The bcg_core packages that drive the pipeline, so may import it; every other bcg_core module sits below it (the
cost model and decider, ``bcg_core.costs``, below both the pipeline and the scheduler)."""


def _above(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in ABOVE_PIPELINE)


def _upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Import arrows that point up into the pipeline (a bcg_core module below it importing it) or up out of it (the
    pipeline importing a module of :data:`ABOVE_PIPELINE`)."""
    up = [f"{m} -> bcg_core.pipeline" for m, out in sorted(graph.items())
          if m.startswith("bcg_core.") and m != "bcg_core.pipeline" and not _above(m) and "bcg_core.pipeline" in out]
    up += [f"bcg_core.pipeline -> {t}" for t in sorted(graph.get("bcg_core.pipeline", ())) if _above(t)]
    return up


def test_nothing_below_the_pipeline_imports_it_and_it_imports_nothing_above_it():
    up = _upward_arrows(_imports())
    assert not up, "import arrows up into or out of the pipeline (move the shared part below both): " + "; ".join(up)


def test_the_upward_import_check_catches_an_arrow_each_way():
    graph = {"bcg_core.pipeline": {"bcg_core.costs.model", "bcg_core.scheduler.finish"},
             "bcg_core.costs.model": {"bcg_core.pipeline"}, "bcg_core.scheduler.loop": {"bcg_core.pipeline"},
             "deployments.dit": {"bcg_core.pipeline"}}
    assert _upward_arrows(graph) == ["bcg_core.costs.model -> bcg_core.pipeline",
                                     "bcg_core.pipeline -> bcg_core.scheduler.finish"]


DECLARATIONS = ROOT / "bcg_core" / "capabilities.py"
"""The one module that may ask a family, adapter or runner what it has (its runtime-checkable Protocols)."""

PROBED = {"family", "fam", "adapter", "inner", "runner"}
"""Names that hold a family, a padding adapter or a runner in the three packages: the last name of the first
argument of a ``hasattr``/``getattr`` call (``family``, ``self.runner``, ``pipe.runner`` ...)."""

PROBED_IN_CORE = PROBED | {"model"}
"""In bcg_core ``model`` is a loaded family too (``pipeline.model``); in deployments/ and router/ it also names
pydantic config models, which are no capability holders."""


def _probes(source: str, filename: str = "<source>", names: set[str] = PROBED_IN_CORE) -> list[str]:
    """``hasattr``/``getattr`` calls on a family, adapter or runner (``names``) in ``source``, as ``file:line call``;
    a ``__getattr__`` that forwards to the object it wraps is delegation, not a probe."""
    tree = ast.parse(source)
    delegating = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "__getattr__"
                  for n in ast.walk(f)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("hasattr", "getattr") and node.args) or id(node) in delegating:
            continue
        target = node.args[0]
        name = target.id if isinstance(target, ast.Name) else target.attr if isinstance(target, ast.Attribute) else None
        if name in names:
            found.append(f"{filename}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_family_adapter_or_runner_is_probed_with_hasattr_or_getattr_outside_the_declarations():
    found = [hit for p in _modules() if p != DECLARATIONS
             for hit in _probes(p.read_text(), str(p.relative_to(ROOT)),
                                PROBED_IN_CORE if p.is_relative_to(ROOT / "bcg_core") else PROBED)]
    assert not found, ("capabilities probed with hasattr/getattr (declare them in bcg_core/capabilities.py and answer "
                       "once where the pipeline is built): " + "; ".join(found))


def test_the_probe_check_catches_probes_and_spares_delegation():
    source = """
def f(model, pipe, config):
    a = hasattr(model, "euler_step")
    b = getattr(pipe.runner, "graph_count", None)
    c = getattr(self.adapter, "forward_plain", None)
    d = getattr(config, "quality", None)

class Wrapper:
    def __getattr__(self, name):
        return getattr(self.inner, name)
"""
    assert [h.split(" ", 1)[0] for h in _probes(source)] == ["<source>:3", "<source>:4", "<source>:5"]
