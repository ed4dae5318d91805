"""A source checkout imports only itself (issue 34 item 6): run from a second checkout's root with
another checkout's editable install, every `kvtier.*` module comes from the second checkout
(setuptools' editable finder used to supply `kvtier.tiers` & co. from the installed one)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

import kvtier

REPO = Path(__file__).resolve().parents[1]
SOURCE = ("kvtier", "tiers", "policies", "connector", "configs", "pyproject.toml")

# Every kvtier module imported, by file; then the one the copy lacks (below), found or not.
PROBE = """import json, sys
import kvtier.core, kvtier.tiers, kvtier.policies, kvtier.connector, kvtier.configs
from importlib import resources
files = {m: getattr(sys.modules[m], "__file__", None) for m in sorted(sys.modules) if m.startswith("kvtier")}
files["<configs>"] = str(resources.files("kvtier.configs").joinpath("cpu-only.yaml"))
try:
    import kvtier.tiers.redact
    files["kvtier.tiers.redact"] = kvtier.tiers.redact.__file__
except ModuleNotFoundError as e:
    files["kvtier.tiers.redact"] = "missing: " + str(e)
print(json.dumps(files))
"""


def _imported(cwd: Path) -> dict[str, str | None]:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _outside(files: dict[str, str | None], root: Path) -> dict[str, str | None]:
    return {m: f for m, f in files.items() if f is not None and root not in Path(f).resolve().parents}


def test_a_second_checkout_imports_only_its_own_tree(tmp_path):
    """Was: kvtier and kvtier.core from the copy, kvtier.tiers/.policies/.connector/.configs (and
    the shipped YAMLs) from the installed checkout, and a module the copy lacks taken from it."""
    copy = tmp_path / "copy"
    for name in SOURCE:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            copy.mkdir(exist_ok=True)
            shutil.copy2(src, copy / name)
    (copy / "tiers" / "redact.py").unlink()
    copy = copy.resolve()
    files = _imported(copy)
    assert [files[m] for m in ("kvtier", "kvtier.core", "kvtier.tiers", "kvtier.policies", "kvtier.connector",
                               "kvtier.configs")] == \
        [str(copy / d / "__init__.py") for d in ("kvtier", "kvtier/core", "tiers", "policies", "connector", "configs")]
    assert len(files) > 15 and _outside(files, copy) == {"kvtier.tiers.redact": files["kvtier.tiers.redact"]}
    missing = f"missing: No module named 'kvtier.tiers.redact' in the kvtier checkout {copy}"
    assert files["kvtier.tiers.redact"] == missing


def test_a_neutral_cwd_imports_the_installed_tree(tmp_path):
    """From a folder that is no checkout, the install's own tree is used, all of it."""
    files = _imported(tmp_path)
    assert files["kvtier.tiers"] == str(REPO / "tiers" / "__init__.py")
    assert files["kvtier.tiers.redact"] == str(REPO / "tiers" / "redact.py")
    assert len(files) > 15 and _outside(files, REPO) == {}


def test_the_checkout_map_is_pyprojects():
    """kvtier/__init__.py's four names are exactly pyproject's package-dir entries below `kvtier`."""
    dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert {f"kvtier.{n}": n for n in kvtier._MAPPED} == {k: v for k, v in dirs.items() if k != "kvtier"}


def test_an_installed_layout_places_no_finder(tmp_path):
    """Laid out as the wheel installs it (kvtier/tiers/... real subpackages, no pyproject.toml beside
    `kvtier`), the package places no finder and every module comes from that layout."""
    site = tmp_path / "site"
    shutil.copytree(REPO / "kvtier", site / "kvtier", ignore=shutil.ignore_patterns("__pycache__"))
    for d in kvtier._MAPPED:
        shutil.copytree(REPO / d, site / "kvtier" / d, ignore=shutil.ignore_patterns("__pycache__"))
    site = site.resolve()
    code = PROBE.replace("print(json.dumps(files))",
                         "files['<finders>'] = str([f for f in sys.meta_path if 'Checkout' in type(f).__name__])\n"
                         "print(json.dumps(files))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(site)})
    assert out.returncode == 0, out.stderr[-2000:]
    files = json.loads(out.stdout.strip().splitlines()[-1])
    assert files.pop("<finders>") == "[]"
    assert files["kvtier.tiers"] == str(site / "kvtier" / "tiers" / "__init__.py")
    assert len(files) > 15 and _outside(files, site) == {}
