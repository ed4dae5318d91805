"""No exception leaves a vLLM hook (`connector.hook`): each failure has a safe answer that
keeps the books straight (no lease or pending slot left behind, accepted loads recomputed)."""

from __future__ import annotations

import logging
import os
import sys

from kvtier.common.once import Once
from kvtier.connector.connector import hook, hook_failed

sys.path.insert(0, os.path.dirname(__file__))
from parts_util import worker_settings  # noqa: E402
from test_connector_scheduler import Req, make, run_step, store_request  # noqa: E402


class _Side:
    """A side: counts failures, answers `fallback` / fails in `bad_fallback`."""

    def __init__(self):
        self.counted = []
        self.recovered = []

    def count(self, key, v=1):
        self.counted.append(key)

    def fallback(self, x):
        self.recovered.append(x)
        return -x

    def bad_fallback(self):
        raise KeyError("second")


class _Hooked:
    def __init__(self):
        self.side = _Side()
        self.failures_once = Once(logging.getLogger("kvtier.test"))

    @hook(recover="fallback")
    def ok(self, x):
        return x * 2

    @hook(recover="fallback")
    def boom(self, x):
        raise OSError(28, "No space left on device")

    @hook(default=lambda: (0, False))
    def boom_default(self):
        raise RuntimeError("x")

    @hook(recover="bad_fallback", default=set)
    def boom_twice(self):
        raise ValueError("first")

    @hook(name="a_hook")
    def _part_of_a_hook(self):
        raise ValueError("named")


def test_hook_answers_the_fallback_and_counts():
    h = _Hooked()
    g = h.side
    assert h.ok(3) == 6 and g.counted == []
    assert h.boom(3) == -3 and g.recovered == [3]
    assert h.boom_default() == (0, False)
    assert h.boom_twice() == set()           # the fallback failed too: the default, both counted
    assert h._part_of_a_hook() is None       # counted under the hook's name
    assert g.counted == ["hook_errors.boom", "hook_errors.boom_default", "hook_errors.boom_twice",
                         "hook_errors.boom_twice.recover", "hook_errors.a_hook"]


def test_a_hooks_failure_is_counted_each_time_and_logged_once_per_cause(caplog):
    """`hook_failed`: every failure counted under its hook, one ERROR line per hook and cause."""
    counted = []
    once = Once(logging.getLogger("kvtier.connector"))
    with caplog.at_level(logging.DEBUG, logger="kvtier.connector"):
        for _ in range(2):
            hook_failed(lambda k, v=1: counted.append(k), once, "wait_for_save", OSError(28, "No space left on device"))
        hook_failed(lambda k, v=1: counted.append(k), once, "wait_for_save", OSError(30, "Read-only file system"))
    assert counted == ["hook_errors.wait_for_save"] * 3
    assert [r.levelno for r in caplog.records if r.name == "kvtier.connector"] == \
        [logging.ERROR, logging.DEBUG, logging.ERROR]


def test_once_logs_each_cause_once(caplog):
    once = Once(logging.getLogger("kvtier.test"))
    with caplog.at_level(logging.DEBUG, logger="kvtier.test"):
        assert once(("a", 28), logging.ERROR, "disk full %d", 1)
        assert not once(("a", 28), logging.ERROR, "disk full %d", 2)
        assert once(("a", 30), logging.ERROR, "read-only %d", 3)
    levels = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert levels == [(logging.ERROR, "disk full 1"), (logging.DEBUG, "disk full 2"), (logging.ERROR, "read-only 3")]


def test_failed_alloc_reports_the_accepted_blocks_as_load_errors():
    s, tier = make()
    store_request(s, Req("a", list(range(18))))
    r = Req("b", list(range(18)))
    r.num_computed_tokens = 0
    assert s.lookup(r, 0) == 16
    assert s.leases.pinned() == 4
    s.fail_alloc(r, [[7, 8, 9, 10, 11]], 16)     # update_state_after_alloc raised after vLLM accepted 16
    assert s.leases.pinned() == 0 and sum(tier._ref) == 0
    meta = s.build_meta([("b", 18, [[7, 8, 9, 10, 11]])])
    assert meta.failed_loads == {"b": [7, 8, 9, 10]}   # the worker reports them: vLLM recomputes
    assert not meta.loads
    assert s.build_meta([]).failed_loads == {}          # once


