"""The model's identity in the fingerprint: what the weights are, not where they are.

vLLM's block hashes cover tokens only, so the fingerprint is all that keeps one model's KV
from being served to another. A local model directory is named by a digest of its whole
content: `config.json` and, per weight file (sorted by name), its name, size and the xxh3-128
of every byte (sampling lets two models that differ where the samples do not look collide).
Per-file digests are cached by (device, inode, size, mtime_ns, ctime_ns) in the data directory
(`digest_cache`), so a restart re-reads nothing unchanged. Hashing multi-GB weights takes
seconds, so it runs in a thread (`ModelIdentity`); until it is done the persistent tiers stay
closed. Weights replaced in place get another identity (their old blocks are misses, never
served), and instances that load the same weights from different paths share the shared tier.
A model named by a hub id is `id@<commit>` of the snapshot in the local hub cache (the commit
names the repository's content; vLLM fetches config.json before the connector starts), else
`id@revision`. `model_identity` in the config names the weights as the deployment says.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import xxhash

from .digest_cache import DigestCache, file_digest

log = logging.getLogger("kvtier")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


class DigestStats:
    """What one digest cost: files hashed (not from the cache), bytes read, seconds."""

    def __init__(self) -> None:
        self.files = self.hashed = self.bytes = 0
        self.seconds = 0.0

    def add_bytes(self, n: int) -> None:
        self.bytes += n


def weights_digest(path: str, data_dir: str | None = None, stats: DigestStats | None = None) -> tuple[str, int]:
    """(xxh3-128 hex of the directory's config.json and whole weight files, weight files).
    `data_dir`: where per-file digests are cached (None: no cache). Raises OSError naming the
    file that could not be read."""
    st = stats or DigestStats()
    t0 = time.monotonic()
    cache = DigestCache(data_dir)
    if cache.ignored:
        log.warning("kvtier: %s: digest cache ignored (%s); weights are hashed again", cache.dir, cache.ignored)
    h = xxhash.xxh3_128()
    cfg = os.path.join(path, "config.json")
    if os.path.isfile(cfg):
        with open(cfg, "rb") as f:
            h.update(b"config.json\0" + f.read())
    names = sorted(n for n in os.listdir(path) if n.endswith(WEIGHT_SUFFIXES))
    for name in names:
        p = os.path.abspath(os.path.join(path, name))
        d, size, cached = file_digest(p, cache, st.add_bytes)
        st.files += 1
        st.hashed += not cached
        h.update(f"{name}\0{size}\0{d}\0".encode())
    if st.hashed or cache.ignored:
        err = cache.save()
        if err:
            log.warning("kvtier: cannot write the weights' digest cache (%s): the next start hashes them again", err)
    st.seconds = time.monotonic() - t0
    return h.hexdigest(), len(names)


class ModelIdentity:
    """The model's identity, known at once (given, hub id) or when a digest thread is done.

    `value` is None until then (and stays None when the weights cannot be read: the persistent
    tiers then never open). `how` says how it was made, for the start line."""

    def __init__(self, model: str, revision: str | None = None, given: str | None = None,
                 data_dir: str | None = None, cache_dir: str | None = None, start: bool = True) -> None:
        self.model = model
        self.value: str | None = None
        self.how = ""
        self.error: str | None = None
        self.stats = DigestStats()
        self.done = threading.Event()
        self._data_dir = data_dir
        if given:
            self._set(given, "given in the config (model_identity)")
        elif not os.path.isdir(model):
            commit = _hub_commit(model, revision, cache_dir)
            self._set(f"{model}@{commit}", "hub snapshot") if commit else \
                self._set(f"{model}@{revision or 'default'}", "hub id (no cached snapshot)")
        else:
            self.how = f"digest of {model} running"
            if start:
                threading.Thread(target=self.run, name="kvtier-weights-digest", daemon=True).start()

    def _set(self, value: str | None, how: str) -> None:
        self.value, self.how = value, how
        self.done.set()

    def run(self) -> None:
        """Hash the weights (the thread's body; a test may call it directly)."""
        try:
            digest, n = weights_digest(self.model, self._data_dir, self.stats)
        except OSError as e:
            self.error = f"cannot read {e.filename or self.model} ({e.strerror or e})"
            log.warning("kvtier: model %s: %s: its identity is unknown, so the persistent tiers (nvme, shared) "
                        "stay closed; set model_identity to name the weights", self.model, self.error)
            self._set(None, f"unknown: {self.error}")
            return
        except Exception as e:   # never let the thread die silently
            self.error = f"{type(e).__name__}: {e}"
            log.warning("kvtier: model %s: weights digest failed (%s): the persistent tiers stay closed",
                        self.model, self.error)
            self._set(None, f"unknown: {self.error}")
            return
        self._set(f"weights:{digest}", f"digest of {self.model} ({n} weight files, {self.cost()})")

    def cost(self) -> str:
        s = self.stats
        if not s.hashed:
            return f"all {s.files} from the digest cache, {s.seconds:.2f} s"
        gbps = s.bytes / s.seconds / 1e9 if s.seconds > 0 else 0.0
        size = f"{s.bytes / 1e9:.2f} GB" if s.bytes >= 1e9 else f"{s.bytes / 1e6:.1f} MB"
        return (f"{s.hashed} of {s.files} hashed, {size} in {s.seconds:.2f} s = {gbps:.2f} GB/s"
                f"{'' if s.hashed == s.files else ', the rest from the digest cache'}")


def model_identity(model: str, revision: str | None = None, cache_dir: str | None = None,
                   data_dir: str | None = None) -> tuple[str | None, str]:
    """(identity for the fingerprint, how it was made), computed now (the CLI, tests)."""
    mi = ModelIdentity(model, revision, data_dir=data_dir, cache_dir=cache_dir, start=False)
    if not mi.done.is_set():
        mi.run()
    return mi.value, mi.how

def _hub_commit(repo_id: str, revision: str | None, cache_dir: str | None) -> str | None:
    """The commit of the cached snapshot holding the repo's config.json (None when not cached)."""
    try:
        from huggingface_hub import try_to_load_from_cache
        p = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir, revision=revision)
    except (ImportError, ValueError):   # no hub client, or not a repo id it accepts (a missing path, a URL)
        return None
    if isinstance(p, str):
        snap = os.path.dirname(p)
        if os.path.basename(os.path.dirname(snap)) == "snapshots":
            return os.path.basename(snap)
    return None
