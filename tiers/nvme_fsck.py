"""`kvtier fsck`: check an NVMe tier directory against its data files' block headers, and
rebuild its index from them.

Every slot's header and payload are read and verified with the directory's secret (key, tag,
fingerprint, rank, payload hash); the index is compared with what the slots hold. `rebuild`
moves the old index aside (``index.damaged-<time>``, never deleted) and writes a new one with
every slot whose block verifies in every rank's file. Blocks that were evicted but whose slots
were not reused verify too and come back: they are genuine blocks of their keys.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time

from .nvme_block import (HEADER_BYTES, BlockCodec, NoSecret, load_secret, open_dir, recorded_fingerprint,
                         slot_stride)
from .nvme_control import (INDEX_DIR, DirectoryInUse, FingerprintMismatch, fingerprint_diff, data_file, fingerprint_hash,
                           lock_holder, make_fingerprint)
from .nvme_index import FORMAT_VERSION, NvmeIndex, NvmeIndexError


def fsck(path: str, block_bytes: int, fingerprint: dict, rebuild: bool = False,
         shrink_to: int | None = None) -> dict:
    """Check (and with `rebuild`, rebuild) the tier directory `path`; returns a report."""
    fp = make_fingerprint("nvme", block_bytes, fingerprint)
    fph = int(fingerprint_hash(fp), 16)
    dfd = open_dir(path, create=False)
    try:
        try:
            fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            who = lock_holder(dfd)
            raise DirectoryInUse(e.errno, f"fsck: {path} is in use by pid {who[0] if who else '?'}; "
                                 f"stop it first", path) from None
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
        ranks = 0
        while os.path.exists(os.path.join(path, data_file(ranks))):
            ranks += 1
        if ranks == 0:
            raise FileNotFoundError(2, f"fsck: no data file in {path}", path)
        stride = slot_stride(block_bytes)
        found, problems = _scan(dfd, path, ranks, block_bytes, stride, secret, fph)
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


def _read_index(path: str, fn, default):
    """fn(the directory's index, opened read-only), or `default` when it is unreadable."""
    try:
        idx = NvmeIndex(os.path.join(path, INDEX_DIR), 1, read_only=True)
    except NvmeIndexError:
        return default
    try:
        return fn(idx)
    except NvmeIndexError:
        return default
    finally:
        idx.close()


def _scan(dfd, path, ranks, bb, stride, secret, fph):
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
                    if buf[:8] != bytes(8):  # an unused slot is zeros: not a problem
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
        idx = NvmeIndex(os.path.join(path, INDEX_DIR), 1, read_only=True)
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
        idx.set_meta({"format_version": str(FORMAT_VERSION), "fingerprint": fp, "slot_stride": str(stride),
                      "capacity": str(max(cap, 1))})
    finally:
        idx.close()
    return {"rebuilt_entries": len(keep), "dropped_beyond_capacity": dropped, "old_index_kept_at": aside}
