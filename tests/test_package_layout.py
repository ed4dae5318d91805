"""The package's shape is part of its architecture (issue 17): no import cycles between kvtier's
modules, no private name imported from another module, no class assembled from mixins (issue 34:
one class per role, however long its module); and (issue 24)
its installed packages, read from pyproject.toml, depend one way, without a cycle, and the lower
ones never import vLLM."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _folder(pkg: str) -> Path:
    """Where setuptools finds an installed package: the longest `package-dir` prefix, then a folder per part."""
    dirs, parts = SETUPTOOLS.get("package-dir", {}), pkg.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in dirs:
            return ROOT.joinpath(dirs[".".join(parts[:i])], *parts[i:])
    return ROOT.joinpath(*parts)


PACKAGE_DIRS = {pkg: _folder(pkg) for pkg in SETUPTOOLS["packages"]}


def _modules() -> tuple[dict[str, Path], dict[str, str]]:
    """Installed module name -> file, and module -> the installed package whose folder holds it."""
    files, package = {}, {}
    for pkg, folder in PACKAGE_DIRS.items():
        for p in folder.glob("*.py"):
            name = pkg if p.stem == "__init__" else f"{pkg}.{p.stem}"
            files[name], package[name] = p, pkg
    return files, package


MODULES, PACKAGE_OF = _modules()


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


# Private attributes of other libraries' objects read for want of a public one.
FOREIGN_PRIVATE = {("kvtier.tiers.cpu_pool", "torch._foreach_copy_"),   # torch's batched copy
                   ("kvtier.tiers.shared_data", "conn._sock")}           # redis-py's socket (the RESP reader)


def test_no_private_attribute_read_on_another_object():
    """`x._y` only on `self` / `cls`: no object reads or writes another's private state
    (`part._count`, `self.sched._count`), whatever module defines it."""
    bad = []
    for m in MODULES:
        for node in ast.walk(ast.parse(MODULES[m].read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")) \
                    and (m, ast.unparse(node)) not in FOREIGN_PRIVATE:
                bad.append(f"{m}:{node.lineno}: {ast.unparse(node)}")
    assert bad == []


# `self.a.b = ...` only on objects of the writer's own making (a dataclass's fields, a thread-local, a finalizer).
WRITES_THROUGH_OWN = {"kvtier.connector.device_copy": {"self.index.trace"},
                      "kvtier.offline.sizing": {"self.curve.scale", "self.shared_curve.scale",
                                                "self.shared_curve.adjust", "self.curve.refs",
                                                "self.shared_curve.refs"},
                      "kvtier.tiers.cpu_pool": {"self._release.atexit"},
                      "kvtier.tiers.shared_data": {"self._scratch.t", "self._scratch.p", "self._scratch.put"}}


def test_no_object_writes_the_state_of_an_object_it_holds():
    """No `self.a.b = ...` (the executor's report, deferred store, result were written so): an
    object asks the one it holds through a method; what remains is listed above, by module."""
    found: dict[str, set[str]] = {}
    for m in MODULES:
        for node in ast.walk(ast.parse(MODULES[m].read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                    root, depth = e, 0
                    while isinstance(root, ast.Attribute):
                        root, depth = root.value, depth + 1
                    if depth >= 2 and isinstance(root, ast.Name) and root.id == "self":
                        found.setdefault(m, set()).add(ast.unparse(e))
    assert found == WRITES_THROUGH_OWN   # exact: a stale entry fails too


COMPLETION = ("complete", "_remember_failed", "_complete_copy", "_complete_put")


def test_completion_changes_the_controllers_state_only_through_methods():
    """The controller's completion (`complete` and its helpers) names no data attribute of the
    controller's (`self._stores`, `self._pending`, `self._wb_max` ...): what is in flight it asks
    and changes through `InFlight`'s methods (`self.inflight.<method>`), the rest through the
    controller's methods."""
    def functions(m, cls=None):
        tree = ast.parse(MODULES[m].read_text())
        scope = tree if cls is None else next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
        return [n for n in ast.walk(scope) if isinstance(n, ast.FunctionDef)]
    methods = {n.name for m in ("kvtier.core.controller", "kvtier.core.ledger", "kvtier.core.plan")
               for n in functions(m)}
    inflight = {n.name for n in functions("kvtier.core.ledger", "InFlight")}
    parts = [n for n in functions("kvtier.core.controller", "TierController") if n.name in COMPLETION]
    assert sorted(n.name for n in parts) == sorted(COMPLETION)
    nodes = [a for n in parts for a in ast.walk(n) if isinstance(a, ast.Attribute)]
    data = {a.attr for a in nodes if a.attr.startswith("_") and isinstance(a.value, ast.Name)
            and a.value.id == "self" and a.attr not in methods}
    assert data == {"_once"}   # the controller's log-once, called
    through = {a.attr for a in nodes if ast.unparse(a.value) == "self.inflight"}
    assert through and through <= inflight, through - inflight


# Production classes in kvtier.core and kvtier.connector are one class per role, never assembled from
# mixins (issue 34): a class has at most one base defined in kvtier, and that base is a contract it
# implements (a Protocol, an ABC), an Exception, or one of these families (a base with fields or
# hooks its subclasses fill in, never state the subclass works on), by (module, class):
FAMILY_BASES = {("kvtier.core.config", "_Model"),      # pydantic settings every config model shares
                ("kvtier.core.config", "KeySource"),   # an encryption config is a key source (its fields)
                ("kvtier.core.plan", "Report"),        # a worker's report is a Report vLLM carries
                ("kvtier.core.handlers", "ReadLoad"),  # a lower tier's load: FileLoad, SharedLoad fill its hooks
                ("kvtier.core.handlers", "BehindCopy")}  # a copy written behind: FileCopy, SharedCopy


def _kvtier_classes() -> dict[tuple[str, str], ast.ClassDef]:
    """(module, name) -> the class, for every class a kvtier module defines at its top level (not
    the stand-ins a module defines when an optional library is absent)."""
    return {(m, n.name): n for m in MODULES for n in ast.parse(MODULES[m].read_text()).body
            if isinstance(n, ast.ClassDef)}


def _kvtier_bases(m: str, cls: ast.ClassDef, classes: dict) -> list[tuple[str, str]]:
    """The bases of `cls` (in module `m`) that kvtier defines, as (module, name)."""
    imported = {}
    for node in ast.parse(MODULES[m].read_text()).body:
        if isinstance(node, ast.ImportFrom) and _resolve(m, node).startswith("kvtier"):
            imported.update({a.asname or a.name: _resolve(m, node) for a in node.names})
    out = []
    for b in cls.bases:
        name = ast.unparse(b)
        src = imported.get(name, m)
        if (src, name) in classes:
            out.append((src, name))
    return out


def _is_contract(key: tuple[str, str], classes: dict) -> bool:
    """A Protocol or an ABC (by its bases or metaclass), or an Exception, through kvtier's own bases too."""
    cls = classes[key]
    names = {ast.unparse(b).split(".")[-1] for b in cls.bases} | {ast.unparse(k.value) for k in cls.keywords}
    if names & {"Protocol", "ABC", "ABCMeta", "Exception", "RuntimeError", "ValueError", "OSError"}:
        return True
    return any(_is_contract(b, classes) for b in _kvtier_bases(key[0], cls, classes))


def test_no_class_is_assembled_from_mixins():
    classes = _kvtier_classes()
    # a class not yet folded, and the parts it is assembled from (they go when it is folded)
    bad = []
    for (m, name), cls in classes.items():
        if PACKAGE_OF[m] not in ("kvtier.core", "kvtier.connector"):
            continue
        bases = _kvtier_bases(m, cls, classes)
        if len(bases) > 1:
            bad.append(f"{m}.{name}: several kvtier bases {[b for _, b in bases]}")
        bad += [f"{m}.{name}: base {b} is neither a contract nor a family" for b in bases
                if b not in FAMILY_BASES and not _is_contract(b, classes)]
        doc = ast.get_docstring(cls) or ""
        if "Mixed into" in doc or "a part of `" in doc.lower():
            bad.append(f"{m}.{name}: a part of another class (its docstring says so)")
    assert bad == []


def test_only_kvtier_vllm_imports_kvtier_vllm():
    """`kvtier.vllm` needs vLLM's tiering API; kvtier's core, tiers, policies and connector never need it."""
    g = _graph(top_level_only=False)
    bad = sorted(f"{m} -> {t}" for m, ts in g.items() if not m.startswith("kvtier.vllm")
                 for t in ts if t == "kvtier.vllm" or t.startswith("kvtier.vllm."))
    assert "kvtier.vllm.nvme_tier" in MODULES and bad == []


# Packages depend one way (issue 24): common <- policies <- tiers <- core <- {connector, vllm, cli, offline}. Each
# installed package's row names the packages it may import; the root package holds `python -m kvtier`.
LOWER = {"kvtier.core", "kvtier.tiers", "kvtier.policies", "kvtier.common"}
MAY_IMPORT = {
    "kvtier.configs": set(),
    "kvtier.common": set(),
    "kvtier.policies": {"kvtier.common"},
    "kvtier.tiers": {"kvtier.policies", "kvtier.common"},
    "kvtier.core": {"kvtier.tiers", "kvtier.policies", "kvtier.common"},
    "kvtier.connector": LOWER,
    "kvtier.vllm": LOWER,
    "kvtier.offline": LOWER,
    "kvtier.cli": LOWER | {"kvtier.offline"},
    "kvtier": set(PACKAGE_DIRS) - {"kvtier"},
}


def _package_edges() -> dict[tuple[str, str], list[str]]:
    """(package, package it imports) -> the module imports that make the edge, lazy ones included.
    An import of an ancestor package is not an edge: Python runs every ancestor's __init__ first
    (test_no_init_reaches_below_it keeps that from hiding a cycle)."""
    edges: dict[tuple[str, str], list[str]] = {}
    for m, targets in _graph(top_level_only=False).items():
        for t in targets:
            if PACKAGE_OF[m] != PACKAGE_OF[t]:
                edges.setdefault((PACKAGE_OF[m], PACKAGE_OF[t]), []).append(f"{m} -> {t}")
    return edges


def test_every_installed_package_has_a_layer():
    assert set(MAY_IMPORT) == set(PACKAGE_DIRS)


def test_packages_depend_one_way():
    back = sorted(f"{a} -> {b}: {', '.join(sorted(why))}" for (a, b), why in _package_edges().items()
                  if b not in MAY_IMPORT[a])
    assert back == []


def test_no_package_cycle():
    g: dict[str, set[str]] = {p: set() for p in PACKAGE_DIRS}
    for a, b in _package_edges():
        g[a].add(b)
    assert _cycles(g) == []


def test_no_init_reaches_below_it():
    """A package's __init__ never leads, import by import, to a module of a package under it: the
    ancestor imports _package_edges leaves out then cannot close a cycle."""
    g = _graph(top_level_only=False)
    bad = []
    for pkg in PACKAGE_DIRS:
        seen, todo = {pkg}, [pkg]
        while todo:
            for t in g[todo.pop()] - seen:
                seen.add(t)
                todo.append(t)
        bad += [f"{pkg} -> {t}" for t in sorted(seen) if PACKAGE_OF[t].startswith(pkg + ".")]
    assert bad == []


def test_core_tiers_policies_offline_never_import_vllm():
    """Every module of these packages, imported in a fresh interpreter, leaves vLLM unimported."""
    mods = sorted(m for m in MODULES if PACKAGE_OF[m] in LOWER | {"kvtier.offline"})
    code = ("import importlib, sys\n"
            f"for m in {mods!r}:\n    importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]" and len(mods) > 50


def test_one_name_for_the_shared_tier():
    """Issue 34: the shared tier is `shared` in code (no `remote` identifier in kvtier.core or the
    connector, no `redis*` module: the Redis protocol lives in tiers/shared_conn.py and resp_reader.py)."""
    bad = []
    for m, path in MODULES.items():
        if PACKAGE_OF[m] in ("kvtier.core", "kvtier.connector"):
            for node in ast.walk(ast.parse(path.read_text())):
                name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else \
                    node.name if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else node.arg \
                    if isinstance(node, ast.arg) else None
                if name is not None and "remote" in name.lower():
                    bad.append(f"{m}: {name}")
    assert bad == []
    assert [m for m in MODULES if m.rsplit(".", 1)[-1].startswith("redis")] == []
