"""Recovery of an NVMe tier directory: what opening serves again from its index (`recover_index`,
`refuse_orphaned_blocks`, called by `NvmeControl`), and `kvtier fsck`, which checks the index against
the data files' block headers and rebuilds it from them (`fsck`).

At open every committed entry is served again, oldest generation first, and nothing is deleted:
an entry beyond the configured capacity refuses the open (`CapacityShrink`; with `allow_shrink`
it is evicted and reported), one of the wrong length or on a slot claimed twice is quarantined.
An empty index over data files that hold blocks refuses a writing open: `fsck --rebuild` can
still recover those blocks.

`fsck` reads every slot's header and payload and verifies them with the directory's secret (key,
tag, fingerprint, rank, payload hash); the index is compared with what the slots hold. `rebuild`
moves the old index aside (``index.damaged-<time>``, never deleted) and writes a new one with
every slot whose block verifies in every rank's file. Blocks that were evicted but whose slots
were not reused verify too and come back: they are genuine blocks of their keys.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from typing import NamedTuple

from .nvme_block import (HEADER_BYTES, SECRET_FILE, BlockCodec, NoSecret, load_secret, open_dir,
                         recorded_fingerprint, slot_stride)
from .nvme_dir import (INDEX_DIR, FingerprintMismatch, ForeignDirectory, data_file, dir_owner, exists_at,
                       fingerprint_diff, fingerprint_hash, lock_dir, make_fingerprint)
from .nvme_index import FORMAT_VERSION, NvmeIndex, NvmeIndexError

log = logging.getLogger("kvtier.nvme")


class CapacityShrink(ValueError):
    """The configured capacity is smaller than what the directory stores (nothing was dropped)."""


def slot_used(header: bytes) -> bool:
    """Whether a slot holds a block: an unused slot's header is zeros."""
    return header[:8] != bytes(8)


def data_ranks(dir_fd: int) -> int:
    """How many data files (``data.0``, ``data.1``, ...) the directory holds."""
    r = 0
    while exists_at(dir_fd, data_file(r)):
        r += 1
    return r


def layout_meta(fp: dict, stride: int, capacity: int) -> dict:
    """The index meta a new index records: format, fingerprint, slot stride, capacity."""
    return {"format_version": str(FORMAT_VERSION), "fingerprint": fp, "slot_stride": str(stride),
            "capacity": str(capacity)}


# ---- at open -------------------------------------------------------------------------------
class Recovered(NamedTuple):
    serve: list[tuple[int, bytes, int | tuple[int, ...]]]  # (slot, key, checksums), oldest generation first
    dropped: int   # entries quarantined or evicted (a read-only open drops none)
    beyond: int    # entries beyond the capacity, not served (read-only opens; writing opens evict or refuse)


def recover_index(index: NvmeIndex, *, name: str, path: str, block_bytes: int, capacity: int,
                  stored_capacity: int | None, read_only: bool, allow_shrink: bool) -> Recovered:
    """The committed entries to serve again. A writing open quarantines entries of the wrong
    length or on a slot claimed twice (the newer keeps it), and refuses entries beyond the
    capacity (`CapacityShrink`) unless `allow_shrink`, which evicts them; a read-only open
    changes nothing and counts them."""
    good, bad, beyond = [], [], []
    by_slot: dict[int, tuple[int, bytes]] = {}
    for key, e in index.items():
        if e.length != block_bytes:
            bad.append((key, f"length {e.length}, block_bytes {block_bytes}"))
            continue
        if e.slot >= capacity:
            beyond.append((e.generation, key))
            continue
        prev = by_slot.get(e.slot)
        if prev is not None:  # two keys on one slot: only the newer can hold its bytes
            if prev[0] > e.generation:
                bad.append((key, f"slot {e.slot} claimed by a newer entry"))
                continue
            bad.append((prev[1], f"slot {e.slot} claimed by a newer entry"))
        by_slot[e.slot] = (e.generation, key)
        good.append((e.generation, e.slot, key, e.sums))
    if beyond and not read_only and not allow_shrink:
        raise CapacityShrink(
            f"nvme tier {name!r}: {path} stores {len(beyond) + len(by_slot)} blocks, "
            f"{len(beyond)} of them in slots beyond the configured capacity of {capacity} blocks "
            f"(stored capacity {stored_capacity}); nothing was changed. Configure at least "
            f"{stored_capacity or '?'} blocks, or shrink explicitly (`kvtier fsck --shrink`)")
    keep = {k for _, k in by_slot.values()}
    serve = [(s, k, c) for _, s, k, c in sorted(g for g in good if g[2] in keep)]
    if read_only:
        return Recovered(serve, 0, len(beyond))
    if bad:
        log.warning("nvme tier %r: quarantining %d index entries (%s)", name, len(bad), bad[0][1])
        index.quarantine(bad)
    if beyond:
        dropped = [k for _, k in sorted(beyond)]
        log.warning("nvme tier %r: shrink to %d blocks: evicting %d blocks stored beyond it",
                    name, capacity, len(dropped))
        index.delete(dropped)
    return Recovered(serve, len(bad) + len(beyond), 0)


