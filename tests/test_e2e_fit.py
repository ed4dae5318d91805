"""Under vLLM a tier that does not fit the machine is refused at start, as the CLI refuses it, and
what kvtier sizes itself (a share) leaves max(10%, 2 GiB) of the disk and the memory free
(real vLLM, CPU build; the NVMe tier on a loop-mounted ext4 file system)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import fs_util  # noqa: E402
import vllm_util as U  # noqa: E402

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not U.vllm_available(), reason="vLLM not installed")]

GiB = 1 << 30


def _refused(model_dir, **extra) -> str:
    """Start vLLM with kvtier; it must fail. Returns the text of the error and its causes."""
    import kvtier.connector as C
    with pytest.raises(Exception) as e:
        U.make_llm(model_dir, U.kvtier_config(**extra))
    for c in C.live_connectors():
        c.shutdown()
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown
    ensure_kv_transfer_shutdown()          # a failed start leaves vLLM's worker connector in place
    texts, x = [], e.value
    while x is not None:
        texts.append(str(x))
        x = x.__cause__ or x.__context__
    return "\n".join(texts)


def test_a_dram_tier_larger_than_the_host_is_refused(model_dir, tmp_path):
    from kvtier.core.fit import available_memory
    before = available_memory()
    text = _refused(model_dir, cpu_capacity="1TiB", data_dir=str(tmp_path / "data"))
    assert "tiers.cpu.capacity (cpu_capacity): 1024.0 GiB of DRAM asked, only " in text, text
    assert "kept free); refused: lower it or give a share such as '50%'" in text, text
    assert available_memory() > before - 2 * GiB          # nothing near the host's memory was taken


def test_an_nvme_tier_larger_than_its_disk_is_refused(model_dir, tmp_path):
    with fs_util.small_fs("64M") as fs:
        text = _refused(model_dir, nvme_path=f"{fs.path}/nv", nvme_capacity="1GiB", data_dir=str(tmp_path / "data"))
        assert "tiers.1.capacity: tier 'nvme': asks 1.14 GiB of disk (32768 slots of 36.00 KiB + index), only " in text, text
        assert f"available at {fs.path}" in text and "lower it or give a share such as '50%'" in text, text
        assert not os.path.exists(f"{fs.path}/nv/data.0")   # nothing allocated on the disk


def test_shares_fit_and_leave_the_headroom_free(model_dir, tmp_path):
    """nvme '80%' of a 3 GiB file system and cpu '2%' of the memory: both start, the sizes in force
    are the ones the start lines report, and the disk keeps 2 GiB free (was: 80% of all of it)."""
    import kvtier.connector as C
    with fs_util.small_fs("3G") as fs:
        llm = U.make_llm(model_dir, U.kvtier_config(nvme_path=f"{fs.path}/nv", nvme_capacity="80%",
                                                    cpu_capacity="2%", data_dir=str(tmp_path / "data")))
        try:
            ps = U.prompts(2, 3, seed=5)
            U.generate(llm, ps)
            s = C.live_connectors("scheduler")[0]
            w = next(c for c in C.live_connectors("worker") if c.worker is not None and c.worker.pools)
            nv = s.sched.tiers[s.sched.nvme]
            assert nv.ready and nv.capacity_blocks > 0
            assert os.path.getsize(f"{fs.path}/nv/data.0") == nv.capacity_blocks * nv.stride   # preallocated
            assert fs.free_bytes() >= 2 * GiB, fs.free_bytes()
            assert s.sched.tiers[0].capacity_blocks == w.worker.pools[0].num_slots
            assert "nvme" in s.sched.tiers[s.sched.nvme].summary()
        finally:
            U.shutdown(llm)
