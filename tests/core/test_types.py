"""Shared types live beneath the parts that exchange them: `specdec.core.types` holds the hand-offs and
protocols, their old homes hand the very same objects on, and the package's imports form no cycle
(read from the source, lazy and TYPE_CHECKING imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

import specdec.core.decoding
import specdec.core.types
import specdec.core.verify
import specdec.proposers.base

PACKAGE = Path(specdec.core.types.__file__).parents[1]


def test_old_homes_hand_on_the_same_objects():
    for name in ("DecodeState", "StepOutcome", "Generation", "Proposal", "Proposer", "TokenCallback"):
        assert getattr(specdec.core.decoding, name) is getattr(specdec.core.types, name), name
    for name in ("DecodeState", "StepOutcome", "Proposal", "Proposer"):
        assert getattr(specdec.proposers.base, name) is getattr(specdec.core.types, name), name
    assert specdec.core.verify.Verification is specdec.core.types.Verification


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The specdec modules `path` imports, anywhere in the file."""
    here = _module(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    return {m for m in found if m in modules and m != here}


def test_no_import_cycle_in_the_package():
    files = [p for p in PACKAGE.rglob("*.py") if "conf" not in p.relative_to(PACKAGE).parts[:1]]
    modules = {_module(p) for p in files}
    graph = {_module(p): _imports(p, modules) for p in files}
    graph["specdec"] = set()  # the package's face only hands names on; importing a submodule runs it first
    assert graph["specdec.core.types"] <= {"specdec.core.metrics", "specdec.core.sampling", "specdec.core.device"}
    assert graph["specdec.core.device"] == set()  # a leaf: the hand-offs may upload with it
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module):] + [module]))
        if module in done:
            return
        for other in sorted(graph[module]):
            visit(other, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
