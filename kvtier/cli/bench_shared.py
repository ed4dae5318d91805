"""`kvtier bench` for the shared tier (Redis / Valkey): ours next to the plain redis-py client.

ours: the tier's real paths, `SharedData.write` (seal: keyed header + payload hash, pipelined SET
through the zero-copy packer, `threads` pipelines of at most `batch_bytes`) and `SharedData.read`
(pipelined GET, verify header and payload hash, copy into a CPU tensor).
limit: redis-py as a user would call it, default connection (hiredis packer and parser):
pipelined SET of `bytes` values / GET of the same number of values of the same size (our header
+ payload), in pipelines of `batch_bytes`, best of one thread and `threads` threads.
Interleaved per repeat (limit SET, ours put, limit GET, ours get); ratio = the median of the
per-repeat ratios of times (limit / ours); GB/s counts payload bytes. Every key written is
deleted after the size's last repeat (`keys_left` says how many were not). `encrypted`: rows
'shared put/get encrypted', a data plane sealing with AES-256-GCM (`tiers/sealing.py`) timed
right after the plain one in every repeat, its ratio taken against the plain tier's.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import statistics
import time

import torch

LIMIT = "redis-py pipelined {op} (hiredis), same count and value size, best of 1 and {t} threads"


def _raw_pipelines(client, names: list[bytes], vals: list[bytes] | None, per: int, threads: int,
                   pool: cf.ThreadPoolExecutor) -> float:
    """Seconds for pipelined SET (vals) or GET (None) of `names`, `per` values per pipeline,
    spread over `threads` threads; checks every reply."""
    batches = [(lo, min(len(names), lo + per)) for lo in range(0, len(names), per)]

    def run(part: list[tuple[int, int]]) -> None:
        for lo, hi in part:
            p = client.pipeline(transaction=False)
            for i in range(lo, hi):
                if vals is None:
                    p.get(names[i])
                else:
                    p.set(names[i], vals[i])
            out = p.execute()
            if vals is None and any(v is None for v in out):
                raise RuntimeError("shared bench: raw GET found values missing (server evicted? lower --total)")

    t0 = time.perf_counter()
    if threads <= 1:
        run(batches)
    else:
        list(pool.map(run, [batches[i::threads] for i in range(threads)]))
    return time.perf_counter() - t0


def bench_shared(settings, block_bytes: int, total: int, repeat: int, threads: int = 4,
                 encrypted: bool = False) -> list[dict]:
    """Rows 'shared put' and 'shared get' (and their encrypted rows) for one block size (see the module doc)."""
    from kvtier.tiers.shared_conn import Namespace, connect
    from kvtier.tiers.shared_data import SharedData
    from kvtier.tiers.sealing import Sealer

    n = max(1, total // block_bytes)
    token = os.urandom(6).hex()
    ns = Namespace({"kvtier-bench": token, "block_bytes": block_bytes}, settings.secret)
    data = SharedData(settings, ns, block_bytes, threads=threads, name="bench")
    ens = Namespace({"kvtier-bench": token, "block_bytes": block_bytes, "sealed": True}, settings.secret, 0,
                    Sealer(os.urandom(32))) if encrypted else None
    sealed = SharedData(settings, ens, block_bytes, threads=threads, name="bench-sealed") if encrypted else None
    raw = connect(settings, plain=True)
    keys = [i.to_bytes(8, "big") + os.urandom(8) for i in range(n)]
    names = [ns.name(k) for k in keys] + ([ens.name(k) for k in keys] if encrypted else [])
    raw_names = [f"kvt:bench-raw:{token}:{i}".encode() for i in range(n)]
    g = torch.Generator().manual_seed(block_bytes)
    src = torch.randint(0, 256, (n, block_bytes), dtype=torch.uint8, generator=g)
    dst = torch.zeros_like(src)
    srcs, dsts = list(src.unbind(0)), list(dst.unbind(0))
    h = ns.codec.header_size(keys[0])
    vals = [bytes(h) + src[i].numpy().tobytes() for i in range(n)]  # our value's size, as bytes
    per = max(1, settings.batch_bytes // block_bytes)
    pool = cf.ThreadPoolExecutor(max(1, threads), thread_name_prefix="kvtier-bench-raw")
    why = data.ping()
    if why is not None:
        data.close()
        raise RuntimeError(f"shared bench: {settings.where} does not answer: {why}")

    def put(d=data) -> None:
        r = d.write((), srcs, keys).wait()
        if not r.all_ok:
            raise RuntimeError(f"shared bench: put failed: {r.errors[:2]}")

    def get(d=data) -> None:
        r = d.read((), dsts, keys).wait()
        if not r.all_ok:
            raise RuntimeError(f"shared bench: get missed or failed ({sum(not o for o in r.ok)} of {n}; "
                               f"server evicted? lower --total): {r.errors[:2]}")

    def raw_best(v) -> float:
        return min(_raw_pipelines(raw, raw_names, v, per, t, pool) for t in sorted({1, threads}))

    T: dict[str, list[float]] = {k: [] for k in ("raw_set", "put", "put_enc", "raw_get", "get", "get_enc")}
    try:
        raw_best(vals), put(), raw_best(None), get()  # warm-up: connections, server allocations
        if not torch.equal(src, dst):
            raise RuntimeError("shared bench: bytes read differ from the bytes written")
        if sealed is not None:
            dst.zero_()
            put(sealed), get(sealed)
            if not torch.equal(src, dst):
                raise RuntimeError("shared bench: bytes decrypted differ from the bytes written")
        for _ in range(repeat):
            T["raw_set"].append(raw_best(vals))  # each its own best: timed inside
            T["put"].append(_timed(put))
            if sealed is not None:
                T["put_enc"].append(_timed(lambda: put(sealed)))
            T["raw_get"].append(raw_best(None))
            T["get"].append(_timed(get))
            if sealed is not None:
                T["get_enc"].append(_timed(lambda: get(sealed)))
    finally:
        left = _delete(raw, names + raw_names)
        pool.shutdown()
        data.close()
        if sealed is not None:
            sealed.close()
        raw.close()
    med = statistics.median
    payload = n * block_bytes
    rows = []
    for what, ours, lim, op in (("shared put", "put", "raw_set", "SET"), ("shared get", "get", "raw_get", "GET")):
        rows.append({"what": what, "block_bytes": block_bytes, "blocks": n,
                     "ours_gbps": payload / med(T[ours]) / 1e9, "limit_gbps": payload / med(T[lim]) / 1e9,
                     "ratio": med(a / b for a, b in zip(T[lim], T[ours])),
                     "limit": LIMIT.format(op=op, t=threads), "keys_left": left,
                     "raw_s": {"ours": T[ours], "limit": T[lim]}})
        if encrypted:  # the encrypted data plane against the plain one
            enc = ours + "_enc"
            rows.append({"what": what + " encrypted", "block_bytes": block_bytes, "blocks": n,
                         "ours_gbps": payload / med(T[enc]) / 1e9, "limit_gbps": payload / med(T[ours]) / 1e9,
                         "ratio": med(a / b for a, b in zip(T[ours], T[enc])),
                         "limit": f"the plain tier's {op} path, same run (AES-256-GCM vs none)", "keys_left": left,
                         "raw_s": {"ours": T[enc], "limit": T[ours]}})
    return rows


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _delete(client, names: list[bytes], per: int = 512) -> int:
    """DEL every name (pipelined); returns how many still exist after."""
    try:
        for lo in range(0, len(names), per):
            p = client.pipeline(transaction=False)
            for nm in names[lo:lo + per]:
                p.delete(nm)
            p.execute()
        left = 0
        for lo in range(0, len(names), per):
            p = client.pipeline(transaction=False)
            for nm in names[lo:lo + per]:
                p.exists(nm)
            left += sum(int(x) for x in p.execute())
        return left
    except Exception:  # a server gone mid-bench: the keys are its to evict
        return len(names)


def shared_settings(args) -> object | None:
    """The shared tier to bench: `--redis URL` (standalone; `--redis-cluster` for a cluster), else
    the config's redis tier; None when neither (or `--skip-redis`)."""
    from kvtier.tiers.shared_conn import RedisSettings
    if getattr(args, "skip_redis", False):
        return None
    url = getattr(args, "redis", None)
    if url:
        return RedisSettings(url=url, cluster=bool(getattr(args, "redis_cluster", False)), timeout_s=30.0,
                             connect_timeout_s=5.0)
    from kvtier.core.config import load_config
    cfg = load_config(getattr(args, "config", None))
    rt = [t for t in cfg.tiers if t.kind == "shared"]
    if not rt:
        return None
    s = RedisSettings.of(rt[0])
    # a bench moves hundreds of MiB per pipeline set: the tier's per-command timeout (a slow
    # server is a miss, in service) would fail it on a busy machine
    from dataclasses import replace
    return replace(s, timeout_s=max(s.timeout_s, 30.0), connect_timeout_s=max(s.connect_timeout_s, 5.0))
