"""A bad value on the shared tier (real redis-server) is read once: the load fails, the value is
deleted on the server if it still holds it (a good value written meanwhile stays), the key is
remembered as bad so the next lookup misses, and writing the block again makes it servable."""

from __future__ import annotations

import logging

import pytest
import torch

from kvtier.core.config import parse_config
from kvtier.core.stack import TierStack
from kvtier.tiers.shared_conn import Namespace, RedisSettings
from kvtier.tiers.shared_data import SharedData

BB = 64 << 10
SECRET = "fleet-secret"
DAMAGE = ["truncated_by_one", "random", "empty", "foreign", "8MiB"]


def _cfg(url: str, model: str = "m"):
    return parse_config({"block_bytes": BB, "model": model, "tiers": [
        {"name": "cpu", "kind": "cpu", "capacity_blocks": 8},
        {"name": "shared", "kind": "redis", "url": url, "timeout_s": 5, "connect_timeout_s": 5,
         "secret": SECRET}]}, check_env=False)


def _keys(tag: str, n: int = 4) -> list[bytes]:
    return [f"{tag}-{i:04d}".encode().ljust(16, b".") for i in range(n)]


def _blocks(n: int = 4, seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 255, (BB,), dtype=torch.uint8, generator=g) for _ in range(n)]


def _bad_value(damage: str, good: bytes, url: str, key: bytes, block: torch.Tensor) -> bytes:
    if damage == "truncated_by_one":
        return good[:-1]
    if damage == "random":
        g = torch.Generator().manual_seed(9)
        return bytes(torch.randint(0, 255, (len(good),), dtype=torch.uint8, generator=g).numpy())
    if damage == "empty":
        return b""
    if damage == "foreign":  # another namespace's genuine value (another model), under our name
        cfg = _cfg(url, model="other")
        rd = SharedData(RedisSettings.of(cfg.tiers[1]), Namespace(cfg.fingerprint(), SECRET), BB)
        try:
            return bytes(rd.seal(key, block))
        finally:
            rd.close()
    return good[:64] + b"\x5a" * ((8 << 20) - 64)


def _plant(redis_server, tag: str, damage: str):
    """Blocks 0-3 on the server through one stack; block 2's value replaced by a bad one."""
    cfg = _cfg(redis_server.url)
    keys, data = _keys(tag), _blocks()
    with TierStack.from_config(cfg) as st:
        assert st.put(keys, data) == 4
    cl = redis_server.client()
    name = Namespace(cfg.fingerprint(), SECRET).name(keys[2])
    good = cl.get(name)
    cl.set(name, _bad_value(damage, good, redis_server.url, keys[2], data[2]))
    return cfg, keys, data, cl, name, good


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "pipeline"])
@pytest.mark.parametrize("damage", DAMAGE)
def test_bad_value_read_once_deleted_then_a_miss(redis_server, damage, direct, caplog):
    cfg, keys, data, cl, name, good = _plant(redis_server, f"once-{damage}-{direct}", damage)
    with TierStack.from_config(cfg) as st:
        st.tiers[1].conn.direct_reads = direct
        out = [torch.zeros(BB, dtype=torch.uint8) for _ in keys]
        with caplog.at_level(logging.WARNING, logger="kvtier.shared"):
            assert st.get(keys, out) == 2
        assert all(torch.equal(a, b) for a, b in zip(out[:2], data[:2]))
        assert not cl.exists(name)                          # deleted on the server
        assert cl.exists(Namespace(cfg.fingerprint(), SECRET).name(keys[3]))  # the others stay
        for _ in range(3):                                  # the next lookups miss: never read again
            assert st.lookup(keys) == 2
            assert st.get(keys, out) == 2
        tot = st.ctrl.totals
        assert tot["corrupt_blocks.shared"] == 1
        assert tot["bad_blocks.shared"] == 1
        assert tot["bad_deleted_blocks.shared"] == 1
        assert tot["gone_blocks.shared"] == 1
        assert tot["hit_blocks.shared"] == 4                # the first get only (blocks 0-1 promoted)
        assert "bad_rewritten_blocks.shared" not in tot
        lines = [r for r in caplog.records if "failed verification" in r.getMessage()]
        assert len(lines) == 1
        # written again (a good value): servable again, here and by another instance
        assert st.put(keys[2:3], data[2:3]) == 1
        assert cl.get(name) == good
        assert st.lookup(keys) == 4
    n, tot = _fresh_get(cfg, keys, data)
    assert n == 4 and "corrupt_blocks.shared" not in tot


def _fresh_get(cfg, keys, data):
    with TierStack.from_config(cfg) as st:
        out = [torch.zeros(BB, dtype=torch.uint8) for _ in keys]
        n = st.get(keys, out)
        assert all(torch.equal(a, b) for a, b in zip(out[:n], data[:n]))
        return n, dict(st.ctrl.totals)


def test_a_good_value_written_meanwhile_is_not_deleted(redis_server, monkeypatch):
    """Between the read of the bad value and its deletion another instance writes the good one:
    it stays on the server (compare-and-delete by digest). This instance still misses it (its
    mark) until it writes the block itself; another instance is served."""
    cfg, keys, data, cl, name, good = _plant(redis_server, "rewritten", "truncated_by_one")
    drop = SharedData.drop_bad

    def rewrite_first(self, items):
        cl.set(name, good)
        return drop(self, items)

    monkeypatch.setattr(SharedData, "drop_bad", rewrite_first)
    with TierStack.from_config(cfg) as st:
        out = [torch.zeros(BB, dtype=torch.uint8) for _ in keys]
        assert st.get(keys, out) == 2
        assert cl.get(name) == good
        tot = st.ctrl.totals
        assert tot["bad_rewritten_blocks.shared"] == 1 and "bad_deleted_blocks.shared" not in tot
        assert st.lookup(keys) == 2                         # remembered as bad here
    monkeypatch.setattr(SharedData, "drop_bad", drop)
    n, tot = _fresh_get(cfg, keys, data)
    assert n == 4 and "corrupt_blocks.shared" not in tot


def test_undeletable_bad_value_is_still_read_once(redis_server, monkeypatch):
    """The server keeps the bad value (its script refused): the mark alone makes lookups miss."""
    cfg, keys, data, cl, name, good = _plant(redis_server, "kept", "random")
    monkeypatch.setattr(SharedData, "drop_bad", lambda self, items: 0)
    with TierStack.from_config(cfg) as st:
        out = [torch.zeros(BB, dtype=torch.uint8) for _ in keys]
        for _ in range(3):
            assert st.get(keys, out) == 2
        assert cl.exists(name)
        assert st.ctrl.totals["corrupt_blocks.shared"] == 1
        assert st.tiers[1].stats()["bad_marked_blocks"] == 1


def test_bad_marks_are_bounded(monkeypatch):
    import kvtier.tiers.shared as R
    monkeypatch.setattr(R, "BAD_MAX", 3)
    t = R.SharedTier("shared", RedisSettings(url="redis://127.0.0.1:1/0"), {"model": "m"}, BB, data=False)
    try:
        keys = _keys("cap", 5)
        t.note_bad(keys)
        assert t.stats()["bad_marked_blocks"] == 3          # the two oldest marks went
        assert t.lookup(keys[:2], wait=False) is None        # not marked: asked
        t.note_written(keys[2:3])
        assert t.stats()["bad_marked_blocks"] == 2 and t.holds(keys[2])
    finally:
        t.close()
