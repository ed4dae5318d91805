"""The `kvtier` command line."""

from .main import main  # noqa: F401  (the `kvtier` console script)
