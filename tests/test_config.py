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
    for bad in ("", "1.2.3", "5 parsecs", -1, True):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_two_nvme_tiers_cannot_share_a_directory(tmp_path):
    d = tmp_path / "nv"
    data = {"block_bytes": 4096, "tiers": [
        {"name": "a", "kind": "nvme", "path": str(d), "capacity_blocks": 4},
        {"name": "b", "kind": "nvme", "path": str(d) + "/./", "capacity_blocks": 4}]}
    with pytest.raises(ConfigError, match="nvme tiers 'a' and 'b' share the directory"):
        parse_config(data, check_env=False)


@pytest.mark.parametrize("name,params,want", [("s3fifo", {"small_ratio": 2}, "small_ratio must be in"),
                                               ("lru", {"order": "random"}, "order must be one of")])
def test_a_bad_policy_parameter_value_names_the_policy(name, params, want):
    from kvtier.builder import build_controller, build_tiers
    cfg = parse_config({"block_bytes": 4096, "tiers": [{"name": "cpu", "kind": "cpu", "capacity_blocks": 4}],
                        "policy": {"eviction": name, "params": {name: params}}}, source="s.yaml", check_env=False)
    with pytest.raises(ConfigError) as ei:
        build_controller(cfg, build_tiers(cfg, "none"))
    assert str(ei.value).startswith(f"s.yaml: policy.params.{name}") and want in str(ei.value)


@pytest.mark.parametrize("yaml_text,field,name,use", [
    ("policy: {eviction: hawk}", "policy: eviction", "hawk", "lru"),
    ("policy: {admission: bypass}", "policy: admission", "bypass", "all"),
    ("policy: {params: {nextuse: {classes: 4}}}", "policy: params.nextuse", "nextuse", "lru"),
    ("  - {name: nv, kind: nvme, path: NV, capacity_blocks: 8, eviction: plru}", "tiers.1.eviction", "plru", "lru"),
])
def test_an_old_yaml_naming_a_retired_policy_is_one_clear_line(tmp_path, capsys, yaml_text, field, name, use):
    """A YAML written for an older kvtier fails at load with one line naming the field, the
    retired policy and what to use instead (the CLI's exit 2, no traceback)."""
    from kvtier.cli import main
    p = tmp_path / "old.yaml"
    tiers = "block_bytes: 4096\ntiers:\n  - {name: cpu, kind: cpu, capacity_blocks: 8}\n"
    p.write_text(tiers + yaml_text.replace("NV", str(tmp_path / "nv")) + "\n")
    with pytest.raises(ConfigError, match=f"{field}: policy '{name}' was retired .*; use '{use}'"):
        load_config(p, check_env=False)
    assert main(["replay", "--config", str(p), "--no-data", "--limit", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{field}: policy '{name}' was retired" in err[0], err
    assert not (tmp_path / "nv").exists()   # refused before anything was opened