def refuse_orphaned_blocks(dir_fd: int, path: str, stride: int) -> None:
    """For a new index: data files that hold blocks mean the index was lost, and writing would
    reuse slots that `kvtier fsck --rebuild` can still recover, so the open is refused."""
    for r in range(data_ranks(dir_fd)):
        name = data_file(r)
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
        try:
            size = os.fstat(fd).st_size
            for off in range(0, size - HEADER_BYTES + 1, stride):
                if slot_used(os.pread(fd, 8, off)):
                    raise NvmeIndexError(
                        f"nvme tier at {path}: {name} holds blocks but {path}/{INDEX_DIR} has none (a removed or "
                        f"replaced index?): `kvtier fsck --rebuild` recovers them; remove {name} to start empty")
        finally:
            os.close(fd)


# ---- kvtier fsck ---------------------------------------------------------------------------
def fsck(path: str, block_bytes: int, fingerprint: dict, rebuild: bool = False,
         shrink_to: int | None = None) -> dict:
    """Check (and with `rebuild`, rebuild) the tier directory `path`; returns a report."""
    fp = make_fingerprint("nvme", block_bytes, fingerprint)
    fph = int(fingerprint_hash(fp), 16)
    dfd = open_dir(path)
    try:
        if rebuild and dir_owner(dfd) is None and not exists_at(dfd, SECRET_FILE) and not exists_at(dfd, INDEX_DIR):
            raise ForeignDirectory(errno.EEXIST, f"fsck: {path} is not a kvtier directory (no marker, secret or "
                                   f"index): refused, nothing in it changed", path)
        lock_dir(dfd, path, "fsck")
        config_differs: list[str] = []
        try:
            secret, held = load_secret(dfd, path, None, create=False)
        except NoSecret as e:
            stored = _read_index(path, NvmeIndex.fingerprint, None)
            if stored is not None and stored != fp:     # say which fields differ, as opening does
                raise FingerprintMismatch(path, fingerprint_diff(stored, fp)) from None
            if e.errno != errno.ENOENT:
                raise
            return _lost_secret(dfd, path, fp, fph, rebuild, shrink_to)
        if held != fph:
            rec = recorded_fingerprint(dfd, path)
            if rec is not None and int(fingerprint_hash(rec), 16) == held:
                # the writer's own fingerprint (e.g. the connector's: vLLM's model, parallelism)
                config_differs = sorted(fingerprint_diff(rec, fp))
                fp, fph, block_bytes = rec, held, int(rec["block_bytes"])
            else:
                stored = _read_index(path, NvmeIndex.fingerprint, None) or rec
                if stored is not None:
                    raise FingerprintMismatch(path, fingerprint_diff(stored, fp))
                raise NoSecret(errno.EINVAL, f"secret file {path}/secret belongs to fingerprint {held:016x}, "
                               f"this config's is {fph:016x}", path)
        ranks = data_ranks(dfd)
        if ranks == 0:
            raise FileNotFoundError(2, f"fsck: no data file in {path}", path)
        stride = slot_stride(block_bytes)
        found, problems = _scan(dfd, ranks, block_bytes, stride, secret, fph)
        index_state, disagree = _compare(path, found, problems)
        report = {"path": path, "ranks": ranks, "slots_scanned": found.pop("_slots"),
                  "blocks_verified": len(found), "index": index_state, "index_disagreements": disagree,
                  "damaged": None, "problems": problems,
                  "fingerprint": "the directory's record" if config_differs else "the config's",
                  "config_differs_in": config_differs}
        if index_state != "ok" or disagree:
            report["damaged"] = (f"index {index_state}" if index_state != "ok" else
                                 f"{disagree} index entries disagree with the data file") + \
                " (run `kvtier fsck --rebuild`)"
        if rebuild:
            report.update(_rebuild(path, found, fp, stride, shrink_to))
        return report
    finally:
        os.close(dfd)


