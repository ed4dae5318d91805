"""kvtier: KV-cache tiering (GPU HBM -> CPU DRAM -> NVMe) for LLM serving.

A source checkout imports only itself. pyproject's package-dir maps the checkout's top-level
`tiers/`, `policies/`, `connector/` and `configs/` into this package, and setuptools' editable
finder maps those names to the folders of the checkout it was installed from: run from a second
checkout (a git worktree, a copy), Python would take `kvtier` and `kvtier.core` from it and
`kvtier.tiers` from the installed one. So when the folder above this file holds a pyproject.toml
naming project "kvtier", `_CheckoutFinder` (placed just before Python's path finder; finders put in
front of that stay in front) resolves every `kvtier.*` module in this tree: the four mapped names
to its folders, the rest through their parent's `__path__`; one this tree lacks is missing
(ModuleNotFoundError naming the checkout), never taken from another tree. Nothing else becomes
importable (no bare `tiers`, no `kvtier.tests`). An installed wheel has no pyproject.toml beside
the package: there this does nothing.
"""

import os
import sys
from importlib.machinery import PathFinder
from importlib.util import spec_from_file_location

__version__ = "0.1.0"

FORMAT_VERSION = 2  # 2: NVMe slots carry a keyed block header (kvtier.tiers.nvme_block)

_MAPPED = ("tiers", "policies", "connector", "configs")  # kvtier.<name> <- <checkout>/<name>/ (pyproject)


class _CheckoutFinder:
    """Finds `kvtier.*` modules in the checkout at `root` only (a sys.meta_path finder)."""

    def __init__(self, root: str):
        self.root = root

    def find_spec(self, name, path=None, target=None):
        if not name.startswith(__name__ + "."):
            return None
        sub = name[len(__name__) + 1:]
        if sub in _MAPPED:
            folder = os.path.join(self.root, sub)
            init = os.path.join(folder, "__init__.py")
            spec = spec_from_file_location(name, init, submodule_search_locations=[folder]) \
                if os.path.isfile(init) else None
        else:
            spec = PathFinder.find_spec(name, path)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r} in the kvtier checkout {self.root}", name=name)
        return spec


def _checkout_root() -> "str | None":
    """The source checkout this package was imported from, or None (an installed package)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    return root if any(s.replace(" ", "") in ('name="kvtier"', "name='kvtier'") for s in lines) else None


if (_root := _checkout_root()) is not None:
    for _f in [f for f in sys.meta_path if type(f).__name__ == _CheckoutFinder.__name__]:
        sys.meta_path.remove(_f)  # a kvtier imported before this one (a reload)
    sys.meta_path.insert(sys.meta_path.index(PathFinder) if PathFinder in sys.meta_path else len(sys.meta_path),
                         _CheckoutFinder(_root))
del _root
