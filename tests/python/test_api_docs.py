"""docs/api.md (and the README's API in brief) against the package: every signature written in a code block
whose callee resolves (``cp_cache.x.y(...)``, or a name the block imports from cp_cache) has the parameters of
the real one, in order, of the same kind, with the same defaults; every function of ``cp_cache.__all__`` is
written there; the step kernels the page lists are the registered ones. Fast: parses files, imports cp_cache."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "docs" / "api.md"
README = ROOT / "README.md"
PASSED_THROUGH = "..."  # a documented default of ``...``: a keyword the function passes on (``**kwargs``)


def _blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), re.S)


def _signatures(block: str) -> list[tuple[str, str]]:
    """(callee, parameter text) of each statement of ``block`` that starts a line with ``name(`` (or ``x = name(``), comments
    dropped, continued over lines until its parentheses close."""
    lines = [line.split("#", 1)[0].rstrip() for line in block.splitlines()]
    found, i = [], 0
    while i < len(lines):
        m = re.match(r"(?:\w+ = )?([A-Za-z_][\w.]*)\(", lines[i])
        if not m:
            i += 1
            continue
        text, depth, j = "", 0, i
        while j < len(lines):
            text += lines[j] + "\n"
            depth = text.count("(") - text.count(")")
            j += 1
            if depth <= 0:
                break
        start = m.end()
        depth, end = 1, start
        while depth:
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            end += 1
        found.append((m.group(1), text[start:end - 1]))
        i = j
    return found


def _imports(block: str) -> dict[str, str]:
    """{name: module} of the block's ``from cp_cache... import a, b`` lines."""
    names = {}
    for module, imported in re.findall(r"^from (cp_cache[\w.]*) import ([\w, ]+)$", block, re.M):
        names.update({name.strip(): module for name in imported.split(",")})
    return names


def _resolve(callee: str, imports: dict[str, str]):
    if callee in imports:
        return getattr(importlib.import_module(imports[callee]), callee)
    if not callee.startswith("cp_cache."):
        return None
    parts = callee.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            obj = getattr(obj, name, None)
        return obj
    return None


def _documented(params: str) -> ast.arguments:
    return ast.parse(f"def f({params}): pass").body[0].args


def _mismatches(callee: str, params: str, obj) -> list[str]:
    doc = _documented(params)
    real = [p for p in inspect.signature(obj).parameters.values() if p.name != "self"]
    positional = doc.posonlyargs + doc.args
    defaults = dict(zip([a.arg for a in positional][len(positional) - len(doc.defaults):], doc.defaults))
    defaults.update({a.arg: d for a, d in zip(doc.kwonlyargs, doc.kw_defaults) if d is not None})
    written = [(a.arg, "keyword-only" if a in doc.kwonlyargs else "positional") for a in positional + doc.kwonlyargs]
    passed = {name for name, default in defaults.items() if ast.unparse(default) == PASSED_THROUGH}
    named = [p for p in real if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    problems = []
    if [n for n, _ in written if n not in passed] != [p.name for p in named]:
        problems.append(f"parameters {[n for n, _ in written if n not in passed]} written, "
                        f"{[p.name for p in named]} in the code")
    kinds = {p.name: "keyword-only" if p.kind == p.KEYWORD_ONLY else "positional" for p in named}
    problems += [f"{n} written {kind}, {kinds[n]} in the code" for n, kind in written
                 if n in kinds and kinds[n] != kind]
    for p in named:
        if p.name in defaults and p.name not in passed:
            written_default = ast.literal_eval(defaults[p.name])
            if p.default is p.empty or p.default != written_default:
                problems.append(f"{p.name}={ast.unparse(defaults[p.name])} written, "
                                f"{'no default' if p.default is p.empty else repr(p.default)} in the code")
        elif p.name not in defaults and p.default is not p.empty and p.name in dict(written):
            problems.append(f"{p.name} written without its default {p.default!r}")
    if passed and not any(p.kind == p.VAR_KEYWORD for p in real):
        problems.append(f"{sorted(passed)} written as passed on, but it takes no **kwargs")
    if (doc.kwarg is not None) != any(p.kind == p.VAR_KEYWORD for p in real):
        problems.append("**kwargs written but not taken" if doc.kwarg else "**kwargs taken but not written")
    return [f"{callee}: {p}" for p in problems]


def _checked(path: Path) -> tuple[list[str], list[str]]:
    """(callees checked, mismatches) over the page's code blocks."""
    checked, problems = [], []
    for block in _blocks(path):
        imports = _imports(block)
        for callee, params in _signatures(block):
            obj = _resolve(callee, imports)
            if obj is None or not callable(obj):
                continue
            checked.append(callee)
            problems += _mismatches(callee, params, obj)
    return checked, problems


@pytest.mark.parametrize("path", [API, README], ids=lambda p: p.name)
def test_documented_signatures_match_the_code(path: Path):
    checked, problems = _checked(path)
    assert len(checked) >= 10, f"{path.name}: only {checked} signatures found"
    assert not problems, f"{path.relative_to(ROOT)} disagrees with the code:\n" + "\n".join(problems)


def test_every_public_function_is_on_the_api_page():
    import cp_cache

    checked = set(_checked(API)[0])
    functions = [name for name in cp_cache.__all__ if inspect.isfunction(getattr(cp_cache, name))]
    missing = [name for name in functions if f"cp_cache.{name}" not in checked]
    assert not missing, f"docs/api.md writes no signature for: {missing}"


def test_the_kernel_list_is_the_registered_kernels():
    from cp_cache.kernels import kernel_names

    text = " ".join(line.split("#", 1)[1] for block in _blocks(API) for line in block.splitlines() if "#" in line)
    listed = re.search(r'kernel, the step kernel:\s*((?:"\w+"\s*\|\s*)+"\w+")', re.sub(r"\s+", " ", text))
    assert listed, "docs/api.md's enable() lists no kernels as 'kernel, the step kernel: \"a\" | \"b\"'"
    assert re.findall(r'"(\w+)"', listed.group(1)) == list(kernel_names()), (listed.group(1), kernel_names())


def test_the_checker_sees_drift():
    """A parameter renamed, one missing, a default changed, one made keyword-only: each reported."""
    def f(a, b=1, *, c=None):
        pass

    assert _mismatches("f", "a, b=1, *, c=None", f) == []
    assert _mismatches("f", "a, b=2, *, c=None", f)
    assert _mismatches("f", "a, b=1", f)
    assert _mismatches("f", "a, *, b=1, c=None", f)
    assert _mismatches("f", "x, b=1, *, c=None", f)
    assert _signatures("g(a,\n  b=(1, 2))  # c(d)\nx = h(1)\ny.z(2) + 1\n") == [("g", "a,\n  b=(1, 2)"), ("h", "1"), ("y.z", "2")]
