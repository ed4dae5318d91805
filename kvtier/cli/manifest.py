"""The spill manifests: the NVMe tier directory's (`spill-manifest.json`, one record per spill
with a digest per block on NVMe) and the shared tier's (kept on the server, one per seed)."""

from __future__ import annotations

import errno
import json
import os
import time
from typing import Any, Callable

from kvtier.core.private_files import PrivateDir, pid_alive
from kvtier.offline.blockgen import block_data
from kvtier.tiers.shared_conn import error_text

MANIFEST = "spill-manifest.json"
MANIFEST_FORMAT = 2   # 2: one record per spill (`spills`); 1 (no `format`): the last spill's only
MAX_MANIFEST_BYTES = 256 << 20


def write_manifest(nvme: Any, spills: list[dict]) -> None:
    """The spill manifest: namespace, fingerprint and one record per spill whose blocks are on
    NVMe (seed, blocks asked, a digest per block there; a spill begun but not yet recorded has
    no digests). Written 0600 without following symlinks, fsynced (file and directory), then
    renamed into place; a failure (e.g. ENOSPC) names the file and leaves no temp file behind."""
    body = {"format": MANIFEST_FORMAT, "block_bytes": nvme.block_bytes, "namespace": nvme.namespace,
            "dir": nvme.dir, "fingerprint": nvme.fingerprint, "spills": spills}
    data = _manifest_doc(body).encode()
    path = os.path.join(nvme.dir, MANIFEST)
    try:
        with PrivateDir.open(nvme.dir, create=False, parents=False) as d:
            d.remove_temps(pid_alive)   # a spill killed while writing it
            d.write(MANIFEST, data, fsync=True)
    except OSError as e:
        name = errno.errorcode.get(e.errno or 0, str(e.errno))
        why = e.strerror.rsplit("] ", 1)[-1] if e.strerror else e
        raise OSError(e.errno, f"cannot write the spill manifest {path}: [{name}] {why}", path) from None


def read_manifest_if_dir(path: str) -> dict | None:
    """`read_manifest` of a directory that may not exist (None then)."""
    return read_manifest(path) if os.path.isdir(path) else None


def read_manifest(path: str) -> dict | None:
    """The spill manifest in `path`, checked (None when there is none). A FIFO, device, symlink or
    oversized file is refused without blocking; a damaged manifest is an error naming the file."""
    import stat as _stat

    p = os.path.join(path, MANIFEST)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise OSError(e.errno, f"spill manifest {p}: {e.strerror}" +
                      (" (a symlink: refused)" if e.errno == errno.ELOOP else ""), p) from None
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"spill manifest {p} is not a regular file; refused", p)
        if st.st_size > MAX_MANIFEST_BYTES:
            raise OSError(errno.EFBIG, f"spill manifest {p} is {st.st_size} bytes (limit {MAX_MANIFEST_BYTES})", p)
        chunks = []
        while True:
            c = os.read(fd, 1 << 20)
            if not c:
                break
            chunks.append(c)
    finally:
        os.close(fd)
    body = _manifest_body(b"".join(chunks), p)
    if "spills" not in body:   # format 1: the last spill's record at the top level
        body["spills"] = [{k: body.pop(k) for k in ("seed", "blocks", "on_nvme", "digests") if k in body}]
    try:
        for e in body["spills"]:
            e["seed"], e["blocks"] = int(e["seed"]), int(e["blocks"])
            if e.get("digests") is not None:
                e["digests"] = {str(int(j)): str(d) for j, d in e["digests"].items()}
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise OSError(errno.EINVAL, f"spill manifest {p} is malformed: {e!r}", p) from None
    return body


def _manifest_doc(body: dict) -> str:
    """A manifest as stored: the body and the xxh3 of its canonical JSON."""
    import xxhash
    text = json.dumps(body, sort_keys=True)
    return json.dumps({"manifest": body, "xxh3": xxhash.xxh3_64_hexdigest(text.encode())}, sort_keys=True)


def _manifest_body(raw: bytes, where: str) -> dict:
    """The body of a stored manifest (`_manifest_doc`), checked; damage is an OSError naming `where`."""
    import xxhash
    try:
        doc = json.loads(raw)
        body = doc["manifest"]
        ok = xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True).encode()) == doc["xxh3"]
    except (ValueError, KeyError, TypeError) as e:
        raise OSError(errno.EINVAL, f"spill manifest {where} is damaged or of an older format: {e!r}", where) \
            from None
    if not ok:
        raise OSError(errno.EINVAL, f"spill manifest {where} fails its checksum (damaged or edited)", where)
    return body


def digest(seed: int, j: int, bb: int) -> str:
    import xxhash
    return xxhash.xxh3_64_hexdigest(memoryview(block_data(seed, j, bb).numpy()))


def put_shared_manifest(shared: Any, seed: int, n: int, present: list[int]) -> None:
    """The spill manifest of the shared tier, on the server next to the blocks (no expiry)."""
    bb = shared.block_bytes
    body = {"seed": seed, "blocks": n, "block_bytes": bb, "namespace": shared.ns.ns, "on_shared": len(present),
            "time": time.time(), "digests": {str(j): digest(seed, j, bb) for j in present}}
    _on_server(shared, lambda cl: cl.set(_shared_manifest_name(shared, seed), _manifest_doc(body)))


def get_shared_manifest(shared: Any, seed: int | None) -> dict | None:
    """The shared tier's spill manifest of `seed` (None: the newest written), checked; None if none."""
    where = f"on shared tier {shared.settings.where} (namespace {shared.ns.ns})"
    if seed is not None:
        raw = _on_server(shared, lambda cl: cl.get(_shared_manifest_name(shared, seed)))
        return None if raw is None else _manifest_body(raw, where)
    names = _on_server(shared, lambda cl: list(cl.scan_iter(match=shared.ns.prefix + b"manifest:*", count=1000)))
    found = []
    for name in names:
        raw = _on_server(shared, lambda cl: cl.get(name))
        if raw is not None:
            found.append(_manifest_body(raw, where))
    return max(found, key=lambda m: float(m.get("time", 0)), default=None)


def _shared_manifest_name(shared: Any, seed: int) -> bytes:
    return shared.ns.prefix + b"manifest:" + str(seed).encode()


def _on_server(shared: Any, fn: Callable[[Any], Any]) -> Any:
    """fn(redis client); a server error is an OSError naming the server (and trips its breaker); a
    manifest key holding another Redis type (WRONGTYPE) is a damaged manifest, the server fine."""
    try:
        return fn(shared.conn.client)
    except Exception as e:   # redis-py's ConnectionError, TimeoutError, ResponseError, cluster errors
        if not type(e).__module__.startswith("redis"):
            raise
        if str(e).startswith("WRONGTYPE"):
            where = f"on shared tier {shared.settings.where} (namespace {shared.ns.ns})"
            raise OSError(errno.EINVAL, f"spill manifest {where} is damaged: its key holds a value of another "
                          f"Redis type (a list, a hash, ...), not a string", where) from None
        shared.conn.breaker.fail(e)
        raise OSError(errno.EHOSTUNREACH, f"shared tier {shared.settings.where}: {type(e).__name__}: "
                      f"{error_text(e)}", shared.settings.where) from None
