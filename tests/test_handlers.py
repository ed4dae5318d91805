"""The executor's handler table (`kvtier.core.handlers.HANDLERS`): one small class per (source
medium, destination medium), covering every pair the controller's plans produce; the executor
and write-behind dispatch through it, and an op whose pair has no handler is a per-block failure
naming the pair, never a raise."""

from __future__ import annotations

import logging

import pytest
import torch

from kvtier.core.controller import TierController
from kvtier.core.executor import Executor
from kvtier.core.handlers import HANDLERS
from kvtier.core.outside import Buffers
from kvtier.core.plan import CopyOp, LoadOp, Plan, Report, StoreOp
from kvtier.offline.blockgen import block_data, block_key
from kvtier.policies.lru import LRU
from kvtier.policies.promotion import Inclusive
from kvtier.tiers.base import SlotTier
from kvtier.tiers.contract import Medium
from kvtier.tiers.cpu_pool import CpuPool
from kvtier.tiers.nvme import NvmeTier
from kvtier.tiers.shared import SimSharedTier

OUT = Medium.OUTSIDE


def _pairs(plan: Plan, media: list[Medium]) -> set[tuple[Medium, Medium]]:
    return ({(media[op.tier], OUT) for op in plan.loads} | {(OUT, media[op.tier]) for op in plan.stores}
            | {(media[op.src_tier], media[op.tier]) for op in plan.copies})


def _complete(c: TierController, plan: Plan) -> None:
    rep = Report(stored={op.op_id: [True] * len(op.slots) for op in plan.stores},
                 copied={op.op_id: [7] * len(op.src_slots) for op in plan.copies},
                 loaded={op.req_id: True for op in plan.loads})
    rep.stored.update({op.op_id: [True] * len(op.via) for op in plan.loads if op.via})
    c.complete(rep)


def _stacks(tmp_path):
    nvme = lambda: NvmeTier("nvme", str(tmp_path / "n"), 64, 4096, LRU(64), with_data=False)  # noqa: E731
    yield lambda: [SlotTier("cpu", 4, 4096, LRU(4)), SlotTier("dram2", 64, 4096, LRU(64))]
    yield lambda: [SlotTier("cpu", 4, 4096, LRU(4)), nvme()]
    yield lambda: [SlotTier("cpu", 4, 4096, LRU(4)), nvme(), SimSharedTier("shared", 0, 4096)]
    yield lambda: [SlotTier("cpu", 4, 4096, LRU(4)), SimSharedTier("shared", 0, 4096)]
    yield lambda: [nvme()]   # no DRAM tier: stores go straight into the file


def test_the_table_covers_every_medium_pair_the_plans_produce(tmp_path):
    seen: set[tuple[Medium, Medium]] = set()
    for make in _stacks(tmp_path):
        for demotion in ("write_through", "write_back"):
            tiers = make()
            media = [t.medium for t in tiers]
            c = TierController(tiers, promotion=Inclusive(), demotion=demotion)
            keys = [block_key(9, i) for i in range(12)]
            for lo in range(0, 12, 4):   # the top tier holds 4: later stores evict (write back) earlier ones
                c.store(keys[lo:lo + 4], list(range(4)))
                plan = c.take_plan()
                seen |= _pairs(plan, media)
                _complete(c, plan)
            if c.acquire("r", keys) is not None:   # hits below the top: loads, promotions
                c.load("r", c.leases.get("r", 0, keys).num_blocks, list(range(12)))
                plan = c.take_plan()
                seen |= _pairs(plan, media)
                _complete(c, plan)
            for t in tiers:
                t.close()
    assert seen == set(HANDLERS), (seen ^ set(HANDLERS))
    for pair, h in HANDLERS.items():
        assert h.pair == pair


class _Planes:
    """An executor over a DRAM pool (tier 0) and a DRAM pool posing as a file plane (tier 1)."""

    def __init__(self, n: int, bb: int) -> None:
        self.top, self.low = CpuPool(n, bb, pin=False), CpuPool(n, bb, pin=False)
        self.low.medium = Medium.FILE       # a plane whose pairs (FILE, HOST) have no handler

    def close(self) -> None:
        self.top.close()
        self.low.close()


def test_an_op_without_a_handler_fails_its_blocks_and_names_the_pair(caplog):
    bb = 4096
    p = _Planes(4, bb)
    try:
        ex = Executor(Buffers([torch.zeros(bb, dtype=torch.uint8) for _ in range(4)], bb), [p.top, p.low], bb,
                      tier_names=["cpu", "nvme"])
        with caplog.at_level(logging.WARNING):
            ex.copy([CopyOp(5, [0, 1], [2, 3], keys=[b"a" * 16, b"b" * 16], src_tier=1, tier=0)])
            ex.reap(wait=True)
        rep = ex.take_report()
        assert rep.copied == {5: [-1, -1]}
        assert "no handler moves blocks from a file of slots to DRAM slots" in caplog.text
    finally:
        p.close()


def test_the_executor_runs_each_op_through_its_pairs_handler(monkeypatch):
    """Loads, stores and copies are dispatched by their pair: a handler swapped in the table runs."""
    bb = 4096
    top, low = CpuPool(4, bb, pin=False), CpuPool(4, bb, pin=False)
    calls: list[tuple] = []
    for pair in [(Medium.HOST, OUT), (OUT, Medium.HOST), (Medium.HOST, Medium.HOST)]:
        h = HANDLERS[pair]
        for verb in ("load", "store", "copy"):
            if hasattr(h, verb):
                real = getattr(h, verb)
                monkeypatch.setattr(h, verb, lambda *a, _r=real, _p=pair, _v=verb: (calls.append((_p, _v)), _r(*a))[1])
    try:
        blocks = [block_data(1, i, bb) for i in range(2)]
        bufs = list(blocks) + [torch.zeros(bb, dtype=torch.uint8) for _ in range(2)]
        ex = Executor(Buffers(bufs, bb), [top, low], bb)
        rep = ex.run(Plan(stores=[StoreOp(1, 0, [0, 1], [0, 1])],
                          copies=[CopyOp(2, [0, 1], [2, 3], src_tier=0, tier=1)]))
        assert rep.stored == {1: [True, True]} and rep.copied == {2: [0, 0]}
        ex.run(Plan(loads=[LoadOp("r", 1, [2, 3], [2, 3])]))
        assert torch.equal(bufs[2], blocks[0]) and torch.equal(bufs[3], blocks[1])   # byte-exact round trip
        assert calls == [((OUT, Medium.HOST), "store"), ((Medium.HOST, Medium.HOST), "copy"),
                         ((Medium.HOST, OUT), "load")]
    finally:
        top.close()
        low.close()


@pytest.mark.parametrize("pair", sorted(HANDLERS, key=lambda p: (p[0].name, p[1].name)))
def test_each_handler_is_a_small_class_of_its_pair(pair):
    h = HANDLERS[pair]
    verbs = [v for v in ("load", "store", "copy") if callable(getattr(h, v, None))]
    assert len(verbs) == 1 and (verbs[0] == "load") == (pair[1] is OUT) and (verbs[0] == "store") == (pair[0] is OUT)
