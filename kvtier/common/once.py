"""Failures that repeat (a full disk fails every step) are logged once per cause and counted always."""

from __future__ import annotations

import logging
from typing import Any


class Once:
    """Log each distinct cause once at its level (later ones at DEBUG); return whether it was new."""

    def __init__(self, logger: logging.Logger) -> None:
        self._log = logger
        self._seen: set[tuple] = set()

    def __call__(self, key: tuple, level: int, msg: str, *args: Any, **kw: Any) -> bool:
        new = key not in self._seen
        if new:
            self._seen.add(key)
        else:
            kw.pop("exc_info", None)
        self._log.log(level if new else logging.DEBUG, msg, *args, **kw)
        return new

    def forget(self, key: tuple) -> None:
        """A cause that cleared (e.g. the disk has room again): log it again if it comes back."""
        self._seen.discard(key)


def cause(e: BaseException) -> tuple:
    """What makes two failures the same for logging: the type and errno (not the message)."""
    return (type(e).__name__, getattr(e, "errno", None))
