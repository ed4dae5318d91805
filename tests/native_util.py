"""A vLLM "deployment" of native offloading without a GPU: a real `TieringOffloadingSpec` from an
`OffloadingConfig` (what vLLM builds from its engine config), its real `TieringOffloadingManager`
(the scheduler side, with the secondary tiers loaded by `module_path`), and the worker's view of
the CPU primary tier's shared memory (`SharedOffloadRegion` of rank 0), which the test fills the way
vLLM's CPUOffloadingWorker does after a GPU -> CPU copy, and reads after a CPU load.

The calls follow vLLM's OffloadingConnector scheduler: prepare_store, (worker copies), complete_store,
on_request_finished, on_schedule_end each step; lookups as `_maximal_prefix_lookup` makes them, then
prepare_load, (worker copies), complete_load.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid

import torch
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                       OffloadingModelConfig, OffloadingParallelConfig)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

BLOCK_BYTES = 8192        # one worker's KV bytes per GPU block
BLOCKS_PER_CHUNK = 2      # -> 16 KiB chunks
STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def model_dir(root, seed: int) -> str:
    """A model directory whose weights differ by `seed` (kvtier names the model by their digest)."""
    d = os.path.join(str(root), f"model-{seed}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write('{"model_type": "llama"}')
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(hashlib.sha256(str(seed).encode()).digest() * 64)
    return d


def nvme(path, **kw) -> dict:
    return {"type": "KvtierNvmeTier", "module_path": "kvtier.vllm", "path": str(path), "capacity_blocks": 64, **kw}


def shared(url, **kw) -> dict:
    return {"type": "KvtierSharedTier", "module_path": "kvtier.vllm", "url": url, "timeout_s": 0.5,
            "connect_timeout_s": 0.5, **kw}


def offload_key(i: int, salt: bytes = b"") -> bytes:
    return make_offload_key(hashlib.sha256(salt + i.to_bytes(8, "little")).digest(), 0)


def payload(i: int, nbytes: int, salt: bytes = b"") -> bytes:
    g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(salt + bytes([i % 256, i // 256])).digest()[:6],
                                                     "little"))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).numpy().tobytes()


class Deployment:
    """One vLLM instance's scheduler-side offloading (see the module docstring)."""

    def __init__(self, model: str, secondary_tiers: list[dict], cpu_chunks: int = 4, block_bytes: int = BLOCK_BYTES,
                 engine_id: str | None = None, tp: int = 1, canonical: bool = False, **extra) -> None:
        """`tp`: tensor-parallel workers, each holding `block_bytes / tp` of every block (a chunk is
        the same bytes in all); `canonical`: vLLM's canonical_layout, certified parallel-agnostic."""
        self.cfg = OffloadingConfig(
            groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
            worker_kv_bytes_per_block=block_bytes // tp, enable_kv_cache_events=False,
            canonical_layout=canonical, kv_cache_layout="LBNHC" if canonical else None,
            extra_config={"cpu_bytes_to_use": cpu_chunks * block_bytes * BLOCKS_PER_CHUNK,
                          "secondary_tiers": [dict(t) for t in secondary_tiers], **extra},
            engine_id=engine_id or "kvtier-test-" + uuid.uuid4().hex[:12],
            model=OffloadingModelConfig(name=model, dtype="float16"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=BLOCKS_PER_CHUNK),
            parallel=OffloadingParallelConfig(rank=0, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
                                              data_parallel_index=0, data_parallel_size=1,
                                              data_parallel_rank_local=None, is_parallelism_agnostic=canonical))
        self.spec = TieringOffloadingSpec(self.cfg)
        self.manager = self.spec.get_manager()
        self.chunk_bytes = self.spec.kv_bytes_per_chunk
        self.region = SharedOffloadRegion(self.cfg.engine_id, self.spec.num_chunks, 0, self.chunk_bytes,
                                          self.spec.cpu_page_size_per_worker)
        self.rows = self.region.base_tensor.view(self.spec.num_chunks, self.chunk_bytes).view(torch.uint8)
        self._n = 0

    @property
    def tiers(self):
        return self.manager.secondary_tiers

    def _ctx(self, what: str) -> ReqContext:
        self._n += 1
        ctx = ReqContext(req_id=f"{what}-{self._n}")
        self.manager.on_new_request(ctx)
        return ctx

    def step(self) -> None:
        self.manager.on_schedule_end(STEP)

    def settle(self, timeout_s: float = 60.0) -> None:
        """Step until no tier has work in flight."""
        end = time.monotonic() + timeout_s
        self.step()
        while self.manager.has_pending_work():
            assert time.monotonic() < end, "secondary tiers still busy"
            time.sleep(0.002)
            self.step()

    def store(self, keys: list[bytes], datas: list[bytes]) -> list[bytes]:
        """GPU -> CPU primary (the worker's copy), cascaded to every secondary tier; returns the
        keys the primary evicted to make room."""
        ctx = self._ctx("store")
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None, "primary tier full of pinned chunks"
        by_key = dict(zip(keys, datas))
        for k, c in zip(out.keys_to_store, out.store_spec.chunk_ids):
            self.rows[int(c)].copy_(torch.frombuffer(bytearray(by_key[k]), dtype=torch.uint8))
        self.manager.complete_store(out.keys_to_store, ctx)
        self.manager.on_request_finished(ctx)
        self.settle()
        return list(out.evicted_keys)

    def lookup(self, keys: list[bytes], timeout_s: float = 60.0) -> tuple[int, ReqContext]:
        """Chunks of the prefix of `keys` ready in the primary tier, as vLLM's scheduler finds them
        (`_maximal_prefix_lookup`): each step every key in order until the first MISS, scanning
        past HIT_PENDING / RETRY; a step with any of those is asked again after on_schedule_end."""
        ctx = self._ctx("load")
        end = time.monotonic() + timeout_s
        while True:
            hits, defer = 0, False
            for k in keys:
                r = self.manager.lookup(k, ctx)
                if r is LookupResult.MISS:
                    break
                if r is LookupResult.RETRY:
                    defer = True
                    continue
                defer = defer or r is LookupResult.HIT_PENDING
                hits += 1
            if not defer:
                return hits, ctx
            assert time.monotonic() < end, f"lookup still deferred after {timeout_s}s"
            self.step()
            time.sleep(0.002)

    def load(self, keys: list[bytes]) -> list[bytes]:
        """The bytes of the prefix of `keys` the offloading stack holds (CPU -> GPU: the worker's read)."""
        n, ctx = self.lookup(keys)
        got = []
        if n:
            spec = self.manager.prepare_load(keys[:n], ctx)
            got = [self.rows[int(c)].numpy().tobytes() for c in spec.chunk_ids]
            self.manager.complete_load(keys[:n], ctx)
        self.manager.on_request_finished(ctx)
        self.settle()
        return got

    def close(self) -> None:
        try:
            self.manager.shutdown()
        finally:
            self.rows = None
            self.region.cleanup()
