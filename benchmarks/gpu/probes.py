"""Ordering probes for the worker's device copies, on a GPU (CUDA streams) or on CPU with
`DeferredStreams`, a fake that runs queued copies later, as a GPU does.

A CPU copy is synchronous, so on CPU no ordering bug can show unless the copies are deferred:
`DeferredStreams` keeps a compute queue and a side queue of closures (`Streams.run`), with the
waits the code asks for (`fence`: the side stream waits for the compute work queued so far;
`compute_wait`: the compute stream waits for a side event), and runs them only when the host
syncs, preferring one stream whenever both can run. A missing wait then shows as stale bytes.

- `store_probe`: a known pattern is written into a block by delayed compute work (a GPU: after
  `torch.cuda._sleep`), and the block is stored at once: the stored bytes are the pattern.
- `load_probe`: a block is loaded while the side stream is delayed, then each layer is read on
  the compute stream after `wait_layer`, before any host sync: the reads equal the source.
- `preempt_probe`: a block is stored right after the forward wrote it, its request is preempted,
  and another connector rewrites the block on its own stream while the store is still queued
  (a delayed side stream): `handle_preemptions` waits for the store first, so it holds the
  forward's bytes, never the rewrite's.
Each takes `ordered=False` to switch the wait (`settled=False`: `handle_preemptions`) off; then
the probe must fail (it is not vacuous).

`DeferredStreams(count=True)` also counts what a GPU would be asked to do: each queued item's
launches (the aten ops it runs that are neither views nor allocations: a kernel or a memcpy each
on CUDA) and the bytes they move, the events recorded and the compute stream's waits
(`benchmarks/gpu/launches.py`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvtier.connector.metadata import KVTierMetadata, LoadOp, StoreOp
from kvtier.connector.config import load_settings
from kvtier.connector.worker import KVTierWorker

SLEEP_CYCLES = 200_000_000   # torch.cuda._sleep: about 0.1 s at 2 GHz

# vLLM's KVCacheLayout stride permutations of the logical [L, B, H, N, C] (RFC #42082)
ORDERS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
          "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}


_NO_KERNEL = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
              torch.ops.aten._unsafe_view.default, torch.ops.aten.set_.source_Storage_storage_offset,
              torch.ops.aten.lift_fresh.default}


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class Launches(TorchDispatchMode):
    """Counts the aten ops run inside it that would launch work on a GPU (a kernel or a memcpy:
    views and allocations do not) and the bytes they write."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and func not in _NO_KERNEL:
            self.n += 1
            if func is torch.ops.aten.index_copy_.default:
                self.bytes += _nbytes(args[3])
            elif func._schema.is_mutable:
                self.bytes += _nbytes(args[0])
            else:
                self.bytes += _nbytes(out)
        return out


class DeferredStreams:
    """`device_copy.Streams` on CPU that runs copies later, as a GPU does (see the module).
    `count`: each executed item's launches and bytes (`item_launches`, `item_bytes`, by stream,
    in queue order), and the events recorded and the compute stream's waits (`events`, `waited`)."""

    def __init__(self, prefer: str = "side", count: bool = False) -> None:
        self.prefer = prefer
        self.q: dict[str, list] = {"compute": [], "side": []}
        self.done = {"compute": 0, "side": 0}
        self.cur = "compute"
        self.count = count
        self.item_launches: dict[str, list[int]] = {"compute": [], "side": []}
        self.item_bytes: dict[str, list[int]] = {"compute": [], "side": []}
        self.events = 0
        self.waited: list[int] = []

    def fence(self) -> None:
        self.q["side"].append(("wait", "compute", len(self.q["compute"])))

    @contextlib.contextmanager
    def side(self):
        prev, self.cur = self.cur, "side"
        try:
            yield
        finally:
            self.cur = prev

    def run(self, fn: Callable, *args: Any) -> None:
        self.q[self.cur].append(("op", fn, args))

    def compute(self, fn: Callable, *args: Any) -> None:
        """Queue work on the compute stream (the forward's writes and reads)."""
        self.q["compute"].append(("op", fn, args))

    def record(self) -> int:
        self.events += 1
        return len(self.q["side"])

    def compute_wait(self, event: int) -> None:
        self.waited.append(event)
        self.q["compute"].append(("wait", "side", event))

    def sync(self, event: int) -> None:
        self._until(lambda: self.done["side"] >= event)

    def query(self, event: int) -> bool:
        return self.done["side"] >= event

    def drain(self) -> None:
        self._until(lambda: all(self.done[k] >= len(q) for k, q in self.q.items()))

    def finish(self, name: str) -> None:
        """Run until stream `name`'s queue is done (the other runs only what that needs)."""
        self._until(lambda: self.done[name] >= len(self.q[name]))

    def _until(self, cond: Callable[[], bool]) -> None:
        while not cond():
            if not self._step():
                raise RuntimeError("DeferredStreams: the streams wait on each other")

    def _step(self) -> bool:
        for name in (self.prefer, "compute" if self.prefer == "side" else "side"):
            q, i = self.q[name], self.done[name]
            if i >= len(q):
                continue
            item = q[i]
            if item[0] == "wait" and self.done[item[1]] < item[2]:
                continue
            n = b = 0
            if item[0] == "op" and self.count:
                with Launches() as m:
                    item[1](*item[2])
                n, b = m.n, m.bytes
            elif item[0] == "op":
                item[1](*item[2])
            if self.count:
                self.item_launches[name].append(n)
                self.item_bytes[name].append(b)
            self.done[name] += 1
            return True
        return False