def _lost_secret(dfd, path, fp, fph, rebuild, shrink_to) -> dict:
    """No secret: no block can be verified. The check reports it; `rebuild` keeps the old index
    aside, starts an empty one and a new secret (the data files stay; their slots are reused)."""
    n = _read_index(path, len, 0)
    report = {"path": path, "secret": "missing", "slots_scanned": 0, "blocks_verified": 0,
              "index_entries_unverifiable": n, "problems": [],
              "damaged": f"secret file missing: {n} indexed blocks cannot be verified "
                         f"(run `kvtier fsck --rebuild` to start the index empty; the old one is kept aside)"}
    if rebuild:
        report.update(_rebuild(path, {}, fp, slot_stride(fp["block_bytes"]), shrink_to))
        load_secret(dfd, path, fph, create=True)
        report["damaged"] = None
    return report


def _open_index(path: str) -> NvmeIndex:
    """The directory's index, read-only (NvmeIndexError when unusable)."""
    return NvmeIndex(os.path.join(path, INDEX_DIR), 1, read_only=True)


def _read_index(path: str, fn, default):
    """fn(the directory's index, opened read-only), or `default` when it is unreadable."""
    try:
        idx = _open_index(path)
    except NvmeIndexError:
        return default
    try:
        return fn(idx)
    except NvmeIndexError:
        return default
    finally:
        idx.close()


def _scan(dfd, ranks, bb, stride, secret, fph):
    """slot -> (key, tag or per-rank tags) for every slot that verifies in every rank's file."""
    codecs = [BlockCodec(secret, fph, r) for r in range(ranks)]
    fds = [os.open(data_file(r), os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd) for r in range(ranks)]
    found: dict = {}
    problems: list[str] = []
    try:
        slots = min(os.fstat(fd).st_size for fd in fds) // stride
        for s in range(slots):
            got = []
            for r, (fd, c) in enumerate(zip(fds, codecs)):
                buf = os.pread(fd, HEADER_BYTES + bb, s * stride)
                hdr, payload = memoryview(buf)[:HEADER_BYTES], memoryview(buf)[HEADER_BYTES:]
                parsed = c.parse(hdr)
                if isinstance(parsed, str):
                    if slot_used(buf):  # an unused slot is not a problem
                        problems.append(f"slot {s} rank {r}: {parsed}")
                    break
                key, _length, tag = parsed
                why = c.check(hdr, key, tag, payload)
                if why is not None:
                    problems.append(f"slot {s} rank {r}: {why}")
                    break
                got.append((key, tag))
            if len(got) == ranks and len({k for k, _ in got}) == 1:
                tags = [t for _, t in got]
                found[s] = (got[0][0], tags[0] if ranks == 1 else tuple(tags))
        found["_slots"] = slots
    finally:
        for fd in fds:
            os.close(fd)
    return found, problems


def _compare(path, found, problems) -> tuple[str, int]:
    try:
        idx = _open_index(path)
    except NvmeIndexError as e:
        return f"unusable: {e}", 0
    try:
        bad = 0
        for key, e in idx.items():
            f = found.get(e.slot)
            if f is None or f[0] != key or f[1] != e.sums:
                bad += 1
                problems.append(f"index entry {key.hex()} -> slot {e.slot}: the slot does not hold it")
        return "ok", bad
    except NvmeIndexError as e:
        return f"unusable: {e}", 0
    finally:
        idx.close()


def _rebuild(path, found, fp, stride, shrink_to) -> dict:
    old = os.path.join(path, INDEX_DIR)
    aside = None
    if os.path.exists(old):
        aside = f"{old}.damaged-{time.strftime('%Y%m%dT%H%M%S')}"
        os.rename(old, aside)
    os.mkdir(old, 0o700)
    keep, dropped, seen = [], 0, set()
    for s in sorted(found):
        key, tags = found[s]
        if shrink_to is not None and s >= shrink_to:
            dropped += 1
            continue
        if key in seen:
            continue
        seen.add(key)
        keep.append((key, s, fp["block_bytes"], tags))
    cap = max([s for _, s, _, _ in keep], default=-1) + 1
    cap = shrink_to if shrink_to is not None else max(cap, len(found))
    idx = NvmeIndex(old, max(cap, 1))
    try:
        idx.put(keep)
        idx.set_meta(layout_meta(fp, stride, max(cap, 1)))
    finally:
        idx.close()
    return {"rebuilt_entries": len(keep), "dropped_beyond_capacity": dropped, "old_index_kept_at": aside}
