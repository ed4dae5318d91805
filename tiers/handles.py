"""Asynchronous I/O handles: poll with done(), block with wait()."""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass, field
from typing import Callable, Sequence


@dataclass
class IOResult:
    """Per-block outcome of one batch: ok[i] is False for a block that failed or did not verify;
    bad[i] (when not empty) True for a block that was there but failed verification; tags[i]
    (a write, when the data plane seals blocks) the tag block i was written with."""

    ok: list[bool]
    nbytes: int = 0
    errors: list[str] = field(default_factory=list)
    bad: list[bool] = field(default_factory=list)
    tags: list = field(default_factory=list)

    @property
    def all_ok(self) -> bool:
        return all(self.ok)


class IOHandle:
    """A batch of block reads or writes in flight."""

    def done(self) -> bool:
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> IOResult:
        raise NotImplementedError


class DoneHandle(IOHandle):
    def __init__(self, result: IOResult) -> None:
        self._result = result

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> IOResult:
        return self._result


class FutureHandle(IOHandle):
    """Handle over thread-pool futures, each returning an IOResult for a sub-batch, merged in order."""

    def __init__(self, futures: Sequence[cf.Future], finish: Callable[[IOResult], IOResult] | None = None) -> None:
        self._futures = list(futures)
        self._finish = finish
        self._result: IOResult | None = None

    def done(self) -> bool:
        return self._result is not None or all(f.done() for f in self._futures)

    def wait(self, timeout: float | None = None) -> IOResult:
        if self._result is None:
            merged = IOResult(ok=[])
            for f in self._futures:
                r = f.result(timeout)
                merged.ok.extend(r.ok)
                merged.nbytes += r.nbytes
                merged.errors.extend(r.errors)
                merged.bad.extend(r.bad or [False] * len(r.ok))
            if not any(merged.bad):
                merged.bad = []
            self._result = self._finish(merged) if self._finish else merged
        return self._result