def progress(device: str, streams) -> None:
    """Let the device run a little (on CPU: one queued item of `DeferredStreams`)."""
    if device == "cuda":
        time.sleep(0.001)
    elif not streams._step():
        raise RuntimeError("DeferredStreams: nothing left to run")


def reported(w: KVTierWorker, op_id: int, progress_fn: Callable[[], None], tries: int = 10_000) -> bool:
    """Steps' reports until one says store `op_id` is stored (the host reads its bytes only then)."""
    for _ in range(tries):
        r = w.take_report()
        if r is not None and op_id in r.stored:
            return all(r.stored[op_id])
        progress_fn()
    return False


def views(layout: str, layers: int, blocks: int, heads: int, tokens: int, content: int, dtype, device,
          ratio: int = 1) -> dict[str, torch.Tensor]:
    """Per-layer logical `[blocks * ratio, heads, tokens / ratio, content]` views of one buffer laid
    out in `layout`'s order (vLLM's `create_kv_cache_views`, done here: no vLLM needed)."""
    order = ORDERS[layout]
    logical = (layers, blocks * ratio, heads, tokens // ratio, content)
    phys = torch.zeros([logical[d] for d in order], dtype=dtype, device=device)
    v5 = phys.permute(*[order.index(d) for d in range(5)])
    return {f"model.layers.{i}.self_attn.attn": v5[i] for i in range(layers)}


def canonical(t: torch.Tensor, block: int, ratio: int = 1) -> torch.Tensor:
    """Block `block` of a layer's logical view, as canonical bytes (a host copy)."""
    kb = t[block * ratio:(block + 1) * ratio]               # [ratio, H, n, C]
    return kb.permute(1, 0, 2, 3).contiguous().view(torch.uint8).reshape(-1).cpu()


class Rig:
    """vLLM's KV (token-major NHD, bf16) and a worker on it, with the streams to probe."""

    def __init__(self, device: str, streams, layers: int = 4, blocks: int = 64, heads: int = 8,
                 tokens: int = 16, head: int = 64, layout: str = "LBNHC") -> None:
        self.device = device
        self.streams = streams
        self.kv = views(layout, layers, blocks, heads, tokens, 2 * head, torch.bfloat16, device)
        self.w = KVTierWorker(load_settings({"cpu_capacity_blocks": 16, "pin": device == "cuda"}),
                              copy_streams=streams)
        self.w.register_kv_caches(self.kv)
        self.rows = self.w.pools[0].buffer.view(16, -1)
        self.ops = 0

    def compute(self, fn: Callable, *args: Any) -> None:
        """Work on the compute stream that runs late: after a sleep on a GPU, deferred on CPU."""
        if self.device == "cuda":
            torch.cuda._sleep(SLEEP_CYCLES)
            fn(*args)
        else:
            self.streams.compute(fn, *args)

    def delay_side(self) -> None:
        if self.device == "cuda":
            with torch.cuda.stream(self.streams.stream):
                torch.cuda._sleep(SLEEP_CYCLES)

    def progress(self) -> None:
        progress(self.device, self.streams)

    def host_sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
        else:
            self.streams.drain()

    def close(self) -> None:
        self.w.close()


@contextlib.contextmanager
def _off(streams, name: str, off: bool):
    if not off:
        yield
        return
    setattr(streams, name, lambda *a: None)
    try:
        yield
    finally:
        delattr(streams, name)


def store_probe(rig: Rig, ordered: bool = True, block: int = 5, slot: int = 3) -> bool:
    """True when the stored bytes are the pattern the compute stream wrote just before."""
    for t in rig.kv.values():
        t[block].zero_()
    rig.host_sync()
    rig.ops += 1
    val = float(rig.ops % 7 + 1)
    for li, t in enumerate(rig.kv.values()):
        rig.compute(t[block].fill_, val + li)
    with _off(rig.streams, "fence", not ordered):
        rig.w.bind(KVTierMetadata(stores=[StoreOp(rig.ops, 0, [slot], [block])]))
        rig.w.save()
    stored = rig.rows[slot].clone() if reported(rig.w, rig.ops, rig.progress) else None
    rig.host_sync()
    want = torch.cat([canonical(t, block) for t in rig.kv.values()])
    return stored is not None and torch.equal(stored.cpu(), want)


def preempt_probe(rig: Rig, settled: bool = True, block: int = 7, slot: int = 4) -> bool:
    """True when a block stored right after the forward wrote it, then rewritten on another
    stream once its request was preempted (the store still queued behind a delayed side stream),
    is stored with the forward's bytes: the step's metadata names the block (`settle`) and
    `handle_preemptions` waits for the store before the rewrite starts."""
    for t in rig.kv.values():
        t[block].zero_()
    rig.host_sync()
    rig.ops += 1
    val = float(rig.ops % 7 + 1)
    want = []
    for li, t in enumerate(rig.kv.values()):      # the forward writes the block (the compute stream)
        if rig.device == "cuda":
            t[block].fill_(val + li)
        else:
            rig.streams.compute(t[block].fill_, val + li)
        want.append(canonical(t[block:block + 1].clone().fill_(val + li).cpu(), 0))
    rig.delay_side()
    rig.w.bind(KVTierMetadata(stores=[StoreOp(rig.ops, 0, [slot], [block])]))
    rig.w.save()
    rig.w.bind(None)
    if settled:                                    # the next step: its request was preempted
        rig.w.handle_preemptions(KVTierMetadata(settle=[block]))
    if rig.device == "cuda":                       # another connector, on its own stream, after the forward
        other = torch.cuda.Stream()
        other.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(other):
            for t in rig.kv.values():
                t[block].fill_(-3.0)
    else:
        rig.streams.finish("compute")
        for t in rig.kv.values():
            t[block].fill_(-3.0)
    stored = rig.rows[slot].clone() if reported(rig.w, rig.ops, rig.progress) else None
    rig.host_sync()
    return stored is not None and torch.equal(stored.cpu(), torch.cat(want))


def load_probe(rig: Rig, ordered: bool = True, block: int = 9, slot: int = 6) -> bool:
    """True when compute-stream reads after `wait_layer`, queued before any host sync, see the
    loaded block."""
    g = torch.Generator().manual_seed(rig.ops)
    src = torch.randint(0, 256, (rig.rows.shape[1],), generator=g, dtype=torch.uint8)
    rig.rows[slot].copy_(src)
    for t in rig.kv.values():
        t[block].zero_()
    rig.host_sync()
    rig.ops += 1
    outs: list[torch.Tensor] = []
    rig.delay_side()
    with _off(rig.streams, "compute_wait", not ordered):
        rig.w.bind(KVTierMetadata(loads=[LoadOp(f"p{rig.ops}", 0, [slot], [block])]))
        rig.w.start_load()
        for name, t in rig.kv.items():
            rig.w.wait_layer(name)
            if rig.device == "cuda":
                outs.append(t[block].clone())          # on the compute stream, no host sync yet
            else:
                rig.streams.compute(lambda t=t: outs.append(t[block].clone()))
    rig.host_sync()
    rig.w.take_report()
    got = torch.cat([o.unsqueeze(0).permute(1, 0, 2, 3).contiguous().view(torch.uint8).reshape(-1).cpu()
                     for o in outs])
    return torch.equal(got, src)


def layouts_roundtrip(device: str, streams_fn: Callable[[], Any], dtype=torch.bfloat16) -> list[str]:
    """A block stored under each layout (and a 2-way kernel-block split) loads byte-exact under
    every other, through the device copier; returns the pairs that failed."""
    bad = []
    cases = [(lay, 1) for lay in ORDERS] + [("LBNHC", 2), ("LBHNC", 2)]
    for src_case in cases:
        kv_a = views(src_case[0], 2, 8, 2, 16, 16, dtype, device, src_case[1])
        g = torch.Generator().manual_seed(1)
        for t in kv_a.values():
            t.view(torch.uint8).copy_(torch.randint(0, 120, t.view(torch.uint8).shape, generator=g,
                                                    dtype=torch.uint8).to(device))
        sa = streams_fn()
        wa = KVTierWorker(load_settings({"cpu_capacity_blocks": 4, "pin": False}), num_blocks=8, copy_streams=sa)
        wa.register_kv_caches(kv_a)
        wa.bind(KVTierMetadata(stores=[StoreOp(1, 0, [0, 1], [3, 6])]))
        wa.save()
        if not reported(wa, 1, lambda: progress(device, sa)):
            bad.append(f"{src_case}: not stored")
        for dst_case in cases:
            kv_b = views(dst_case[0], 2, 8, 2, 16, 16, dtype, device, dst_case[1])
            sb = streams_fn()
            wb = KVTierWorker(load_settings({"cpu_capacity_blocks": 4, "pin": False}), num_blocks=8,
                              copy_streams=sb)
            wb.register_kv_caches(kv_b)
            wb.pools[0].buffer.copy_(wa.pools[0].buffer)
            wb.bind(KVTierMetadata(loads=[LoadOp("r", 0, [0, 1], [2, 5])]))
            wb.start_load()
            wb.take_report()
            if device == "cuda":
                torch.cuda.synchronize()
            else:
                sb.drain()
            ok = all(torch.equal(canonical(tb, d, dst_case[1]), canonical(ta, s, src_case[1]))
                     for ta, tb in zip(kv_a.values(), kv_b.values()) for s, d in ((3, 2), (6, 5)))
            if not ok:
                bad.append(f"{src_case}->{dst_case}")
            wb.close()
        wa.close()
    return bad
