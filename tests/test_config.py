import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from kvtier.core.config import ConfigError, load_config, parse_config, shipped_configs
from kvtier.common.units import parse_size


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
    with pytest.raises(ConfigError, match=r"tiers.0.capacity: tier 'n': asks 1\d+\.\d+ TiB of disk .* only .* "
                                          r"available at " + str(tmp_path)):
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


@pytest.mark.parametrize("name,params,want", [("s3fifo", {"small_ratio": 2}, "small_ratio must be in"),
                                               ("lru", {"order": "random"}, "order must be one of")])
def test_a_bad_policy_parameter_value_names_the_policy(name, params, want):
    from kvtier.core.builder import build_controller, build_tiers
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
    from kvtier.cli.main import main
    p = tmp_path / "old.yaml"
    tiers = "block_bytes: 4096\ntiers:\n  - {name: cpu, kind: cpu, capacity_blocks: 8}\n"
    p.write_text(tiers + yaml_text.replace("NV", str(tmp_path / "nv")) + "\n")
    with pytest.raises(ConfigError, match=f"{field}: policy '{name}' was retired .*; use '{use}'"):
        load_config(p, check_env=False)
    assert main(["replay", "--config", str(p), "--no-data", "--limit", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{field}: policy '{name}' was retired" in err[0], err
    assert not (tmp_path / "nv").exists()   # refused before anything was opened


# ---- capacities that fit the machine (kvtier.core.fit) -------------------------------------------
GiB = 1 << 30


def _cfg(tmp_path, cpu="1GiB", nvme="1GiB", bb="1MiB", path=None):
    tiers = [{"name": "cpu", "kind": "cpu", "capacity": cpu}]
    if nvme is not None:
        tiers.append({"name": "nvme", "kind": "nvme", "path": str(path or tmp_path / "nv"), "capacity": nvme})
    return parse_config({"block_bytes": bb, "tiers": tiers}, source="s.yaml", check_env=False)


@pytest.fixture
def ram(monkeypatch):
    """A machine with 10 GiB available and a 1 GiB headroom (the real figures are tested below)."""
    import kvtier.core.fit as c
    monkeypatch.setattr(c, "available_memory", lambda: 10 * GiB)
    monkeypatch.setattr(c, "memory_headroom", lambda: GiB)


def test_cpu_share_is_of_the_memory_kvtier_may_use(tmp_path, ram):
    from kvtier.core.fit import fit_to_machine
    cfg, warnings = fit_to_machine(_cfg(tmp_path, cpu="50%", nvme=None))
    assert cfg.tiers[0].blocks(cfg.block_bytes) == (9 * GiB // 2) >> 20 and warnings == []   # (10 - 1) / 2
    cfg, _ = fit_to_machine(_cfg(tmp_path, cpu="100%", nvme=None), reserved_memory=4 * GiB)
    assert cfg.tiers[0].blocks(cfg.block_bytes) == (5 * GiB) >> 20                            # 10 - 4 - 1
    with pytest.raises(ConfigError, match="resolve it with kvtier.core.fit.fit_to_machine"):
        _cfg(tmp_path, cpu="50%", nvme=None).tiers[0].blocks(1 << 20)   # unresolved: never a silent guess


def test_cpu_tier_beyond_available_memory_is_refused_or_shrunk(tmp_path, ram):
    from kvtier.core.fit import fit_to_machine
    with pytest.raises(ConfigError) as e:
        fit_to_machine(_cfg(tmp_path, cpu="9.5GiB", nvme=None))
    assert str(e.value) == ("s.yaml: tiers.0.capacity: tier 'cpu': asks 9.50 GiB of DRAM (9728 blocks), only "
                            "9.00 GiB available to it (10.00 GiB available - 1.00 GiB kept free); lower it or give "
                            "a share such as '50%'")
    with pytest.raises(ConfigError, match=r"only 6.00 GiB available to it \(10.00 GiB available - 3.00 GiB "
                                          r"reserved - 1.00 GiB kept free\)"):
        fit_to_machine(_cfg(tmp_path, cpu="7GiB", nvme=None), reserved_memory=3 * GiB)
    cfg, warnings = fit_to_machine(_cfg(tmp_path, cpu="9.5GiB", nvme=None), shrink=True)
    assert cfg.tiers[0].blocks(cfg.block_bytes) == 9 * 1024 and len(warnings) == 1
    assert "tier 'cpu' shrunk from 9.50 GiB to 9.00 GiB of DRAM" in warnings[0]
    cfg, warnings = fit_to_machine(_cfg(tmp_path, cpu="9GiB", nvme=None))      # exactly fits: unchanged
    assert cfg.tiers[0].capacity == 9 * GiB and warnings == []
    fit_to_machine(_cfg(tmp_path, cpu="99GiB", nvme=None), check=False)        # only resolves


def test_two_cpu_tiers_are_checked_together(tmp_path, ram):
    from kvtier.core.fit import fit_to_machine
    cfg = parse_config({"block_bytes": "1MiB", "tiers": [{"name": "a", "kind": "cpu", "capacity": "6GiB"},
                                                         {"name": "b", "kind": "cpu", "capacity": "6GiB"}]},
                       source="s.yaml", check_env=False)
    with pytest.raises(ConfigError, match="tiers.1.capacity: tier 'b': with the other cpu tiers asks 12.00 GiB"):
        fit_to_machine(cfg)
    cfg, warnings = fit_to_machine(cfg, shrink=True)
    assert [t.blocks(cfg.block_bytes) for t in cfg.tiers] == [4608, 4608] and len(warnings) == 2


def test_share_of_a_redis_tier_is_refused():
    with pytest.raises(ConfigError, match="a share .* is for cpu and nvme tiers"):
        parse_config({"tiers": [{"name": "c", "kind": "cpu", "capacity": "1GiB"},
                                {"name": "r", "kind": "redis", "capacity": "10%"}]}, check_env=False)
    for bad in ("0%", "101%", "-5%", "x%"):
        with pytest.raises(ConfigError, match="tiers.0.capacity"):
            parse_config({"tiers": [{"name": "c", "kind": "cpu", "capacity": bad}]}, check_env=False)


def test_available_memory_is_memavailable_not_physical():
    from kvtier.core.fit import available_memory, memory_headroom
    with open("/proc/meminfo") as f:
        mi = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f}
    phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    a = available_memory()
    assert 0 < a < phys and a <= mi["MemAvailable"] + (256 << 20)   # a memory cgroup can only lower it
    assert memory_headroom() == max(phys // 10, 2 << 30)


def test_a_dram_tier_just_below_physical_memory_is_refused_before_allocation(tmp_path):
    """Between available and physical memory (was OOM-killed: the check compared with physical
    memory): refused at once, naming the tier and both sizes."""
    from kvtier.core.fit import fit_to_machine
    below_physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") - (128 << 20)
    cfg = _cfg(tmp_path, cpu=below_physical, nvme=None, bb="64KiB")
    with pytest.raises(ConfigError, match=r"tiers.0.capacity: tier 'cpu': asks .* of DRAM .* only .* available "
                                          r"to it \(.* available - .* kept free\)"):
        fit_to_machine(cfg)


def test_nvme_share_and_check_on_a_small_file_system(tmp_path):
    from fs_util import small_fs
    from kvtier.core.fit import DISK_HEADROOM, DISK_HEADROOM_PER_BLOCK, fit_to_machine
    from kvtier.tiers.nvme_block import slot_stride
    stride = slot_stride(65536)
    with small_fs("32M") as fs:
        free = fs.free_bytes()
        with pytest.raises(ConfigError, match=r"tiers.1.capacity: tier 'nvme': 50% of the .* free at .*, less "
                                              r"2.00 GiB kept free \(max\(10%, 2 GiB\) of the disk\), holds no slot"):
            fit_to_machine(_cfg(tmp_path, cpu="1MiB", nvme="50%", bb="64KiB", path=f"{fs.path}/nv"))
        with pytest.raises(ConfigError) as e:
            fit_to_machine(_cfg(tmp_path, cpu="1MiB", nvme="64MiB", bb="64KiB", path=f"{fs.path}/nv"))
        assert f"tiers.1.capacity: tier 'nvme': asks " in str(e.value) and f"available at {fs.path}" in str(e.value)
        cfg, warnings = fit_to_machine(_cfg(tmp_path, cpu="1MiB", nvme="64MiB", bb="64KiB", path=f"{fs.path}/nv"),
                                       shrink=True)
        got = cfg.tiers[1].blocks(65536)
        assert got == (free - DISK_HEADROOM) // (stride + DISK_HEADROOM_PER_BLOCK) and len(warnings) == 1
        # its own data file counts as usable, and a share never resolves below what it holds
        from kvtier.core.stack import TierStack
        TierStack.from_config(cfg).close()
        cfg2, _ = fit_to_machine(_cfg(tmp_path, cpu="1MiB", nvme="10%", bb="64KiB", path=f"{fs.path}/nv"))
        assert cfg2.tiers[1].blocks(65536) == got
        fit_to_machine(cfg)   # the same capacity fits again, though the disk is now nearly full


def test_read_only_file_system_is_erofs_not_eacces(tmp_path):
    from fs_util import small_fs
    from kvtier.core.fit import check_environment
    with small_fs("16M") as fs:
        fs.remount(read_only=True)
        try:
            with pytest.raises(ConfigError, match=rf"tiers.1.path: {fs.path} is on a read-only file system \[EROFS\]"):
                check_environment(_cfg(tmp_path, path=f"{fs.path}/nv"))
        finally:
            fs.remount(read_only=False)


def test_what_kvtier_sizes_leaves_max_10_percent_or_2_gib_free(tmp_path, monkeypatch):
    """The headroom rule on fake machines (meminfo / statvfs figures): a share resolves to what
    is free beyond max(10%, 2 GiB) of the memory or the disk; a DRAM size must leave it too."""
    import kvtier.core.fit as c
    from kvtier.core.fit import fit_to_machine, headroom
    from kvtier.tiers.nvme_block import slot_stride
    assert headroom(8 * GiB) == 2 * GiB and headroom(20 * GiB) == 2 * GiB and headroom(100 * GiB) == 10 * GiB
    monkeypatch.setattr(c, "physical_memory", lambda: 24 * GiB)
    monkeypatch.setattr(c, "available_memory", lambda: 20 * GiB)
    keep = int(2.4 * GiB)
    cfg, _ = fit_to_machine(_cfg(tmp_path, cpu="50%", nvme=None))
    assert cfg.tiers[0].blocks(1 << 20) == (20 * GiB - keep) // 2 >> 20
    cfg, _ = fit_to_machine(_cfg(tmp_path, cpu="100%", nvme=None))
    assert 20 * GiB - cfg.tiers[0].blocks(1 << 20) * (1 << 20) >= keep
    with pytest.raises(ConfigError, match=r"tiers.0.capacity: tier 'cpu': asks 19.00 GiB of DRAM .* only 17.60 GiB "
                                          r"available to it \(20.00 GiB available - 2.40 GiB kept free\)"):
        fit_to_machine(_cfg(tmp_path, cpu="19GiB", nvme=None))
    stride = slot_stride(1 << 20)
    for free, total in ((100 * GiB, 200 * GiB), (3 * GiB, 4 * GiB), (50 * GiB, 60 * GiB)):
        monkeypatch.setattr(c, "disk_space", lambda p, f=free, t=total: (f, t))
        for share in ("50%", "100%"):
            cfg, _ = fit_to_machine(_cfg(tmp_path, cpu="1MiB", nvme=share))
            n = cfg.tiers[1].blocks(1 << 20)
            assert free - n * stride >= max(total // 10, 2 * GiB), (free, total, share, n)
        assert n == (free - (4 << 20) - max(total // 10, 2 * GiB)) // (stride + 512)
    with pytest.raises(ConfigError, match=r"tiers.1.capacity: tier 'nvme': asks .* of disk .* only 50.00 GiB"):
        fit_to_machine(_cfg(tmp_path, cpu="1MiB", nvme="60GiB"))


def test_the_shared_tier_is_kind_shared_and_redis_is_read_as_its_older_name():
    """One name for the shared tier (issue 34): `kind: shared`; `kind: redis` still loads, as shared."""
    new = parse_config({"tiers": [{"name": "c", "kind": "cpu", "capacity": "1GiB"},
                                  {"name": "s", "kind": "shared", "url": "redis://h:6379/0"}]}, check_env=False)
    old = parse_config({"tiers": [{"name": "c", "kind": "cpu", "capacity": "1GiB"},
                                  {"name": "s", "kind": "redis", "url": "redis://h:6379/0"}]}, check_env=False)
    assert [t.kind for t in new.tiers] == [t.kind for t in old.tiers] == ["cpu", "shared"]
    assert new.model_dump(exclude={"source"}) == old.model_dump(exclude={"source"})
    with pytest.raises(ConfigError, match="kind"):
        parse_config({"tiers": [{"name": "c", "kind": "cpu", "capacity": "1GiB"},
                                {"name": "s", "kind": "remote", "url": "redis://h:6379/0"}]}, check_env=False)
