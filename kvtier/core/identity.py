"""The model's identity in the fingerprint: what the weights are, not where they are.

vLLM's block hashes cover tokens only, so the fingerprint is all that keeps one model's KV
from being served to another. The weights are named by a digest of exactly the files the model
path resolves to (`resolve_weights`): a directory's `config.json` and, per weight file (sorted
by name), its name, size and the xxh3-128 of every byte; a single GGUF file by its own bytes;
a hub id by the files of its snapshot in the local hub cache. Per-file digests are cached by
(device, inode, size, mtime_ns, ctime_ns) in the data directory (`digest_cache`), so a restart
re-reads nothing unchanged. Hashing multi-GB weights takes seconds, so it runs in a thread
(`ModelIdentity`); until it is done the persistent tiers stay closed.

The weights vLLM loaded and the ones digested must be the same: the path is resolved once
(`pin`, at the first kvtier hook of the process) and again after the digest; a symlink on the
path changed after this process started, or a path that resolves differently then, leaves the
identity unknown (the persistent tiers stay closed, one line names the path and its targets).
So does anything kvtier cannot digest: a load format that does not read the model's files
(`DIGESTED_FORMATS`), a hub id with no cached snapshot, a path that does not resolve.
`model_identity` in the config names the weights as the deployment says.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import xxhash

from .digest_cache import DigestCache, file_digest, open_model_file

log = logging.getLogger("kvtier")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# vLLM's load formats that read the weight files in the model's directory (or the GGUF file)
DIGESTED_FORMATS = frozenset({"auto", "safetensors", "pt", "npcache", "gguf", "fastsafetensors", "instanttensor",
                              "mistral", "bitsandbytes", "sharded_state"})
CLOSED = "the persistent tiers (nvme, shared) stay closed"


class DigestStats:
    """What one digest cost: files hashed (not from the cache), bytes read, seconds."""

    def __init__(self) -> None:
        self.files = self.hashed = self.bytes = 0
        self.seconds = 0.0

    def add_bytes(self, n: int) -> None:
        self.bytes += n


@dataclass(frozen=True)
class Weights:
    """What a model path names: `target` (a real directory, GGUF file or hub snapshot), or `why` not."""
    target: str | None
    why: str | None = None


def format_name(load_format: object) -> str:
    return str(getattr(load_format, "value", load_format) or "auto").lower()


def resolve_weights(model: str, revision: str | None = None, cache_dir: str | None = None,
                    load_format: object = "auto") -> Weights:
    """The real path of the weights `model` names now (a local directory or file, a hub id's
    cached snapshot), or why kvtier cannot digest them."""
    fmt = format_name(load_format)
    if fmt not in DIGESTED_FORMATS:
        return Weights(None, f"load_format {fmt!r} does not load the model's files (kvtier cannot digest them)")
    if os.path.exists(model):
        return Weights(os.path.realpath(model))
    if os.path.lexists(model) or os.path.isabs(model) or model.startswith("."):
        return Weights(None, f"{model} does not resolve to a file or directory")
    snap = _hub_snapshot(model, revision, cache_dir)
    if snap is None:
        return Weights(None, f"hub id {model}@{revision or 'default'} has no cached snapshot")
    return Weights(os.path.realpath(snap))


def links_changed_since(path: str, since: float | None) -> str | None:
    """The first symlink on `path` (followed as the kernel does) whose link changed after `since`."""
    if since is None:
        return None
    todo, seen, hops = os.path.abspath(path).strip("/").split("/"), "/", 0
    while todo and hops < 40:
        part = todo.pop(0)
        p = os.path.join(seen, part)
        try:
            st = os.lstat(p)
        except OSError:
            return None
        if not os.path.islink(p):
            seen = p
            continue
        hops += 1
        if st.st_ctime > since:
            return (f"{p} was changed at {time.strftime('%H:%M:%S', time.localtime(st.st_ctime))}, after this "
                    f"process started at {time.strftime('%H:%M:%S', time.localtime(since))}")
        try:
            dest = os.readlink(p)
        except OSError as e:   # replaced between the two calls: changed now
            return f"{p} changed while it was read ({e.strerror})"
        base = "/" if dest.startswith("/") else seen
        todo = os.path.normpath(os.path.join(base, dest)).strip("/").split("/") + todo
        seen = "/"
    return None


def process_start_time() -> float | None:
    """When this process started (Linux /proc), or None."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(ln.split()[1]) for ln in f if ln.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


_PINS: dict[tuple, tuple[Weights, str | None]] = {}
_PIN_LOCK = threading.Lock()


def pin(engine: str, model: str, revision: str | None = None, cache_dir: str | None = None,
        load_format: object = "auto", since: float | None = None) -> tuple[Weights, str | None]:
    """(what `model` resolves to, a symlink on it changed since `since` or None), taken once per
    engine (`engine`: vLLM's config instance id) at its first call: the earliest kvtier sees the
    path in this process."""
    key = (engine, model, revision, cache_dir, format_name(load_format))
    with _PIN_LOCK:
        if key not in _PINS:
            _PINS[key] = (resolve_weights(model, revision, cache_dir, load_format),
                          links_changed_since(model, since))
        return _PINS[key]


