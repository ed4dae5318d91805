"""kv_connector_extra_config: the CLI's YAML schema (kvtier.core.config) plus flat overrides, one validation."""

from __future__ import annotations

import pytest

from kvtier.core.config import ConfigError
from kvtier.connector.config import load_settings, tier_of


def test_defaults_and_inline():
    s = load_settings({})
    cpu = tier_of(s, "cpu")
    assert cpu.blocks(1024) == 256 and s.policy.eviction == "lru" and s.serving.store
    assert s.policy.offload == "eager" and s.policy.demotion == "write_through"
    s = load_settings({"cpu_capacity_blocks": 12, "nvme_path": "/tmp/x", "store": "off"})
    assert tier_of(s, "cpu").blocks(1 << 20) == 12 and tier_of(s, "nvme").path == "/tmp/x"
    assert s.serving.store is False
    assert tier_of(load_settings({"cpu_capacity": "1MiB"}), "cpu").blocks(1 << 16) == 16
    with pytest.raises(ConfigError, match="serving.store"):
        load_settings({"store": ["sometimes"]})
    with pytest.raises(ConfigError, match="policy.demotion"):
        load_settings({"demotion": "write_sideways"})


def test_yaml_then_overrides(tmp_path):
    p = tmp_path / "stack.yaml"
    p.write_text("tiers:\n  - {name: cpu, kind: cpu, capacity_blocks: 40}\npolicy: {eviction: lru}\n")
    assert tier_of(load_settings({"config": str(p)}), "cpu").blocks(4096) == 40
    s = load_settings({"config": str(p), "cpu_capacity_blocks": 7, "promote": False, "demotion": "write_back"})
    assert tier_of(s, "cpu").blocks(4096) == 7
    assert (s.policy.promotion, s.policy.demotion) == ("none", "write_back")


def test_shipped_vllm_stack_policies(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_DATA", str(tmp_path))
    monkeypatch.setenv("KVTIER_NVME_CAPACITY", "64MiB")
    s = load_settings({"config": "gpu-cpu-nvme"})
    assert (s.policy.eviction, tier_of(s, "nvme").eviction, s.policy.offload) == ("lru", None, "lazy")
    assert tier_of(s, "nvme").path == str(tmp_path / "vllm")   # not the CLI's default directory


def test_unknown_inline_key_is_an_error():
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config: cpu_capcity: unknown key\(s\); known: "):
        load_settings({"cpu_capcity": "1GiB"})


def test_admission_from_yaml_and_inline(tmp_path):
    p = tmp_path / "stack.yaml"
    p.write_text(f"tiers:\n  - {{name: cpu, kind: cpu, capacity_blocks: 40}}\n"
                 f"  - {{name: nvme, kind: nvme, path: {tmp_path}/nv, capacity_blocks: 8, admission: second_hit}}\n"
                 "policy: {eviction: lru, admission: all, params: {second_hit: {threshold: 2}}}\n")
    s = load_settings({"config": str(p)})
    assert (s.policy.admission, tier_of(s, "nvme").admission, s.policy.params["second_hit"]) == \
        ("all", "second_hit", {"threshold": 2})
    s = load_settings({"config": str(p), "nvme_admission": "all", "admission": "second_hit"})
    assert (s.policy.admission, tier_of(s, "nvme").admission) == ("second_hit", "all")


def test_the_connector_needs_a_cpu_tier_on_top(tmp_path):
    p = tmp_path / "nvme-only.yaml"
    p.write_text(f"tiers:\n  - {{name: nvme, kind: nvme, path: {tmp_path}/nv, capacity_blocks: 8}}\n")
    with pytest.raises(ConfigError, match="runs one cpu tier, optionally one nvme tier and one shared tier below it.*got nvme"):
        load_settings({"config": str(p)})
    q = tmp_path / "two-cpu.yaml"
    q.write_text("tiers:\n  - {name: a, kind: cpu, capacity_blocks: 8}\n  - {name: b, kind: cpu, capacity_blocks: 8}\n")
    with pytest.raises(ConfigError, match="got cpu, cpu"):
        load_settings({"config": str(q)})


def test_promote_must_be_a_boolean():
    with pytest.raises(ConfigError, match="promote: expected true or false, got 'maybe'"):
        load_settings({"promote": "maybe"})


def _extra(cfg: dict):
    """What vLLM passes `get_required_kvcache_layout`: a config whose kv_transfer_config holds `cfg`."""
    from types import SimpleNamespace
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=cfg))


