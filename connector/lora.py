"""Requests with a LoRA adapter pass through kvtier: never looked up, never stored.

vLLM's block hashes name a request's adapter by its name and path, not by its weights, and the
fingerprint names the base model only: an adapter rewritten in place with other weights, in
this process or after a restart, would be served KV its weights never made. So such a request's
KV stays in vLLM's own prefix cache; kvtier counts it (`lora_passthrough`, once per request)
and says so in one line, once.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from kvtier.common.counters import Metric
from kvtier.common.once import Once

log = logging.getLogger("kvtier.connector")


class LoraGate:
    def __init__(self, count: Callable[[str], None]) -> None:
        self._count = count
        self._seen: set[str] = set()
        self._once = Once(log)

    def passes_through(self, request: Any) -> bool:
        """True for a request with a LoRA adapter (counted at its first sight)."""
        lora = getattr(request, "lora_request", None)
        if lora is None:
            return False
        rid = request.request_id
        if rid not in self._seen:
            self._seen.add(rid)
            self._count(Metric.LORA_PASSTHROUGH.key)
            self._once(("lora",), logging.WARNING, "kvtier: requests with a LoRA adapter (first: %s, adapter %r) "
                       "pass through: their KV is neither looked up nor stored in kvtier's tiers",
                       rid, getattr(lora, "lora_name", lora))
        return True

    def finished(self, req_id: str) -> None:
        self._seen.discard(req_id)
