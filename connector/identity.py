"""The model's identity in the fingerprint: what the weights are, not where they are.

vLLM's block hashes cover tokens only, so the fingerprint is all that keeps one model's KV
from being served to another. A local model directory is named by a digest of its content:
`config.json` and, per weight file (sorted by name), its name, size and `SAMPLES` reads of
`SAMPLE_BYTES` spread evenly over it (the first and last included). Weights replaced in place
under the same path get another identity (their old blocks are misses, never served), and
instances that load the same weights from different paths share the shared tier. A model
named by a hub id is `id@<commit>` of the snapshot in the local hub cache (the commit names the
repository's content; vLLM fetches config.json before the connector starts), else `id@revision`.
"""

from __future__ import annotations

import logging
import os

import xxhash

log = logging.getLogger("kvtier")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLES = 16
SAMPLE_BYTES = 64 * 1024


def weights_digest(path: str) -> tuple[str, int]:
    """(xxh3-128 hex of the directory's config.json and sampled weight files, files read).
    Raises OSError naming the file that could not be read."""
    h = xxhash.xxh3_128()
    cfg = os.path.join(path, "config.json")
    if os.path.isfile(cfg):
        with open(cfg, "rb") as f:
            h.update(b"config.json\0" + f.read())
    names = sorted(n for n in os.listdir(path) if n.endswith(WEIGHT_SUFFIXES))
    for name in names:
        p = os.path.join(path, name)
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            h.update(f"{name}\0{size}\0".encode())
            span = max(0, size - SAMPLE_BYTES)
            for i in range(SAMPLES):
                h.update(os.pread(f.fileno(), SAMPLE_BYTES, span * i // (SAMPLES - 1)))
    return h.hexdigest(), len(names)


def model_identity(model: str, revision: str | None = None, cache_dir: str | None = None) -> tuple[str, str]:
    """(identity for the fingerprint, how it was made, for the startup line)."""
    if os.path.isdir(model):
        try:
            digest, n = weights_digest(model)
        except OSError as e:
            log.warning("kvtier: model %s: cannot read %s (%s): the fingerprint names the model by its path",
                        model, e.filename or model, e.strerror or e)
            return model, "path (weights unreadable)"
        return f"weights:{digest}", f"digest of {model} ({n} weight files)"
    commit = _hub_commit(model, revision, cache_dir)
    if commit:
        return f"{model}@{commit}", "hub snapshot"
    return f"{model}@{revision or 'default'}", "hub id (no cached snapshot)"


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
