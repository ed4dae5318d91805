"""No exception leaves a vLLM hook.

vLLM runs the connector's hooks inside its engine loop: an exception there kills the engine
(EngineDeadError, every request fails, the server exits). kvtier is a cache, so every failure
has a safe answer: a lookup finds nothing, a load that cannot run is reported as a load error
(vLLM recomputes those blocks), a store that cannot run is dropped (a future miss). `hook`
wraps each hook with that answer; `kvtier.core.once.Once` keeps a failure that repeats (a full disk
fails every step) to one log line per cause while the counters count every one.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

log = logging.getLogger("kvtier.connector")


def hook(recover: str | None = None, default: Any = None, refuse: tuple = ()) -> Callable:
    """Decorate a connector hook: on an exception, `self._hook_failed(name, e)` logs it (once per
    hook and cause) and counts it, then the hook answers `self.<recover>(*args)` or `default`.
    Exceptions of the `refuse` types pass through (a start-up that must not go on)."""
    def deco(fn: Callable) -> Callable:
        name = fn.__name__

        @functools.wraps(fn)
        def wrapper(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except refuse:
                raise
            except Exception as e:  # noqa: BLE001 - the engine must survive any failure of ours
                self._hook_failed(name, e)
                if recover is None:
                    return default() if callable(default) else default
                try:
                    return getattr(self, recover)(*args, **kwargs)
                except Exception as e2:  # noqa: BLE001
                    self._hook_failed(name + ".recover", e2)
                    return default() if callable(default) else default
        return wrapper
    return deco