def test_failed_plan_fails_loads_and_releases_every_pin():
    s, tier = make(cap=8)
    store_request(s, Req("a", list(range(18))))
    r = Req("b", list(range(18)))
    assert s.lookup(r, 0) == 16
    s.on_alloc(r, [[7, 8, 9, 10, 11]], 16)
    c = Req("c", list(range(100, 118)))            # new blocks to store in the same step
    s.lookup(c, 0)
    s.on_alloc(c, [[20, 21, 22, 23, 24]], 0)
    s._plan_stores([("c", 18, [[20, 21, 22, 23, 24]])])
    assert s.ctrl.has_plan()
    meta = s.fail_plan()                            # build_connector_meta raised
    assert meta.failed_loads == {"b": [7, 8, 9, 10]} and not meta.loads and not meta.stores
    assert s.leases.pinned() == 0 and sum(tier._ref) == 0
    assert s.ctrl.in_flight == 0 and len(tier._pending) == 0
    assert tier.num_resident == 4                   # a's blocks stay; c's were never published
    # the next step plans normally
    assert not run_step(s, []).failed_loads


# ---- a CPU pool that does not fit memory is refused; a share the worker resolves smaller: the scheduler follows

def test_fit_pool_slots_refuses_what_does_not_fit(monkeypatch):
    """A DRAM tier given as a size that does not fit is refused in one line naming the key, the
    size asked and what is available (it was shrunk to fit while the start line showed the size
    asked); a share takes whatever fits."""
    import pytest

    import kvtier.core.fit
    from kvtier.core.config import ConfigError, TierConfig
    from kvtier.connector.startup import fit_pool_slots
    monkeypatch.setattr(kvtier.core.fit, "memory_headroom", lambda: 1 << 30)
    bb, head = 1 << 20, 1 << 30
    cpu = TierConfig(name="cpu", kind="cpu", capacity_blocks=100)
    assert fit_pool_slots(cpu, bb, available=head + 200 * bb) == (100, None)
    with pytest.raises(ConfigError) as e:
        fit_pool_slots(cpu, bb, available=head + 40 * bb)
    assert str(e.value) == ("kvtier: tiers.cpu.capacity (cpu_capacity_blocks): 100.0 MiB of DRAM asked, only "
                            "40.0 MiB available to it (MemAvailable 1.0 GiB after vLLM's KV cache, less 1.0 GiB "
                            "kept free); refused: lower it or give a share such as '50%'")
    assert fit_pool_slots(cpu, bb, ranks=2, available=head + 200 * bb) == (100, None)
    with pytest.raises(ConfigError, match=r"only 60.0 MiB available to each of 2 workers"):
        fit_pool_slots(cpu, bb, ranks=2, available=head + 120 * bb)     # two workers on the host share it
    big = TierConfig(name="cpu", kind="cpu", capacity="1TiB")
    with pytest.raises(ConfigError, match=r"tiers.cpu.capacity \(cpu_capacity\): 1024.0 GiB of DRAM asked"):
        fit_pool_slots(big, bb, available=head + 40 * bb)
    half = TierConfig(name="cpu", kind="cpu", capacity="50%")
    with pytest.raises(ConfigError, match=r"50% of DRAM asked, only 0 B available .*: holds no block of 1.0 MiB"):
        fit_pool_slots(half, bb, available=head)
    assert fit_pool_slots(half, bb, available=head + 40 * bb) == (20, None)   # a share of what is left


def test_a_smaller_pool_limits_the_schedulers_tier(monkeypatch):
    import torch

    import kvtier.core.fit
    from kvtier.connector.metadata import KVTierMetadata
    from kvtier.connector.worker import KVTierWorker

    buf = torch.randn(2, 16, 2, 4, 8)
    caches = {f"l{i}": buf[i] for i in range(2)}
    bb = 2 * 2 * 4 * 8 * 4
    monkeypatch.setattr(kvtier.core.fit, "memory_headroom", lambda: 1 << 30)
    monkeypatch.setattr(kvtier.core.fit, "available_memory", lambda: (1 << 30) + 10 * bb)
    w = KVTierWorker(worker_settings(cpu_capacity="50%"))
    w.register_kv_caches(caches)
    assert w.pools[0].num_slots == 5
    s, tier = make(cap=8)
    r = Req("a", list(range(30)))             # 7 full blocks, 8 slots in the scheduler's tier
    s.lookup(r, 0)
    s.on_alloc(r, [list(range(8))], 0)
    meta = s.build_meta([("a", 30, [list(range(8))])])
    assert sorted(x for op in meta.stores for x in op.slots) == list(range(7))
    w.bind(KVTierMetadata(stores=meta.stores))
    w.save()                                  # slots 5 and 6 lie beyond the pool: that store fails whole
    rep = w.take_report()
    assert rep.capacity == {0: 5}
    s.on_worker_meta(rep)
    assert tier.capacity_blocks == 5 and tier.num_resident == 0 and tier.num_free_slots == 5
    assert sum(tier._ref) == 0 and not tier._pending
    store_request(s, Req("b", list(range(100, 130))), base=200)   # 7 blocks into 5 slots: 5 stay
    assert tier.num_resident == 5 and max(tier.resident.values()) < 5
    w.close()

