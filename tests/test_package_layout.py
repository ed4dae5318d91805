"""The package's shape is part of its architecture (issue 17): no import cycles between kvtier's
modules, no private name imported from another module, no module over 500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# package -> folder (pyproject's package-dir)
PACKAGES = {"kvtier": "kvtier", "kvtier.tiers": "tiers", "kvtier.policies": "policies",
            "kvtier.connector": "connector", "kvtier.configs": "configs"}
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for p in (ROOT / folder).rglob("*.py"):
            rel = p.relative_to(ROOT / folder).with_suffix("")
            parts = [x for x in rel.parts if x != "__init__"]
            name = ".".join([pkg, *parts]) if parts else pkg
            if pkg == "kvtier" and parts and parts[0] in ("tiers", "policies", "connector", "configs"):
                continue
            out[name] = p
    return out


MODULES = _modules()


def _resolve(mod: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if MODULES[mod].name == "__init__.py" else mod.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(mod: str) -> list[tuple[str, ast.ImportFrom | ast.Import]]:
    """(imported kvtier module, node) for every import in the module, at any depth."""
    out = []
    for node in ast.walk(ast.parse(MODULES[mod].read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node) for a in node.names if a.name.startswith("kvtier")]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(mod, node)
            if not target.startswith("kvtier"):
                continue
            for a in node.names:  # `from kvtier.x import y` may import the module kvtier.x.y
                sub = f"{target}.{a.name}"
                out.append((sub if sub in MODULES else target, node))
    return out


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    g: dict[str, set[str]] = {m: set() for m in MODULES}
    for m in MODULES:
        tree = ast.parse(MODULES[m].read_text())
        top = {id(n) for n in tree.body}
        for target, node in _imports(m):
            if top_level_only and id(node) not in top:
                continue
            while target and target not in MODULES:
                target = target.rsplit(".", 1)[0] if "." in target else ""
            if target and target != m and not m.startswith(target + "."):  # a package's own __init__ is fine
                g[m].add(target)
    return g


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    """Counting imports inside functions too: a lazy import still ties the modules together."""
    assert _cycles(_graph(top_level_only=False)) == []


def test_no_private_name_crosses_a_module():
    bad = []
    for m in MODULES:
        for node in ast.walk(ast.parse(MODULES[m].read_text())):
            if isinstance(node, ast.ImportFrom) and _resolve(m, node).startswith("kvtier"):
                bad += [f"{m}: from {_resolve(m, node)} import {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert bad == []


def test_no_module_over_500_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_only_kvtier_vllm_imports_kvtier_vllm():
    """`kvtier.vllm` needs vLLM's tiering API; kvtier's core, tiers, policies and connector never need it."""
    g = _graph(top_level_only=False)
    bad = sorted(f"{m} -> {t}" for m, ts in g.items() if not m.startswith("kvtier.vllm")
                 for t in ts if t == "kvtier.vllm" or t.startswith("kvtier.vllm."))
    assert "kvtier.vllm.nvme_tier" in MODULES and bad == []
