"""The package's walls, read from the imports of every module (function-level ones included).

Wings rank from the algorithm up: core (0); proposers and models (1, on the core); adaptive and
accel (2, on those); study (3); train (4). A module may import its own wing and wings of lower rank
only. So `core/` and `proposers/` import nothing from accel, adaptive, study or train, the wings
form no cycle, and nothing imports back up (the package's `__init__` and `__main__` stand above all).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "specdec"
RANK = {"core": 0, "proposers": 1, "models": 1, "adaptive": 2, "accel": 2, "study": 3, "train": 4}
TOP = {"__init__", "__main__"}


def _wing(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import of a specdec module in `path`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.level:  # relative: resolve against the module's package
                base = list(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-node.level])
                module = ".".join([*base, node.module])
            else:
                module = node.module
            names = [f"{module}.{a.name}" for a in node.names] if module == "specdec" else [module]
            out += [(node.lineno, m) for m in names if m.startswith("specdec.")]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("specdec.")]
    return out


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if _wing(p) not in TOP | {"conf"})


def test_every_module_sits_in_a_known_wing():
    assert {_wing(p) for p in MODULES} == set(RANK)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_only_to_the_same_or_a_lower_wing(path):
    wing = _wing(path)
    wrong = [f"line {line}: {module}" for line, module in _imports(path)
             if (target := module.split(".")[1]) != wing and RANK.get(target, 99) >= RANK[wing]]
    assert not wrong, f"{path.relative_to(PACKAGE)} ({wing}) imports upward or sideways: {wrong}"


def test_the_check_sees_an_upward_import(tmp_path):
    """The reader is not blind: a core module that imports the study is caught."""
    bad = PACKAGE / "core" / "decoding.py"
    source = bad.read_text() + "\n\ndef _late():\n    from specdec.study.config import validate  # noqa: F401\n"
    copy = tmp_path / "specdec" / "core" / "decoding.py"
    copy.parent.mkdir(parents=True)
    copy.write_text(source)
    found = [m for _, m in _imports(copy) if m.startswith("specdec.study")]
    assert found == ["specdec.study.config"]
