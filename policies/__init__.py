"""Eviction, admission, promotion/prefetch and offload policies, chosen by name in YAML."""

from .base import (ADMISSION, EVICTION, OFFLOAD, PROMOTION, AdmissionPolicy, EvictionPolicy,
                   OffloadPolicy, PromotionPolicy, RequestInfo)
from . import lru  # noqa: F401  (registers)
from . import arc, s3fifo, prefix, nextuse, plru, duel, hawk, admission, bypass, promotion, offload  # noqa: F401,E402  (register)

__all__ = ["ADMISSION", "EVICTION", "OFFLOAD", "PROMOTION", "AdmissionPolicy", "EvictionPolicy",
           "OffloadPolicy", "PromotionPolicy", "RequestInfo"]