def test_a_bad_config_refuses_the_start_in_one_line(tmp_path):
    """Issue 27 item 5: the class methods vLLM calls before it builds the connector check the config;
    a bad one ends the process with `kvtier: error: <file>: <field>: <cause>` (a SystemExit's code)."""
    from kvtier.connector.connector import KVTierConnector
    from kvtier.connector.start_check import StartRefused
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n  - {name: cpu, kind: cpu, capacity_blocks: 64, evicton: lru}\n")
    for call in (lambda c: KVTierConnector.get_required_kvcache_layout(_extra(c)),
                 KVTierConnector.requires_piecewise_for_cudagraph):
        with pytest.raises(StartRefused) as e:
            call({"config": str(bad)})
        assert isinstance(e.value, SystemExit) and e.value.code == f"kvtier: error: {bad}: tiers.0.evicton: unknown key"
        with pytest.raises(StartRefused) as e:
            call({"cpu_capcity": "1GiB"})
        assert e.value.code.startswith("kvtier: error: kv_connector_extra_config: cpu_capcity: unknown key(s); known: ")
    bad.write_text("tiers:\n  - {name: cpu, kind: cpu, capacity_blocks: -1, evicton: lru}\n")
    with pytest.raises(StartRefused) as e:
        KVTierConnector.requires_piecewise_for_cudagraph({"config": str(bad)})
    line = e.value.code
    assert "\n" not in line and line.startswith(f"kvtier: error: {bad}: tiers.0.")
    assert "capacity_blocks: must be between 1" in line and "evicton: unknown key" in line and line.count("; ") == 1, line
    with pytest.raises(StartRefused, match=r"^kvtier: error: .*missing\.yaml: no such config file"):
        KVTierConnector.get_required_kvcache_layout(_extra({"config": str(tmp_path / "missing.yaml")}))
    good = tmp_path / "good.yaml"
    good.write_text("tiers:\n  - {name: cpu, kind: cpu, capacity_blocks: 64}\n")
    assert KVTierConnector.get_required_kvcache_layout(_extra({"config": str(good)})) is None
    assert KVTierConnector.requires_piecewise_for_cudagraph({"config": str(good), "cpu_capacity_blocks": 8}) is True


def test_a_childs_refusal_is_printed_last_by_its_parent_only_when_it_fails(tmp_path, monkeypatch, capsys):
    """The parent (vLLM's API server) prints the line its engine core left when it ends on an
    uncaught exception; a clean exit, or a note older than this module's load, prints nothing (and
    removes the note)."""
    import os
    import sys
    import time

    from kvtier.connector import start_check as C
    monkeypatch.setenv("KVTIER_RUN_DIR", str(tmp_path))
    line = "kvtier: error: /x.yaml: tiers.0.evicton: unknown key"
    note = tmp_path / f"start-refused.{os.getpid()}"
    note.write_text(line + "\n")
    monkeypatch.delattr(sys, "last_value", raising=False)
    C.repeat_a_childs_refusal()
    assert capsys.readouterr().err == "" and not note.exists()
    note.write_text(line + "\n")
    monkeypatch.setattr(sys, "last_value", RuntimeError("Engine core initialization failed"), raising=False)
    C.repeat_a_childs_refusal()
    assert capsys.readouterr().err == line + "\n" and not note.exists()
    note.write_text(line + "\n")
    os.utime(note, (time.time() - 3600, C.LOADED_AT - 3600))    # left by an earlier process with this pid
    C.repeat_a_childs_refusal()
    assert capsys.readouterr().err == "" and not note.exists()


def test_shared_options_and_their_older_redis_names_set_the_same_tier():
    """`shared_url` / `shared_timeout_s` name the shared tier's options; `redis_url` / `redis_timeout_s` still do."""
    new = load_settings({"shared_url": "redis://h:6379/0", "shared_timeout_s": 2.5})
    old = load_settings({"redis_url": "redis://h:6379/0", "redis_timeout_s": 2.5})
    assert [(t.kind, t.url, t.timeout_s) for t in new.storage_tiers() if t.kind == "shared"] == \
           [(t.kind, t.url, t.timeout_s) for t in old.storage_tiers() if t.kind == "shared"] == \
           [("shared", "redis://h:6379/0", 2.5)]
