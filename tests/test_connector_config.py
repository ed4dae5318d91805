"""kv_connector_extra_config parsing: YAML via kvtier.config plus inline overrides."""

from __future__ import annotations

import pytest

from kvtier.connector.config import load_settings


def test_defaults_and_inline():
    s = load_settings({})
    assert s.cpu_blocks(1024) > 0 and s.eviction == "lru" and s.store == "eager"
    s = load_settings({"cpu_capacity_blocks": 12, "nvme_path": "/tmp/x", "store": "off"})
    assert s.cpu_blocks(1 << 20) == 12 and s.nvme_path == "/tmp/x" and s.store == "off"
    assert load_settings({"cpu_capacity": "1MiB"}).cpu_blocks(1 << 16) == 16
    with pytest.raises(ValueError):
        load_settings({"store": "sometimes"})


def test_yaml_then_overrides(tmp_path):
    pytest.importorskip("kvtier.config")
    p = tmp_path / "stack.yaml"
    p.write_text("tiers:\n  - {name: cpu, kind: cpu, capacity_blocks: 40}\npolicy: {eviction: lru}\n")
    s = load_settings({"config": str(p)})
    assert s.cpu_blocks(4096) == 40
    s = load_settings({"config": str(p), "cpu_capacity_blocks": 7})
    assert s.cpu_blocks(4096) == 7


def test_shipped_vllm_stack_policies(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_DATA", str(tmp_path))
    monkeypatch.setenv("KVTIER_NVME_CAPACITY", "64MiB")
    from kvtier.connector.config import load_settings
    s = load_settings({"config": "gpu-cpu-nvme"})
    assert (s.eviction, s.nvme_eviction, s.offload) == ("nextuse", "lru", "lazy")
    assert s.nvme_path == str(tmp_path)


def test_unknown_inline_key_is_an_error():
    from kvtier.connector.config import load_settings
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config key\(s\) \['cpu_capcity'\]"):
        load_settings({"cpu_capcity": "1GiB"})


def test_admission_from_yaml_and_inline(tmp_path):
    from kvtier.connector.config import load_settings
    p = tmp_path / "stack.yaml"
    p.write_text(f"tiers:\n  - {{name: cpu, kind: cpu, capacity_blocks: 40}}\n"
                 f"  - {{name: nvme, kind: nvme, path: {tmp_path}/nv, capacity_blocks: 8, admission: second_hit}}\n"
                 "policy: {eviction: lru, admission: all, params: {second_hit: {threshold: 2}}}\n")
    s = load_settings({"config": str(p)})
    assert (s.admission, s.nvme_admission, s.policy_params["second_hit"]) == ("all", "second_hit", {"threshold": 2})
    s = load_settings({"config": str(p), "nvme_admission": "all", "admission": "second_hit"})
    assert (s.admission, s.nvme_admission) == ("second_hit", "all")
