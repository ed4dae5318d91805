"""Eviction, admission and promotion policies, chosen by name in YAML."""

from .base import (ADMISSION, EVICTION, PROMOTION, RETIRED, AdmissionPolicy, EvictionPolicy, PromotionPolicy,
                   RequestInfo, retired)
from . import lru  # noqa: F401  (registers)
from . import arc, s3fifo, admission, promotion  # noqa: F401,E402  (register)

__all__ = ["ADMISSION", "EVICTION", "PROMOTION", "RETIRED", "AdmissionPolicy", "EvictionPolicy",
           "PromotionPolicy", "RequestInfo", "retired"]
