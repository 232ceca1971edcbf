"""The import rules of docs/architecture.md, checked by parsing every module of the package."""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "cp_cache"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
STRATEGIES = ("cp_cache.algorithms.ring", "cp_cache.algorithms.ulysses", "cp_cache.algorithms.packed")
MAX_FUNCTION_LINES = 60
MAX_TND_FILES = 2
MAX_MODULE_DOCSTRING_LINES = 15
MAX_ENGINE_LINES = 1_800
MAX_RUNTIME_LINES = 9_000  # the package minus cli/, testing/ and emulator/
MAX_ATTENTION_LINES = 7_000  # the runtime minus mixers/ (the sequence mixers other than attention)
NATIVE = "cp_cache._C"  # the extension: a module without a .py file


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@lru_cache(maxsize=None)
def _modules() -> dict[str, tuple[Path, ast.Module]]:
    return {_module_name(p): (p, ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[:len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> list[tuple[str, str]]:
    """(imported cp_cache module, imported name or "") of every import in ``module``, lazy
    ones included; ``from pkg import sub`` counts as an import of the submodule."""
    path, tree = _modules()[module]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names if a.name.split(".")[0] == "cp_cache"]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path, node)
            if target.split(".")[0] != "cp_cache":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub, "") if sub in _modules() or sub == NATIVE else (target, alias.name))
    return found


@lru_cache(maxsize=None)
def _floors() -> list[tuple[str, list[str]]]:
    """The ``floors`` block of docs/architecture.md: (floor, module patterns), top first."""
    block = re.search(r"```floors\n(.*?)```", ARCHITECTURE.read_text(), re.S)
    assert block, "docs/architecture.md has no ```floors block"
    return [(line.split()[0], line.split()[1:]) for line in block.group(1).splitlines() if line.strip()]


def _matches(module: str, pattern: str) -> bool:
    if pattern.endswith(".*"):
        return module == pattern[:-2] or module.startswith(pattern[:-1])
    return module == pattern


def _floor_of(module: str) -> int:
    found = [i for i, (_, patterns) in enumerate(_floors()) if any(_matches(module, p) for p in patterns)]
    assert len(found) == 1, f"{module} is on {len(found)} floors of docs/architecture.md (needs exactly one)"
    return found[0]


def _is_tool(module: str) -> bool:
    return _floors()[_floor_of(module)][0] == "tools"


PRODUCT = sorted(m for m in _modules() if not _is_tool(m))


def test_every_module_has_a_floor():
    for module in _modules():
        _floor_of(module)


@pytest.mark.parametrize("module", sorted(_modules()))
def test_imports_go_down(module):
    if _is_tool(module):
        return  # the tools may import anything
    mine = _floor_of(module)
    for target, _ in _imports(module):
        if target == NATIVE or target in _modules():
            assert _floor_of(target) >= mine, (
                f"{module} ({_floors()[mine][0]}) imports {target} ({_floors()[_floor_of(target)][0]}), a floor above")


@pytest.mark.parametrize("module", PRODUCT)
def test_product_never_imports_tools(module):
    for target, _ in _imports(module):
        assert not target.startswith(("cp_cache.cli", "cp_cache.testing")), f"{module} imports {target}"


@pytest.mark.parametrize("module", PRODUCT)
def test_no_private_names_across_modules(module):
    for target, name in _imports(module):
        assert not name.startswith("_"), f"{module} imports {target}.{name}"


def test_strategies_do_not_import_one_another():
    for module in STRATEGIES:
        others = [t for t, _ in _imports(module) if t in STRATEGIES and t != module]
        assert not others, f"{module} imports {others}"


def test_tnd_is_written_in_at_most_two_product_files():
    files = {module for module in PRODUCT for node in ast.walk(_modules()[module][1])
             if isinstance(node, ast.Constant) and node.value == "TND"}
    assert len(files) <= MAX_TND_FILES, sorted(files)


def test_no_function_over_60_lines():
    long = []
    for module, (_, tree) in _modules().items():
        if module.startswith("cp_cache.testing"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{module}.{node.name}: {lines} lines")
    assert not long, long


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _runtime() -> list[Path]:
    return [path for module, (path, _) in _modules().items()
            if not module.startswith(("cp_cache.cli", "cp_cache.testing", "cp_cache.emulator"))]


def test_module_docstrings_are_short():
    long = []
    for path in _runtime():
        tree = _modules()[_module_name(path)][1]
        doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) else None
        if doc is not None and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
            lines = doc.end_lineno - doc.lineno + 1
            if lines > MAX_MODULE_DOCSTRING_LINES:
                long.append(f"{path.relative_to(PACKAGE)}: {lines} lines")
    assert not long, long


def test_sizes():
    engine = sum(_lines(p) for p in (PACKAGE / "engine").glob("*.py"))
    runtime = sum(_lines(p) for p in _runtime())
    attention = sum(_lines(p) for p in _runtime() if PACKAGE / "mixers" not in p.parents)
    assert engine <= MAX_ENGINE_LINES, f"engine/ has {engine} lines, more than {MAX_ENGINE_LINES}"
    assert runtime <= MAX_RUNTIME_LINES, f"the runtime has {runtime} lines, more than {MAX_RUNTIME_LINES}"
    assert attention <= MAX_ATTENTION_LINES, f"the runtime without mixers/ has {attention} lines, more than " \
                                             f"{MAX_ATTENTION_LINES}"
    assert len(_runtime()) > 40  # the package's modules were found


def test_the_rules_can_fail():
    """The checker sees a violation where there is one: a product module that imported a
    tool, a private name and a floor above would be reported."""
    tree = ast.parse("from ..cli import demo\nfrom .ring import _private\nfrom ..handlers import spec\n")
    path, _ = _modules()["cp_cache.algorithms.ulysses"]
    _modules()["cp_cache.algorithms.ulysses_probe"] = (path.with_name("ulysses_probe.py"), tree)
    try:
        found = _imports("cp_cache.algorithms.ulysses_probe")
        assert ("cp_cache.cli.demo", "") in found
        assert ("cp_cache.algorithms.ring", "_private") in found
        assert _floor_of("cp_cache.handlers.spec") < _floor_of("cp_cache.algorithms.ulysses_probe")
    finally:
        del _modules()["cp_cache.algorithms.ulysses_probe"]
