"""The project's modules import one another without a cycle, and the data package never imports the model package.

Read from the source with `ast`, so every import counts: those under `TYPE_CHECKING` and those inside functions too.
A cycle works at runtime only by the order of imports, and it ties files together that should be read one by one.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("interleave_data", "interleave_model")


def _project_modules() -> dict[str, Path]:
    modules = {"cli": ROOT / "cli.py"}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if path.stem == "__init__" else parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that `name` imports: `import a.b`, `from a import b` (b a module or a name), relative."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            # `from package import module` imports the module; `from module import name` imports the module
            candidates = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found |= {c for c in candidates if c in modules and c != name}
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a list of modules, first == last, or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _graph() -> dict[str, set[str]]:
    modules = _project_modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_the_graph_sees_every_form_of_import():
    graph, module = _graph(), "interleave_model.module"
    assert "interleave_model.algorithm.grpo" in graph[module]  # from interleave_model.algorithm import grpo
    assert "interleave_model.algorithm.records" in graph[module]  # from interleave_model.algorithm.records import ...
    assert "interleave_data.corpus" in graph["interleave_data.datamodule"]  # from .corpus import ... or absolute


def test_the_graph_sees_the_subpackages():
    graph = _graph()
    assert "interleave_model.generation.sampler" in graph and "interleave_model.run.callbacks" in graph
    assert "interleave_model.model.policy" in graph["interleave_model.generation.sampler"]


def _subpackage(module: str) -> str:
    """The subpackage of interleave_model a module is in (`interleave_model.algorithm`), else the module itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "interleave_model" and len(parts) > 2 else module


def test_no_import_cycle_between_subpackages():
    """The subpackages stand in layers: none imports one that imports it back, through any files."""
    subpackages: dict[str, set[str]] = {}
    for name, deps in _graph().items():
        home = _subpackage(name)
        subpackages.setdefault(home, set()).update(_subpackage(d) for d in deps if _subpackage(d) != home)
    cycle = _cycle(subpackages)
    assert cycle is None, "subpackages import each other: " + " -> ".join(cycle)


def test_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_data_never_imports_the_model():
    graph = _graph()
    wrong = {name: sorted(m for m in deps if m.startswith("interleave_model")) for name, deps in graph.items()}
    wrong = {name: deps for name, deps in wrong.items() if name.startswith("interleave_data") and deps}
    assert not wrong, f"interleave_data imports interleave_model: {wrong}"


def test_importing_the_package_installs_no_import_hook_and_stays_light():
    """Old module paths are resolved where checkpoints load (`model/migrations.py`), not by an import finder."""
    code = "import sys; before = list(sys.meta_path); import interleave_model; "
    code += "print(sys.meta_path == before, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False"]


def test_training_never_imports_lm_eval():
    """lm-eval is an optional extra (`.[eval]`): only its tasks' functions use the project, never the reverse."""
    code = "import sys, cli, interleave_model.module; print('lm_eval' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"]
    importers = [name for name, path in _project_modules().items()
                 if re.search(r"^\s*(import|from) lm_eval\b", path.read_text(), re.M)]  # fmt: skip
    assert importers == ["interleave_model.evaluation.served"]  # the served-model command, an lm-eval front end
