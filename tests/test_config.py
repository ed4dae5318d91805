import os

import pytest

from kvtier.config import ConfigError, load_config, parse_config, shipped_configs
from kvtier.units import parse_size


def test_shipped_configs_load(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_DATA", str(tmp_path / "data"))
    # The shipped sizes are defaults; the disk check must not depend on this machine's free space.
    monkeypatch.setenv("KVTIER_NVME_CAPACITY", "64MiB")
    assert {"cpu-only.yaml", "cpu-nvme.yaml", "gpu-cpu-nvme.yaml"} <= set(shipped_configs())
    for name in shipped_configs():
        cfg = load_config(name)
        assert cfg.tiers
    cfg = load_config()  # the embedded default
    assert [t.kind for t in cfg.tiers] == ["cpu", "nvme"]
    assert cfg.tiers[1].path == str(tmp_path / "data")
    assert cfg.block_bytes == 262144
    assert cfg.tiers[0].blocks(cfg.block_bytes) == 4096
    assert cfg.tiers[1].blocks(cfg.block_bytes) == 256


def test_shipped_capacity_defaults_and_overrides(monkeypatch):
    monkeypatch.delenv("KVTIER_NVME_CAPACITY", raising=False)
    monkeypatch.delenv("KVTIER_CPU_CAPACITY", raising=False)
    cfg = load_config("gpu-cpu-nvme", check_env=False)
    assert [t.capacity for t in cfg.tiers[1:]] == [8 << 30, 64 << 30]
    monkeypatch.setenv("KVTIER_CPU_CAPACITY", "3GiB")
    monkeypatch.setenv("KVTIER_NVME_CAPACITY", "12GiB")
    cfg = load_config("gpu-cpu-nvme", check_env=False)
    assert [t.capacity for t in cfg.tiers[1:]] == [3 << 30, 12 << 30]
    monkeypatch.setenv("KVTIER_NVME_CAPACITY", "lots")
    with pytest.raises(ConfigError, match="tiers.2.capacity"):
        load_config("gpu-cpu-nvme", check_env=False)


def test_issue_yaml_shape(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(f"""
block_bytes: 262144
tiers:
  - {{name: cpu, kind: cpu, capacity: 2GiB}}
  - {{name: nvme, kind: nvme, path: {tmp_path}/kv, capacity: 64MiB, io: auto}}
policy: {{eviction: lru}}
""")
    cfg = load_config(p)
    assert cfg.tiers[0].blocks(cfg.block_bytes) == 8192
    assert cfg.tiers[1].blocks(cfg.block_bytes) == 256
    assert cfg.policy.eviction == "lru"


@pytest.mark.parametrize("text, needle", [
    ("tiers: [{name: a, kind: tape, capacity: 1GiB}]", "tiers.0.kind"),
    ("tiers: [{name: a, kind: cpu, capacity: lots}]", "tiers.0.capacity"),
    ("tiers: [{name: a, kind: cpu}]", "give capacity"),
    ("tiers: [{name: a, kind: cpu, capacity: 1GiB, colour: red}]", "tiers.0.colour: unknown key"),
    ("tiers: []", "at least one tier"),
    ("tiers: [{name: a, kind: nvme, capacity: 1GiB}]", "needs a path"),
    ("block_bytes: -5\ntiers: [{name: a, kind: cpu, capacity: 1GiB}]", "block_bytes"),
    ("tiers: [{name: a, kind: cpu, capacity: 1GiB}]\npolicy: {eviction: nonesuch}", "unknown policy 'nonesuch'"),
    ("tiers: [{name: a, kind: cpu, capacity: 1GiB}, {name: a, kind: cpu, capacity: 1GiB}]", "duplicate tier names"),
    ("tiers: [{name: n, kind: nvme, path: /tmp/x, capacity: 1GiB}, {name: c, kind: cpu, capacity: 1GiB}]", "fastest first"),
    ("tiers: [{name: a, kind: cpu, capacity: 1GiB}", "not valid YAML"),
    ("- just a list", "expected a mapping"),
])
def test_bad_yaml_names_the_field(tmp_path, text, needle):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert needle in str(e.value)
    assert str(p) in str(e.value)


def test_missing_file_lists_shipped(tmp_path):
    with pytest.raises(ConfigError, match="no such config file.*cpu-nvme.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_path_not_writable(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user that ignores permissions")
        with pytest.raises(ConfigError, match=r"tiers.0.path: .* not writable"):
            parse_config({"tiers": [{"name": "n", "kind": "nvme", "path": str(ro / "kv"), "capacity": "1MiB"}]})
    finally:
        ro.chmod(0o700)


def test_path_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="tiers.0.path: .* not a directory"):
        parse_config({"tiers": [{"name": "n", "kind": "nvme", "path": str(f / "kv"), "capacity": "1MiB"}]})


def test_capacity_larger_than_disk(tmp_path):
    with pytest.raises(ConfigError, match=r"tiers.0.capacity: .* bytes free"):
        parse_config({"tiers": [{"name": "n", "kind": "nvme", "path": str(tmp_path), "capacity": "999TiB"}]})


def test_sizes():
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("256 KiB") == 262144
    assert parse_size("64G") == 64 * 10**9
    assert parse_size(4096) == 4096
    assert parse_size("1EiB") == 1 << 60 and parse_size("1EB") == 10**18 and parse_size("2PiB") == 2 << 50
    assert parse_size("1.5GiB") == 3 << 29
    for bad in ("", "1.2.3", "5 parsecs", -1, True, "2EiB", "9" * 30):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_1eib_in_a_config_is_a_size(tmp_path):
    cfg = parse_config({"tiers": [{"name": "n", "kind": "nvme", "path": str(tmp_path), "capacity": "1EiB"}]},
                       check_env=False)
    assert cfg.tiers[0].capacity == 1 << 60


@pytest.mark.parametrize("text,want", [
    ("block_bytes: 64KiB\ntiers:\n  - {name: cpu, kind: cpu, capacity_blocks: " + "9" * 5000 + "}\n",
     "line 3: tiers.0.capacity_blocks: an integer of 5000 digits"),
    ("block_bytes: " + "1" * 5000 + "\ntiers: []\n", "line 1: block_bytes: an integer of 5000 digits"),
    ("block_bytes: 64KiB\ntiers:\n  - {name: cpu, kind: cpu, capacity_blocks: 8}\nblock_bytes: 128KiB\n",
     "line 4: block_bytes: duplicate key 'block_bytes' (first at line 1)"),
    ("tiers:\n  - {name: cpu, kind: cpu,\n     capacity_blocks: 8, capacity_blocks: 9}\n",
     "line 3: tiers.0.capacity_blocks: duplicate key 'capacity_blocks' (first at line 3)"),
    ("tiers:\n  - name: cpu\n    kind: cpu\n    capacity: 1GiB\n    kind: nvme\n",
     "line 5: tiers.0.kind: duplicate key 'kind' (first at line 3)"),
])
def test_long_integers_and_duplicate_keys_are_one_error_naming_field_and_line(tmp_path, text, want):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(p, check_env=False)
    assert str(e.value) == f"{p}: {want}" or str(e.value).startswith(f"{p}: {want}"), str(e.value)
    assert "\n" not in str(e.value) and "4300" not in str(e.value)


def test_two_nvme_tiers_cannot_share_a_directory(tmp_path):
    d = tmp_path / "nv"
    data = {"block_bytes": 4096, "tiers": [
        {"name": "a", "kind": "nvme", "path": str(d), "capacity_blocks": 4},
        {"name": "b", "kind": "nvme", "path": str(d) + "/./", "capacity_blocks": 4}]}
    with pytest.raises(ConfigError, match="nvme tiers 'a' and 'b' share the directory"):
        parse_config(data, check_env=False)


@pytest.mark.parametrize("params,want", [({"levels": "a,b"}, "could not convert"),
                                          ({"sample": 999}, "sample must be in")])
def test_a_bad_policy_parameter_value_names_the_policy(params, want):
    from kvtier.builder import build_controller, build_tiers
    cfg = parse_config({"block_bytes": 4096, "tiers": [{"name": "cpu", "kind": "cpu", "capacity_blocks": 4}],
                        "policy": {"eviction": "hawk", "params": {"hawk": params}}}, source="s.yaml", check_env=False)
    with pytest.raises(ConfigError) as ei:
        build_controller(cfg, build_tiers(cfg, "none"))
    assert str(ei.value).startswith("s.yaml: policy.params.hawk") and want in str(ei.value)
