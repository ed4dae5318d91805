"""Trace replay through the real stack: real traffic, in arrival order, request by request as the
vLLM connector drives the controller (full blocks only, at least one token left to compute).

Per request: the hit is the longest prefix of its keys found in the stack (leased while the
request runs); hit blocks are read (real bytes, verified) and promoted per policy; then every
block the stack lacks is offered to it (admission, eviction, write-back below). `kvtier replay`
(`kvtier.cli.replay`) reports it with Belady's MIN and a TTFT cost model.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Sequence

import torch

from kvtier.core.stack import TierStack

DEFAULT_PREFILL_TPS = 10_000.0            # prefill tokens/s of the model being served
DEFAULT_LOAD_GBPS = {"cpu": 20.0, "nvme": 5.0, "shared": 1.0}  # host, NVMe, shared tier -> GPU GB/s


class _Blocks:
    """A request's blocks for the executor: the hit prefix (ids below `k`) loads into `scratch`,
    the rest is stored from `src`."""

    def __init__(self, scratch, src, k: int) -> None:
        self.scratch, self.src, self.k = scratch, src, k

    def __getitem__(self, j: int):
        return self.scratch[j] if j < self.k else self.src[j]


def _fill(t: torch.Tensor, key: bytes) -> None:
    """Block contents derived from its key (cheap to write, exact to check)."""
    t.view(torch.int64).fill_(_tag(key))


def _tag(key: bytes) -> int:
    return int.from_bytes(key[:8], "little", signed=True) ^ 0x5DEECE66D


def replay(stack: TierStack, reqs: Sequence[Any], block_tokens: int | None = None, progress: bool = False,
           keys: list[list[bytes]] | None = None, vllm: bool = True, warmup: int = 0) -> dict:
    """Drive the stack's controller request by request, as the connector's scheduler side does
    inside vLLM: lease the present prefix of the request's full blocks (at least one token is
    left to compute), load it (promotions as planned), store its other full blocks (a partial
    last block is never stored: vLLM does not hash it), run the plan (real bytes, or none),
    complete it, release the lease. The hit ratio counts every block of the trace.

    `vllm=False` is the prefix rule Belady is measured under: every block of the trace can hit
    and is stored. The first `warmup` requests fill the tiers but are not counted."""
    from kvtier.policies.base import RequestInfo
    from kvtier.offline.trace import make_keys

    bt = block_tokens or stack.cfg.block_tokens
    keys = keys if keys is not None else make_keys(reqs)
    ctrl, execute = stack.ctrl, stack.execute
    ntiers = len(stack.tiers)
    tier_hits = [0] * ntiers
    hits = refs = hit_tok = in_tok = bad = 0
    data = stack.with_data
    scratch = src = None
    if data:
        from kvtier.tiers.cpu_pool import CpuPool
        width = max((len(k) for k in keys), default=1) or 1
        scratch = CpuPool(width, stack.block_bytes, pin="auto")
        src = CpuPool(width, stack.block_bytes, pin="auto")
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(reqs), desc="replay", unit="req", file=sys.stderr, mininterval=0.5)
    acquire, load, store, take_plan, complete, release = (ctrl.acquire, ctrl.load, ctrl.store, ctrl.take_plan,
                                                          ctrl.complete, ctrl.release)
    count_request = ctrl.count_request
    rng = range(max((len(k) for k in keys), default=0))
    per_tenant: dict[str, list[int]] = {}   # label -> [block refs, hit blocks, input tokens, hit tokens]
    label = _labels(ctrl)
    t0 = time.perf_counter()
    try:
        for i, r in enumerate(reqs):
            ks = keys[i]
            n = len(ks)
            if not n:
                continue
            if vllm:  # what vLLM offers the connector: full blocks only, at least one token computed
                full = min(n, r.input_length // bt)
                lease = acquire("replay", ks[:min(full, (r.input_length - 1) // bt)])
            else:
                full = n
                lease = acquire("replay", ks)
            k = lease.num_blocks if lease is not None else 0
            counted = i >= warmup
            if counted:
                refs += n
                in_tok += r.input_length
            now = r.timestamp / 1000.0
            if k:
                if counted:
                    for t, _ in lease.blocks:
                        tier_hits[t] += 1
                load("replay", k, rng[:k], RequestInfo(ks, 0, k, r.input_length, bt, now, str(i), tenant=r.tenant))
            count_request(n, k)
            if k < full:
                if data:
                    for j in range(k, full):
                        _fill(src.views[j], ks[j])
                store(ks[k:full], rng[k:full], RequestInfo(ks, k, k, r.input_length, bt, now, str(i), tenant=r.tenant))
            rep, loaded = execute(take_plan(), _Blocks(scratch.views, src.views, k) if data else [])
            complete(rep)
            served = k
            if data and k:
                served = next((j for j in range(k) if not loaded.get(j, False)), k)
                for j in range(served):
                    if not bool((scratch.views[j].view(torch.int64) == _tag(ks[j])).all()):
                        bad += 1
            if counted:
                hits += served
                hit_tok += min(r.input_length, served * bt)
                if r.tenant is not None:
                    pt = per_tenant.setdefault(label(r.tenant), [0, 0, 0, 0])
                    pt[0] += n
                    pt[1] += served
                    pt[2] += r.input_length
                    pt[3] += min(r.input_length, served * bt)
            if k:
                release("replay")
            if bar is not None and i % 256 == 0:
                bar.update(min(256, len(reqs) - bar.n))
    finally:
        if bar is not None:
            bar.update(len(reqs) - bar.n)
            bar.close()
        if scratch is not None:
            scratch.close()
            src.close()
    dt = time.perf_counter() - t0
    tot = ctrl.totals
    per_tier = []
    for ti, t in enumerate(stack.tiers):
        c = lambda name: int(tot.get(f"{name}.{t.name}", 0))  # noqa: E731
        per_tier.append({
            "name": t.name, "kind": t.kind, "capacity_blocks": t.capacity_blocks,
            "hit_blocks": tier_hits[ti], "hit_ratio": tier_hits[ti] / refs if refs else 0.0,
            "stored": c("stored_blocks"), "promoted_in": c("promoted_blocks"), "demoted_in": c("demoted_blocks"),
            "evicted": c("evicted_blocks"), "not_admitted": c("not_admitted_blocks"),
            "dropped": c("store_dropped_blocks"), "bytes_read": c("bytes_loaded"), "bytes_written": c("bytes_stored"),
            "corrupt": c("corrupt_blocks")})
    out = {"requests": len(reqs), "block_refs": refs, "hit_blocks": hits,
            "hit_ratio": hits / refs if refs else 0.0,
            "token_hit_ratio": hit_tok / in_tok if in_tok else 0.0,
            "hit_tokens": hit_tok, "input_tokens": in_tok, "per_tier": per_tier,
            "policies": ctrl.describe(), "data": data, "block_bytes": stack.block_bytes,
            "content_mismatches": bad, "seconds": dt, "blocks_per_s": refs / dt if dt else 0.0}
    if per_tenant:
        held = ctrl.tenants.stats(tot) if ctrl.tenants is not None else {}
        out["tenants"] = {name: {"block_refs": a, "hit_blocks": b, "hit_ratio": b / a if a else 0.0,
                                 "token_hit_ratio": d / c if c else 0.0, "tiers": held.get(name, {})}
                          for name, (a, b, c, d) in sorted(per_tenant.items())}
    return out


MAX_TENANT_LABELS = 64   # a trace's tenants reported one by one; the rest together as "other"


def _labels(ctrl):
    """A trace tenant -> its report label: the configured tenants' (named ones and `other`), or the
    trace's own names, the first MAX_TENANT_LABELS of them."""
    if ctrl.tenants is not None:
        return ctrl.tenants.label
    seen: dict[str, str] = {}

    def label(t: str) -> str:
        v = seen.get(t)
        if v is None:
            v = seen[t] = t if len(seen) < MAX_TENANT_LABELS else "other"
        return v
    return label