def weights_digest(path: str, data_dir: str | None = None, stats: DigestStats | None = None) -> tuple[str, int]:
    """(xxh3-128 hex of the directory's config.json and whole weight files, or of one weight
    file's bytes, weight files). `data_dir`: where per-file digests are cached (None: no cache).
    Raises OSError naming the file that could not be read."""
    st = stats or DigestStats()
    t0 = time.monotonic()
    cache = DigestCache(data_dir)
    if cache.ignored:
        log.warning("kvtier: %s: digest cache ignored (%s); weights are hashed again", cache.dir, cache.ignored)
    h = xxhash.xxh3_128()
    if os.path.isdir(path):
        cfg = os.path.join(path, "config.json")
        if os.path.exists(cfg):
            h.update(b"config.json\0" + _read_regular(cfg))
        files = [(n, os.path.join(path, n)) for n in sorted(os.listdir(path)) if n.endswith(WEIGHT_SUFFIXES)]
    else:   # one file (a GGUF model): its bytes, whatever its name
        files = [("", path)]
    for name, p in files:
        d, size, cached = file_digest(os.path.abspath(p), cache, st.add_bytes)
        st.files += 1
        st.hashed += not cached
        h.update(f"{name}\0{size}\0{d}\0".encode())
    if st.hashed or cache.ignored:
        err = cache.save()
        if err:
            log.warning("kvtier: cannot write the weights' digest cache (%s): the next start hashes them again", err)
    st.seconds = time.monotonic() - t0
    return h.hexdigest(), len(files)


def _read_regular(path: str) -> bytes:
    """A model file's bytes (`digest_cache.open_model_file`: a FIFO never blocks)."""
    fd, _ = open_model_file(path)
    with os.fdopen(fd, "rb") as f:
        return f.read()


class ModelIdentity:
    """The model's identity, known at once (given) or when a digest thread is done.

    `value` is None until then, and stays None when the weights cannot be named (unreadable,
    not digestible, the path changed during the start: `error`, logged once; the persistent
    tiers then never open). `how` says how it was made, for the start line."""

    def __init__(self, model: str, revision: str | None = None, given: str | None = None,
                 data_dir: str | None = None, cache_dir: str | None = None, start: bool = True,
                 load_format: object = "auto", pinned: tuple[Weights, str | None] | None = None,
                 digest: bool = True) -> None:
        """`pinned`: `pin`'s answer for this engine (None: the path resolved now). `digest` False:
        this process does not name the weights (vLLM's workers: the scheduler sends the identity)."""
        self.model = model
        self.value: str | None = None
        self.how = ""
        self.error: str | None = None
        self.stats = DigestStats()
        self.done = threading.Event()
        self._data_dir = data_dir
        self._key = (revision, cache_dir, load_format)
        if given:
            self._set(given, "given in the config (model_identity)")
            return
        if not digest:
            self._set(None, "named by the scheduler")
            return
        self.pinned, changed = pinned or (resolve_weights(model, revision, cache_dir, load_format), None)
        if self.pinned.why or changed:
            self._fail(self.pinned.why or f"{changed} (now -> {self.pinned.target}): the weights vLLM "
                       "loaded are not known")
            return
        self.how = f"digest of {self.pinned.target} running"
        if start:
            threading.Thread(target=self.run, name="kvtier-weights-digest", daemon=True).start()

    def _set(self, value: str | None, how: str) -> None:
        self.value, self.how = value, how
        self.done.set()

    def _fail(self, error: str) -> None:
        self.error = error
        log.warning("kvtier: model %s: %s: its identity is unknown, so %s; set model_identity to name "
                    "the weights", self.model, error, CLOSED)
        self._set(None, f"unknown: {error}")

    def run(self) -> None:
        """Hash the pinned weights (the thread's body; a test may call it directly), then check
        that the path still resolves to them."""
        target = self.pinned.target or ""
        try:
            digest, n = weights_digest(target, self._data_dir, self.stats)
        except OSError as e:
            return self._fail(f"cannot read {e.filename or target} ({e.strerror or e})")
        except Exception as e:   # never let the thread die silently
            return self._fail(f"weights digest failed ({type(e).__name__}: {e})")
        now = resolve_weights(self.model, *self._key)
        if now.target != target:
            return self._fail(f"the path resolved to {target} at start and to {now.target or now.why} "
                              "after the digest")
        self._set(f"weights:{digest}", f"digest of {self.model} -> {target} ({n} weight files, {self.cost()})")

    def cost(self) -> str:
        s = self.stats
        if not s.hashed:
            return f"all {s.files} from the digest cache, {s.seconds:.2f} s"
        gbps = s.bytes / s.seconds / 1e9 if s.seconds > 0 else 0.0
        size = f"{s.bytes / 1e9:.2f} GB" if s.bytes >= 1e9 else f"{s.bytes / 1e6:.1f} MB"
        return (f"{s.hashed} of {s.files} hashed, {size} in {s.seconds:.2f} s = {gbps:.2f} GB/s"
                f"{'' if s.hashed == s.files else ', the rest from the digest cache'}")


def model_identity(model: str, revision: str | None = None, cache_dir: str | None = None,
                   data_dir: str | None = None, load_format: object = "auto") -> tuple[str | None, str]:
    """(identity for the fingerprint, how it was made), computed now (the CLI, tests)."""
    mi = ModelIdentity(model, revision, data_dir=data_dir, cache_dir=cache_dir, start=False, load_format=load_format)
    if not mi.done.is_set():
        mi.run()
    return mi.value, mi.how


def _hub_snapshot(repo_id: str, revision: str | None, cache_dir: str | None) -> str | None:
    """The cached snapshot directory holding the repo's config.json (None when not cached)."""
    try:
        from huggingface_hub import try_to_load_from_cache
        p = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir, revision=revision)
    except (ImportError, ValueError):   # no hub client, or not a repo id it accepts (a missing path, a URL)
        return None
    if isinstance(p, str):
        snap = os.path.dirname(p)
        if os.path.basename(os.path.dirname(snap)) == "snapshots":
            return snap
    return None
