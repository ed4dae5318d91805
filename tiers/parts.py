"""A block stored as parts: one data plane over the parts a worker holds (issue 37).

A block of the NVMe or shared tier may be stored as `count` parts (`connector.parallel.Parts`):
a data file ``data.<p>`` per part, or the values under part p's keys. A worker holds some of them
(its KV heads); each part's value is pieces of the worker's row (its bytes of those heads in every
layer, in model order). `PartsPlane` is that worker's data plane: it takes and gives whole rows,
like `NvmeData` and `SharedData`, and reads and writes each held part through its own plane
(verified there against the part's own tag; `expect[i]` holds one tag per part). A block is read
whole only when every held part verified; a write's tag is the tuple of its parts' tags.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .contract import Medium
from .io_engine import IOHandle, IOResult

Pieces = list[tuple[int, int]]   # (offset in the row, bytes): one part's value, in order


def merged(pieces: Sequence[tuple[int, int]]) -> Pieces:
    """`pieces` with adjacent ones joined."""
    out: Pieces = []
    for off, n in pieces:
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((off, n))
    return out


class PartsHandle(IOHandle):
    """The parts' handles of one batch; `wait` merges them (per block: ok when every part is,
    bad when any part failed verification) and puts the parts read into scratch into the rows."""

    def __init__(self, handles: Sequence[IOHandle], n: int, scatter: Sequence[Any] = ()) -> None:
        self._handles = list(handles)
        self._n = n
        self._scatter = list(scatter)   # per part: None, or (scratch values, rows, pieces)
        self._result: IOResult | None = None

    def done(self) -> bool:
        return self._result is not None or all(h.done() for h in self._handles)

    def wait(self, timeout: float | None = None) -> IOResult:
        if self._result is not None:
            return self._result
        results = [h.wait(timeout) for h in self._handles]
        n = self._n
        ok = [all(r.ok[i] for r in results) for i in range(n)]
        with torch.inference_mode():   # the rows may be vLLM's (inference) tensors
            for sc in self._scatter:
                if sc is None:
                    continue
                vals, rows, pieces = sc
                for i in range(n):
                    if ok[i]:
                        at = 0
                        for off, size in pieces:
                            rows[i][off:off + size].copy_(vals[i][at:at + size])
                            at += size
        bad = [any(r.bad[i] for r in results if r.bad) for i in range(n)]
        tags: list = []
        if any(r.tags for r in results):
            cols = [r.tags or [0] * n for r in results]
            tags = list(cols[0]) if len(cols) == 1 else [tuple(c[i] for c in cols) for i in range(n)]
        self._result = IOResult(ok=ok, nbytes=sum(r.nbytes for r in results),
                                errors=[e for r in results for e in r.errors], bad=bad if any(bad) else [],
                                tags=tags)
        return self._result


class PartsPlane:
    """The data plane of the parts [lo, lo + len(planes)) a worker holds: `planes[j]` stores part
    lo + j (its `NvmeData` or `SharedData`, opened for that part), `pieces[j]` where that part's
    bytes are in the worker's row of `row_bytes`."""

    def __init__(self, planes: Sequence[Any], pieces: Sequence[Pieces], row_bytes: int) -> None:
        if not planes or len(planes) != len(pieces):
            raise ValueError(f"parts plane: {len(planes)} planes for {len(pieces)} parts")
        self.planes = list(planes)
        self.pieces = [merged(p) for p in pieces]
        self.row_bytes = row_bytes
        self.part_bytes = [sum(n for _, n in p) for p in self.pieces]
        self.whole = [p == [(0, row_bytes)] for p in self.pieces]
        self.medium = self.planes[0].medium
        self.device_reads = self.medium is Medium.FILE and all(p.device_reads for p in self.planes)

    def _value(self, row: torch.Tensor, j: int) -> torch.Tensor:
        if self.whole[j]:
            return row
        return torch.cat([row[off:off + n] for off, n in self.pieces[j]])

    def write(self, slots: Sequence[int], srcs: Sequence[torch.Tensor], keys: Sequence[bytes] | None = None
              ) -> IOHandle:
        """Write each held part of the rows; the result's tags[i]: block i's part tags (a tuple
        when several, the tag when one)."""
        handles = [plane.write(slots, [self._value(s, j) for s in srcs], keys) for j, plane in enumerate(self.planes)]
        return PartsHandle(handles, len(srcs))

    def read(self, slots: Sequence[int], dsts: Sequence[torch.Tensor], keys: Sequence[bytes] | None = None,
             expect: Sequence | None = None) -> IOHandle:
        """Read each held part into the rows (`expect[i]`: block i's tag per part, or its tag)."""
        handles, scatter = [], []
        for j, plane in enumerate(self.planes):
            if self.whole[j]:
                bufs, sc = list(dsts), None
            else:
                with torch.inference_mode(False):   # normal tensors: the engine's threads write them
                    bufs = [torch.empty(self.part_bytes[j], dtype=torch.uint8, device=d.device) for d in dsts]
                sc = (bufs, list(dsts), self.pieces[j])
            handles.append(plane.read(slots, bufs, keys, expect))
            scatter.append(sc)
        return PartsHandle(handles, len(dsts), scatter)

    def sync(self) -> None:
        for p in self.planes:
            p.sync()

    def drain(self) -> None:
        for p in self.planes:
            p.drain()

    def close(self) -> None:
        for p in self.planes:
            p.close()

    # ---- what the worker shows of its planes ------------------------------------------------
    @property
    def dir(self) -> str:
        return self.planes[0].dir

    @property
    def path(self) -> str:
        return self.planes[0].path

    @property
    def gds(self) -> bool | None:
        return self.planes[0].gds

    @property
    def s(self) -> Any:
        """The shared tier's server settings."""
        return self.planes[0].s

    def ping(self) -> str | None:
        return self.planes[0].ping()

    @property
    def description(self) -> str:
        d = self.planes[0].description
        return d if len(self.planes) == 1 else f"{d} (x{len(self.planes)} parts)"
