"""The shared tier's data plane: blocks in and out of a Redis / Valkey server, pipelined.

A value is the block's keyed header (`nvme_block.BlockCodec`, sealed with the fleet's secret,
naming key, fingerprint namespace, rank, length and payload hash) then the payload. A value that
is absent (the server evicted it), truncated, foreign, corrupt or of another Redis type (a list,
a hash, ...: its GET answers WRONGTYPE, the rest of the batch is served) is a miss for that block,
counted, never bytes handed on; a bad one is deleted on the server if it still holds that very
value (`drop_bad`: a script compares its SHA-1, or for another type checks it is still not a
string, so a good value written since stays) and is
reported `bad` (the controller remembers it: the next lookup misses). Transfers run on a small thread pool, each thread one pipeline
of at most `batch_bytes` of values per round trip; the caller polls or waits on the handle.
Puts copy no payload: the header is sealed on its own and the client's `ZeroCopyPacker` sends
it, then a view of the tensor (`shared_conn.Parts`). Gets read the replies off the socket
themselves (`_get_direct`; on a cluster per slot owner, a redirection falls back to redis-py's
pipeline): each payload lands in a per-thread scratch block, is verified, then copied once.
A server that fails or times out trips the breaker (`shared_conn.Breaker`): misses, one
warning, a counter, retries with backoff.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import torch

from .io_engine import DoneHandle, FutureHandle, IOHandle, IOResult
from .contract import Medium
from .resp_reader import Redirected, RespReader
from .shared_conn import Breaker, Namespace, Parts, RedisSettings, connect, error_text
from .sealing import FAILED, NOT_OURS, RECORD_BYTES, TAG_BYTES
from kvtier.common.counters import Metric

log = logging.getLogger("kvtier.shared")

EXISTS_BATCH = 2048   # keys per pipelined EXISTS round trip
NOT_A_STRING = "not-a-string"   # `drop_bad`'s digest of a value of another Redis type (a list, a hash, ...)
WRONG_TYPE = "wrong type: a value of another Redis type (list, hash, set, ...), not a string"
# delete a key only while it holds the bad value read: the string whose SHA-1 is ARGV[1], or, for
# NOT_A_STRING, any value but a string (a block written since is a string: it stays)
DROP_IF_SAME = ("local t = redis.call('TYPE', KEYS[1])['ok'] "
                "if ARGV[1] == '" + NOT_A_STRING + "' then "
                "if t ~= 'string' and t ~= 'none' then return redis.call('DEL', KEYS[1]) end return 0 end "
                "if t ~= 'string' then return 0 end "
                "local v = redis.call('GET', KEYS[1]) "
                "if v and redis.sha1hex(v) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0")


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes, without a copy."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def _copy_out(dst: torch.Tensor, v: bytes, off: int, n: int) -> None:
    """`v[off:off + n]` into the CPU tensor `dst`: one memmove through ctypes, which lets go of
    the GIL meanwhile (so the pool's other pipelines read their sockets as it copies)."""
    if type(v) is bytes and dst.is_contiguous():
        ctypes.memmove(dst.data_ptr(), ctypes.cast(ctypes.c_char_p(v), ctypes.c_void_p).value + off, n)
    else:
        _bytes_of(dst)[:] = memoryview(v)[off:off + n]


def _unsealed(codec, v: bytes, h: int, k: bytes) -> tuple[str | None, bytes | bytearray, int]:
    """(why not, buffer, offset) of a verified value's plaintext payload: decrypted when sealed."""
    if codec.sealer is None:
        return codec.unseal(memoryview(v)[:h], k, None), v, h
    buf = bytearray(len(v) - h + TAG_BYTES)
    buf[:len(v) - h] = memoryview(v)[h:]
    return codec.unseal(memoryview(v)[:h], k, memoryview(buf)), buf, 0


def _wrong_size(codec, k: bytes, n: int, bb: int) -> str:
    """Why a value of `n` bytes is not a block of this tier: a value of the other format (sealed
    or not: another reader's, left on the server) or a truncated or overlong one."""
    h = codec.header_size(k)
    if n == h + bb + (-RECORD_BYTES if codec.sealer is not None else RECORD_BYTES):
        return (f"{NOT_OURS}: a plaintext value, this tier is encrypted" if codec.sealer is not None
                else f"{NOT_OURS}: an encrypted value, this tier has no encryption key")
    return "truncated value" if n < h + bb else "value too long"


def _wrong_type(reply) -> bool:
    """A pipeline's reply for a key holding another Redis type: that value is bad, the server fine."""
    from redis.exceptions import ResponseError
    return isinstance(reply, ResponseError) and str(reply).startswith("WRONGTYPE")


def _cause(why: str) -> str:
    """A verification failure without its numbers and hashes: what makes two failures the same."""
    return re.sub(r"[0-9a-f]{8,}|\d+", "#", why)


class SharedData:
    """Blocks of `block_bytes` under the keys of `ns` (one fingerprint, one rank) on one server."""

    medium = Medium.SHARED

    def __init__(self, settings: RedisSettings, ns: Namespace, block_bytes: int, threads: int = 4,
                 count: Callable[[str, float], None] | None = None, name: str = "shared") -> None:
        self.s = settings
        self.ns = ns
        self.name = name
        self.block_bytes = block_bytes
        self.counters: dict[str, float] = {}
        self._lock = threading.Lock()
        self._ext_count = count
        self.breaker = Breaker(settings.where, self.count)
        self.client = connect(settings)
        # replies read straight off the socket (`_get_direct`; a cluster: per node); False:
        # redis-py's pipeline and hiredis (bytes per value, then copied out)
        self.direct_reads = True
        self._scratch = threading.local()   # per pool thread: one block to receive and verify in
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix=f"kvtier-{name}")
        self._warned: set[str] = set()
        self._inflight: set = set()

    def count(self, m: Metric, v: float = 1) -> None:
        """Add to `counters[<key>]`, and to the bound counter as `<key>.<tier name>`."""
        with self._lock:
            self.counters[m.key] = self.counters.get(m.key, 0) + v
        if self._ext_count is not None:
            self._ext_count(m.at(self.name), v)

    def bind_counter(self, count: Callable[[str, float], None]) -> None:
        self._ext_count = count

    def _warn_once(self, what: str, msg: str, *args) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg, *args)

    def _batches(self, n: int, per_item: int) -> list[tuple[int, int]]:
        step = max(1, self.s.batch_bytes // max(1, per_item))
        return [(lo, min(n, lo + step)) for lo in range(0, n, step)]

    # ---- membership ----------------------------------------------------------------------
    def exists(self, keys: Sequence[bytes], ranks: int = 1) -> list[bool] | None:
        """Per key, whether every rank's value is on the server; None when it is unreachable."""
        if not keys:
            return []
        if not self.breaker.allow():
            return None
        names = [self.ns.name(k, r) for k in keys for r in range(ranks)]
        found: list[int] = []
        try:
            for lo in range(0, len(names), EXISTS_BATCH):
                hi = lo + EXISTS_BATCH
                pipe = self.client.pipeline(transaction=False)
                for n in names[lo:hi]:
                    pipe.exists(n)
                found.extend(int(x) for x in pipe.execute())
        except Exception as e:  # ConnectionError, TimeoutError, cluster errors
            self.breaker.fail(e)
            return None
        self.breaker.ok()
        return [all(found[i * ranks:(i + 1) * ranks]) for i in range(len(keys))]

    # ---- blocks --------------------------------------------------------------------------
    def read(self, slots: Sequence[int], dsts: Sequence[torch.Tensor], keys: Sequence[bytes] | None = None,
             expect: Sequence | None = None) -> IOHandle:
        """Read and verify the blocks named by `keys` into `dsts` (CPU tensors of block_bytes);
        ok[i] False: a miss; bad[i] True: it failed verification. `slots` are placeholders (the
        server names blocks by key) and there is no expected tag (the header is checked)."""
        return self._submit(self._get, keys, dsts, "get", Metric.SKIPPED_BLOCKS)

    def _submit(self, fn, keys: Sequence[bytes], bufs: Sequence[torch.Tensor], what: str,
                skipped: Metric) -> IOHandle:
        """`fn(keys, bufs)` on the pool in batches of `batch_bytes`; none while the breaker is open
        (all not ok, counted in `skipped`)."""
        if keys is None or len(keys) != len(bufs):
            raise ValueError(f"shared tier: {what} of {len(bufs)} blocks needs as many keys, got "
                             f"{'none' if keys is None else len(keys)}")
        if not keys:
            return DoneHandle(IOResult(ok=[]))
        if not self.breaker.allow():
            self.count(skipped, len(keys))
            return DoneHandle(IOResult(ok=[False] * len(keys), errors=[f"{self.s.where} unreachable"]))
        keys, bufs = list(keys), list(bufs)
        futs = [self._pool.submit(fn, keys[lo:hi], bufs[lo:hi]) for lo, hi in self._batches(len(keys), self.block_bytes)]
        for f in futs:
            self._inflight.add(f)
            f.add_done_callback(self._inflight.discard)
        return FutureHandle(futs)

    def drain(self) -> None:
        """Wait for every transfer in flight (their buffers may then be freed)."""
        for f in list(self._inflight):
            try:
                f.result()
            except Exception:  # reported through its handle
                pass

    def _get(self, keys: list[bytes], dsts: list[torch.Tensor]) -> IOResult:
        if self.direct_reads and all(d.is_contiguous() for d in dsts):
            if not self.s.cluster:
                r = self._get_direct(keys, dsts, self.client.connection_pool)
                if r is not None:
                    return r
            else:
                return self._get_cluster(keys, dsts)
        return self._get_pipeline(keys, dsts)

    def _get_cluster(self, keys: list[bytes], dsts: list[torch.Tensor]) -> IOResult:
        """Direct reads per node (each key's slot owner, as the client's slot table says); a
        node that answers MOVED / ASK (slots moving) is read through redis-py's pipeline, which
        follows the redirection and refreshes the table."""
        c = self.client
        groups: dict[str, tuple[object, list[int]]] = {}
        try:
            for i, k in enumerate(keys):
                node = c.nodes_manager.get_node_from_slot(c.keyslot(self.ns.name(k)))
                groups.setdefault(node.name, (node, []))[1].append(i)
        except Exception:  # no slot table yet (never connected): redis-py's own path
            return self._get_pipeline(keys, dsts)
        ok, bad = [False] * len(keys), [False] * len(keys)
        nbytes, errors = 0, []
        for node, idx in groups.values():
            ks, ds = [keys[i] for i in idx], [dsts[i] for i in idx]
            rc = getattr(node, "redis_connection", None)
            r = self._get_direct(ks, ds, rc.connection_pool) if rc is not None else None
            if r is None:
                r = self._get_pipeline(ks, ds)
            for j, i in enumerate(idx):
                ok[i] = r.ok[j]
                bad[i] = bool(r.bad) and r.bad[j]
            nbytes += r.nbytes
            errors += r.errors
        return IOResult(ok=ok, nbytes=nbytes, errors=errors, bad=bad if any(bad) else [])

    def _get_pipeline(self, keys: list[bytes], dsts: list[torch.Tensor]) -> IOResult:
        try:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.get(self.ns.name(k))
            vals = pipe.execute(raise_on_error=False)
            failed = next((v for v in vals if isinstance(v, Exception) and not _wrong_type(v)), None)
            if failed is not None:
                raise failed
        except Exception as e:
            self.breaker.fail(e)
            return IOResult(ok=[False] * len(keys), errors=[f"{self.s.where}: {type(e).__name__}"])
        self.breaker.ok()
        ok: list[bool] = []
        errors: list[str] = []
        dropped: list[tuple[bytes, str, str]] = []
        nbytes = missing = 0
        codec, bb = self.ns.codec, self.block_bytes
        for k, v, dst in zip(keys, vals, dsts):
            if v is None:
                missing += 1
                ok.append(False)
                continue
            if isinstance(v, Exception):  # WRONGTYPE: a list, a hash, ... under the block's key
                ok.append(False)
                dropped.append((k, NOT_A_STRING, WRONG_TYPE))
                continue
            h = codec.header_size(k)
            why = (_wrong_size(codec, k, len(v), bb) if len(v) != h + bb else
                   codec.verify(memoryview(v)[:h], k, memoryview(v)[h:]))
            if why is None:  # the payload as plaintext (decrypted when sealed), or why not
                why, plain, at = _unsealed(codec, v, h, k)
            if why is not None:
                ok.append(False)
                dropped.append((k, hashlib.sha1(v).hexdigest(), why))
                continue
            _copy_out(dst, plain, at, bb)
            nbytes += bb
            ok.append(True)
        return self._tally(keys, ok, dropped, nbytes, missing)

    def _get_direct(self, keys: list[bytes], dsts: list[torch.Tensor], pool) -> IOResult | None:
        """`_get` reading each reply straight off the socket: a value's header into a small
        buffer, its payload `recv_into` this thread's scratch block, verified there, then one
        GIL-free memmove into the destination (no hiredis reader buffer, no bytes object per
        value). A block that fails is a miss and its destination is left untouched. None: a
        cluster node redirected (MOVED / ASK): nothing counted, the caller reads another way."""
        codec, bb = self.ns.codec, self.block_bytes
        sealed = codec.sealer is not None  # the scratch holds the ciphertext and room for its tag
        scratch = getattr(self._scratch, "t", None)
        if scratch is None:
            scratch = self._scratch.t = torch.empty(bb + (TAG_BYTES if sealed else 0), dtype=torch.uint8)
            self._scratch.p = torch.empty(bb, dtype=torch.uint8) if sealed else scratch  # the plaintext
        scratch_mv, plain = _bytes_of(scratch), self._scratch.p
        ok: list[bool] = []
        dropped: list[tuple[bytes, str, str]] = []
        nbytes = missing = 0
        conn = None
        try:
            conn = pool.get_connection()
            conn.send_packed_command(conn.pack_commands([("GET", self.ns.name(k)) for k in keys]))
            rd = RespReader(conn._sock)
            for k, dst in zip(keys, dsts):
                line = rd.line()
                if line == b"_":  # RESP3's null
                    missing += 1
                    ok.append(False)
                    continue
                if line.startswith(b"-WRONGTYPE"):  # a list, a hash, ... under the block's key
                    ok.append(False)
                    dropped.append((k, NOT_A_STRING, WRONG_TYPE))
                    continue
                if line.startswith((b"-MOVED", b"-ASK")):
                    raise Redirected()
                if line[:1] == b"-":
                    raise ConnectionError(f"server error: {line[1:].decode(errors='replace')[:80]}")
                if line[:1] != b"$":
                    raise ConnectionError(f"unexpected reply {line[:16]!r}")
                n = int(line[1:])
                if n < 0:
                    missing += 1
                    ok.append(False)
                    continue
                h = codec.header_size(k)
                if n != h + bb:
                    digest = hashlib.sha1()
                    rd.skip(n, digest)
                    rd.skip(2)
                    ok.append(False)
                    dropped.append((k, digest.hexdigest(), _wrong_size(codec, k, n, bb)))
                    continue
                hdr = bytearray(h)
                rd.into(memoryview(hdr))
                rd.into(scratch_mv[:bb])
                rd.skip(2)
                why = (codec.verify(memoryview(hdr), k, scratch_mv[:bb])  # sealed: decrypted into `plain`
                       or codec.unseal(hdr, k, scratch_mv, _bytes_of(plain) if sealed else None))
                if why is not None:
                    ok.append(False)
                    digest = hashlib.sha1(hdr)
                    digest.update(scratch_mv[:bb])
                    dropped.append((k, digest.hexdigest(), why))
                    continue
                ctypes.memmove(dst.data_ptr(), plain.data_ptr(), bb)  # verified: into the block
                nbytes += bb
                ok.append(True)
        except Redirected:
            conn.disconnect()  # the rest of the replies are unread
            return None
        except Exception as e:
            if conn is not None:
                conn.disconnect()  # a reply half read: this connection's stream is lost
            self.breaker.fail(e)
            return IOResult(ok=[False] * len(keys), errors=[f"{self.s.where}: {type(e).__name__}"])
        finally:
            if conn is not None:
                pool.release(conn)
        self.breaker.ok()
        return self._tally(keys, ok, dropped, nbytes, missing)

    def _tally(self, keys: list[bytes], ok: list[bool], dropped: list[tuple[bytes, str, str]], nbytes: int,
               missing: int) -> IOResult:
        """The batch's result; bad values (key, SHA-1, why) counted, logged once per cause, deleted."""
        if missing:
            self.count(Metric.MISSING_BLOCKS, missing)
        errors = [f"{k.hex()[:16]}: {why}" for k, _, why in dropped]
        bad: list[bool] = []
        if dropped:
            ours = [(k, d) for k, d, why in dropped if not why.startswith(NOT_OURS)]
            self.count(Metric.CORRUPT_BLOCKS, len(dropped))
            sealed = sum(why.startswith(FAILED) for _, _, why in dropped)
            if sealed:  # of those, the ones that did not open (`sealing`)
                self.count(Metric.DECRYPT_FAILED_BLOCKS, sealed)
            wrong = sum(d == NOT_A_STRING for _, d, _ in dropped)
            if wrong:  # of those, values of another Redis type
                self.count(Metric.WRONG_TYPE_BLOCKS, wrong)
            for _, d, why in dropped:
                self._warn_once("bad:" + _cause(why), "kvtier: shared tier %s: a value failed verification (%s): "
                                "not served, %s, and a miss for later lookups (counted in %s; more of this cause "
                                "not logged)", self.s.where, why,
                                "left on the server (another reader may hold its key)" if why.startswith(NOT_OURS)
                                else "deleted on the server unless rewritten since",
                                "corrupt_blocks and decrypt_failed_blocks" if why.startswith(FAILED) else
                                "corrupt_blocks and wrong_type_blocks" if d == NOT_A_STRING else "corrupt_blocks")
            if ours:
                self.drop_bad(ours)
            names = {k for k, _, _ in dropped}
            bad = [k in names and not o for k, o in zip(keys, ok)]
        self.count(Metric.BYTES_READ, nbytes)
        return IOResult(ok=ok, nbytes=nbytes, errors=errors, bad=bad)

    def drop_bad(self, items: Sequence[tuple[bytes, str]]) -> int:
        """Delete each (key, SHA-1 of the bad value read) on the server if it still holds that very
        value (a good value written since stays). Counted: `bad_deleted_blocks`, `bad_rewritten_blocks`
        (changed since: left), `bad_delete_failed_blocks`. Returns how many were deleted."""
        deleted = failed = 0
        for k, digest in items:
            try:
                deleted += int(self.client.eval(DROP_IF_SAME, 1, self.ns.name(k), digest))
            except Exception as e:  # noqa: BLE001 - e.g. scripting refused by ACL: still a miss here
                failed += 1
                self._warn_once("drop:" + type(e).__name__, "kvtier: shared tier %s: could not delete a bad "
                                "value (%s: %s); it stays a miss here (counted in bad_delete_failed_blocks)",
                                self.s.where, type(e).__name__, error_text(e))
        if deleted:
            self.count(Metric.BAD_DELETED_BLOCKS, deleted)
        if len(items) - deleted - failed:
            self.count(Metric.BAD_REWRITTEN_BLOCKS, len(items) - deleted - failed)
        if failed:
            self.count(Metric.BAD_DELETE_FAILED_BLOCKS, failed)
        return deleted

    def write(self, slots: Sequence[int], srcs: Sequence[torch.Tensor],
              keys: Sequence[bytes] | None = None) -> IOHandle:
        """Seal and write the blocks under their `keys` (SET, pipelined; `slots`: placeholders);
        ok[i] False: not written (counted, logged once)."""
        return self._submit(self._put, keys, srcs, "put", Metric.PUT_SKIPPED_BLOCKS)

    def seal(self, key: bytes, src: torch.Tensor) -> bytearray:
        """The value stored for `key`, in one buffer: header then payload (one copy)."""
        hdr, payload = self.seal_parts(key, src)
        return bytearray(hdr) + payload

    def seal_parts(self, key: bytes, src: torch.Tensor, out: memoryview | None = None) -> Parts:
        """The value stored for `key` as (header, payload view): no copy of the payload. The
        tensor must stay unchanged until the write is done (as for every tier's `write`).
        Encrypted: the ciphertext goes to `out` (block_bytes + TAG_BYTES; default a new buffer),
        which must stay unchanged until the write is done."""
        payload = _bytes_of(src)
        if len(payload) != self.block_bytes:
            raise ValueError(f"shared tier: block of {len(payload)} bytes, block_bytes is {self.block_bytes}")
        codec = self.ns.codec
        hdr = bytearray(codec.header_size(key))
        if codec.sealer is not None:  # the ciphertext is what is sent
            if out is None:
                out = memoryview(bytearray(len(payload) + TAG_BYTES))
            codec.seal(memoryview(hdr), key, payload, out)
            payload = out[:len(payload)]
        else:
            codec.seal(memoryview(hdr), key, payload)
        return Parts((bytes(hdr), payload))

    def _sealed_out(self, n: int) -> memoryview:
        """This pool thread's buffer for `n` values' ciphertexts (each block_bytes + TAG_BYTES),
        made once and reused by its next batches: no new, zeroed memory per value."""
        need = n * (self.block_bytes + TAG_BYTES)
        buf = getattr(self._scratch, "put", None)
        if buf is None or buf.numel() < need:
            buf = self._scratch.put = torch.empty(need, dtype=torch.uint8)
        return _bytes_of(buf)

    def _put(self, keys: list[bytes], srcs: list[torch.Tensor]) -> IOResult:
        zero_copy = getattr(self.client, "kvtier_zero_copy", False)
        # encrypted and sent zero-copy: the ciphertexts in this thread's buffer, held until execute returns
        out = self._sealed_out(len(keys)) if zero_copy and self.ns.codec.sealer is not None else None
        per = self.block_bytes + TAG_BYTES
        try:
            pipe = self.client.pipeline(transaction=False)
            for i, (k, src) in enumerate(zip(keys, srcs)):
                pipe.set(self.ns.name(k), self.seal(k, src) if not zero_copy else
                         self.seal_parts(k, src, None if out is None else out[i * per:(i + 1) * per]))
            res = pipe.execute(raise_on_error=False)
        except Exception as e:
            self.breaker.fail(e)
            self.count(Metric.PUT_FAILED_BLOCKS, len(keys))
            return IOResult(ok=[False] * len(keys), errors=[f"{self.s.where}: {type(e).__name__}"])
        self.breaker.ok()
        ok = [r is True or r == b"OK" for r in res]
        errs = [f"{type(r).__name__}: {r}" for r in res if isinstance(r, Exception)]
        if errs:  # e.g. OOM with maxmemory and a noeviction policy
            self.count(Metric.PUT_FAILED_BLOCKS, len(errs))
            self._warn_once("put:" + errs[0][:40], "kvtier: shared tier %s refused writes: %s (counted in "
                            "put_failed_blocks; set maxmemory-policy allkeys-lru)", self.s.where, errs[0])
        n = sum(ok) * self.block_bytes
        self.count(Metric.BYTES_WRITTEN, n)
        return IOResult(ok=ok, nbytes=n, errors=errs)

    def sync(self) -> None:
        """Nothing to make durable (the server owns persistence)."""

    # ---- misc ----------------------------------------------------------------------------
    def ping(self) -> str | None:
        """None when the server answers, else why not (one line, no credentials)."""
        try:
            self.client.ping()
        except Exception as e:
            return f"{type(e).__name__}: {error_text(e)}"
        return None

    @property
    def description(self) -> str:
        return f"redis-py {'cluster ' if self.s.cluster else ''}at {self.s.where}"

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        try:
            self.client.close()
        except Exception:  # pragma: no cover - closing a dead connection
            pass
