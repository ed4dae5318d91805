"""Every counter kvtier keeps, declared once: its stats key, what it is counted per, whether and
how it reaches Prometheus, and its help text.

A counting site names a member and gets the key the counters dict holds:
`ctrl.count(Metric.BYTES_STORED.at(tier.name), n)` counts into `"bytes_stored.<tier>"`,
`ctrl.count(Metric.N_LOOKUPS.key)` into `"n_lookups"`. Keys stay plain strings (they travel
through vLLM's stats pipeline and tests read `totals["bytes_stored.cpu"]`). connector/metrics.py,
the one Prometheus boundary, reads `Metric.exported()`; nothing else names a counter by a string.

Key forms: `<key>` (per: none), `<key>.<tier>` (per tier, or per hook for `hook_errors`),
`<key>.<tier>|<tenant>` (per tenant); gauges' keys start with `gauge_`; a histogram's
observations travel as `obs:<key>.<tier>` lists made from the per-step counter `<key>.<tier>`.
"""

from __future__ import annotations

from enum import Enum

GAUGE_PREFIX = "gauge_"
OBS_PREFIX = "obs:"

NONE, TIER, TENANT, HOOK = "none", "tier", "tenant", "hook"        # what a counter is counted per
NATIVE = "native"   # per secondary tier under vLLM's own tiering: the `event` label of EVENTS_METRIC
COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"         # how it is exported
EVENTS_METRIC = "vllm:kv_offload_kvtier_events"   # kvtier/vllm's one series: labels (tier, event)


class Metric(Enum):
    """A counter (or gauge) kvtier keeps: (stats key, per, exported as, Prometheus name, help).
    `exported as` None: kept in the counters and the log line, not a Prometheus series."""

    # requests and hits
    N_LOOKUPS = ("n_lookups", NONE, COUNTER, "lookups", "Lookups of request prefixes in kvtier's tiers.")
    N_LOADS = ("n_loads", NONE, COUNTER, "loads", "Requests whose prefix kvtier loaded (in part or whole).")
    HIT_BLOCKS = ("hit_blocks", TIER, COUNTER, "hit_blocks", "Blocks served from a kvtier tier instead of recomputed.")
    HIT_TOKENS = ("hit_tokens", TIER, COUNTER, "hit_tokens", "Prompt tokens served from a kvtier tier.")
    MISS_BLOCKS = ("miss_blocks", NONE, COUNTER, "miss_blocks", "Prompt blocks looked up in kvtier and not found.")
    MISS_TOKENS = ("miss_tokens", NONE, COUNTER, "miss_tokens", "Prompt tokens looked up in kvtier and not found.")
    # data moved
    BYTES_LOADED = ("bytes_loaded", TIER, COUNTER, "loaded_bytes",
                    "Bytes copied from a tier into vLLM's KV cache (all ranks).")
    BYTES_STORED = ("bytes_stored", TIER, COUNTER, "stored_bytes", "Bytes written into a tier (all ranks).")
    BLOCKS_LOADED = ("blocks_loaded", TIER, COUNTER, "loaded_blocks", "Blocks copied from a tier into vLLM's KV cache.")
    BLOCKS_STORED = ("blocks_stored", TIER, None, None, "Blocks a worker wrote into a tier (before commit).")
    STORED_BLOCKS = ("stored_blocks", TIER, COUNTER, "stored_blocks", "Blocks committed to a tier.")
    SECONDS_LOADED = ("seconds_loaded", TIER, HISTOGRAM, "load_seconds",
                      "Time a worker spent loading from a tier in one step.")
    SECONDS_STORED = ("seconds_stored", TIER, HISTOGRAM, "store_seconds",
                      "Time a worker spent storing into a tier in one step (NVMe: per batch).")
    # failures and policy outcomes
    BLOCKS_LOAD_FAILED = ("blocks_load_failed", TIER, COUNTER, "load_failed_blocks",
                          "Blocks whose load failed (recomputed).")
    LOAD_FAILED_REQUESTS = ("load_failed_requests", NONE, COUNTER, "load_failed_requests",
                            "Requests with a failed kvtier load.")
    STORE_FAILED_BLOCKS = ("store_failed_blocks", TIER, COUNTER, "store_failed_blocks",
                           "Blocks whose store failed (not committed).")
    STORE_DROPPED_BLOCKS = ("store_dropped_blocks", TIER, COUNTER, "store_dropped_blocks",
                            "Blocks not stored: no evictable room.")
    NOT_ADMITTED_BLOCKS = ("not_admitted_blocks", TIER, COUNTER, "not_admitted_blocks",
                           "Blocks the admission policy kept out of a tier.")
    EVICTED_BLOCKS = ("evicted_blocks", TIER, COUNTER, "evicted_blocks", "Blocks evicted from a tier.")
    DEMOTED_BLOCKS = ("demoted_blocks", TIER, COUNTER, "demoted_blocks",
                      "Blocks written down to this tier on eviction above.")
    PROMOTED_BLOCKS = ("promoted_blocks", TIER, COUNTER, "promoted_blocks",
                       "Blocks copied up into this tier on a lower-tier hit.")
    CORRUPT_BLOCKS = ("corrupt_blocks", TIER, COUNTER, "checksum_failures",
                      "Blocks that failed checksum verification on read.")
    IO_ERRORS = ("io_errors", TIER, COUNTER, "io_errors", "I/O errors of a tier (reads and writes).")
    FAILED_LOAD_BLOCKS = ("failed_load_blocks", TIER, COUNTER, "failed_load_remembered_blocks",
                          "Blocks whose load failed, remembered: not offered again until rewritten.")
    FAILED_LOADS_FORGOTTEN = ("failed_loads_forgotten", NONE, COUNTER, "failed_loads_forgotten",
                              "Remembered failed loads forgotten past the memory's cap (may be offered once more).")
    # the shared tier
    GONE_BLOCKS = ("gone_blocks", TIER, COUNTER, "gone_blocks",
                   "Shared tier: blocks found by lookup, absent or bad at load (recomputed).")
    MISSING_BLOCKS = ("missing_blocks", TIER, COUNTER, "missing_blocks",
                      "Shared tier: reads that found no value (server evicted it).")
    UNREACHABLE = ("unreachable", TIER, COUNTER, "unreachable",
                   "Shared tier: commands that failed or timed out (server unreachable).")
    LOOKUP_TIMEOUTS = ("lookup_timeouts", TIER, COUNTER, "lookup_timeouts",
                       "Shared tier: lookups answered as misses after the timeout.")
    LOOKUP_FAILURES = ("lookup_failures", TIER, COUNTER, "lookup_failures",
                       "Shared tier: lookups answered as misses because the server was unreachable.")
    PUT_FAILED_BLOCKS = ("put_failed_blocks", TIER, COUNTER, "put_failed_blocks",
                         "Shared tier: block writes the server refused or lost.")
    BAD_BLOCKS = ("bad_blocks", TIER, None, None, "Shared tier: blocks read back corrupt or foreign at load.")
    DECRYPT_FAILED_BLOCKS = ("decrypt_failed_blocks", TIER, None, None, "Shared tier: sealed values that failed to open.")
    WRONG_TYPE_BLOCKS = ("wrong_type_blocks", TIER, None, None,
                         "Shared tier: values of another Redis type (a list, a hash, ...) under a block's key, read as bad.")
    BYTES_READ = ("bytes_read", TIER, None, None, "Shared tier: bytes read from the server.")
    BYTES_WRITTEN = ("bytes_written", TIER, None, None, "Shared tier: bytes written to the server.")
    BAD_DELETED_BLOCKS = ("bad_deleted_blocks", TIER, None, None, "Shared tier: bad values deleted from the server.")
    BAD_REWRITTEN_BLOCKS = ("bad_rewritten_blocks", TIER, None, None,
                            "Shared tier: bad values rewritten since (left in place).")
    BAD_DELETE_FAILED_BLOCKS = ("bad_delete_failed_blocks", TIER, None, None,
                                "Shared tier: bad values whose delete failed.")
    STORE_UNREPORTED_BLOCKS = ("store_unreported_blocks", TIER, None, None,
                               "Blocks of stores aborted: some rank did not report them within the limit.")
    HELD_RELEASE_TIMEOUTS = ("held_release_timeouts", NONE, COUNTER, "held_release_timeouts",
                             "Finished requests vLLM held for stores still copying, released at the time bound.")
    SKIPPED_BLOCKS = ("skipped_blocks", TIER, None, None, "Shared tier: reads not sent, the server unreachable.")
    PUT_SKIPPED_BLOCKS = ("put_skipped_blocks", TIER, None, None,
                          "Shared tier: writes not sent, the server unreachable.")
    # occupancy (gauges: the newest value wins)
    RESIDENT_BLOCKS = ("gauge_resident_blocks", TIER, GAUGE, "resident_blocks", "Blocks resident in a tier.")
    CAPACITY_BLOCKS = ("gauge_capacity_blocks", TIER, GAUGE, "capacity_blocks", "Capacity of a tier in blocks.")
    LEASED_BLOCKS = ("gauge_leased_blocks", NONE, GAUGE, "leased_blocks",
                     "Tier blocks pinned by leases of requests in flight.")
    NVME_GDS = ("gauge_nvme_gds", NONE, GAUGE, "nvme_gds",
                "NVMe io kvikio: 1 when kvikio runs GPUDirect Storage (cuFile), 0 in its compatibility mode.")
    # tenants (YAML `tenants:`, kvtier/core/tenants.py)
    TENANT_HIT_BLOCKS = ("tenant_hit_blocks", TENANT, COUNTER, "tenant_hit_blocks",
                         "Blocks a tenant was served from a tier.")
    TENANT_STORED_BLOCKS = ("tenant_stored_blocks", TENANT, COUNTER, "tenant_stored_blocks",
                            "Blocks committed to a tier, charged to a tenant.")
    TENANT_EVICTED_BLOCKS = ("tenant_evicted_blocks", TENANT, COUNTER, "tenant_evicted_blocks",
                             "A tenant's blocks that left a tier.")
    TENANT_BYTES = ("gauge_tenant_bytes", TENANT, GAUGE, "tenant_bytes", "Bytes a tenant holds in a tier.")
    TENANT_QUOTAS_CLAMPED = ("tenant_quotas_clamped", TIER, None, None,
                             "Resizes of a tier whose tenants' quota sizes no longer fit it (scaled down).")
    TENANT_NOT_A_NAME = ("tenant_not_a_name", NONE, None, None,
                         "Reads of a request's tenant that is not a tenant name (counted as `other`).")
    # the controller and the scheduler
    LEASES_RELEASED = ("leases_released", NONE, None, None, "Leases released without a load.")
    N_LEASES_NOT_CHOSEN = ("n_leases_not_chosen", NONE, None, None, "Lookups vLLM did not load from.")
    ALLOC_MISMATCH = ("alloc_mismatch", NONE, None, None, "Allocations that did not match the lookup's hit.")
    STORE_PLAN_FAILED = ("store_plan_failed", NONE, None, None, "Steps whose store planning failed (not stored).")
    STORE_PLANNED_BLOCKS = ("store_planned_blocks", TIER, None, None, "Blocks planned to be stored into a tier.")
    NOT_OPEN_BLOCKS = ("not_open_blocks", TIER, None, None, "Blocks not stored: the tier is not open yet.")
    UNCOMMITTED_AT_CLOSE = ("uncommitted_at_close", NONE, None, None, "Stores still uncommitted at close.")
    PERSISTENT_OPEN_FAILED = ("persistent_open_failed", NONE, None, None, "Persistent tiers that failed to open.")
    IDENTITY_UNKNOWN = ("identity_unknown", NONE, None, None,
                        "Starts whose model identity is unknown: the persistent tiers stay closed.")
    LORA_PASSTHROUGH = ("lora_passthrough", NONE, None, None,
                        "Requests with a LoRA adapter: neither looked up nor stored in any tier.")
    STATE_WRITE_ERRORS = ("state_write_errors", NONE, None, None, "Failed writes of the state file.")
    HOOK_ERRORS = ("hook_errors", HOOK, None, None, "vLLM hooks that raised (a miss, never an escape).")
    INDEX_WRITE_ERRORS = ("index_write_errors", TIER, None, None, "Failed writes of an NVMe tier's index.")
    # the worker
    CPU_POOL_SHRUNK = ("cpu_pool_shrunk", NONE, None, None, "Workers whose CPU pool was shrunk to fit memory.")
    NVME_OPEN_FAILED = ("nvme_open_failed", NONE, None, None, "Workers whose NVMe tier failed to open.")
    LAYER_WAIT_FAILED = ("layer_wait_failed", NONE, None, None, "Layer-by-layer load waits that failed.")
    NVME_UNREPORTED_BLOCKS = ("nvme_unreported_blocks", NONE, None, None,
                              "NVMe writes not reported back at shutdown.")
    STORE_COPY_FAILED = ("store_copy_failed", NONE, None, None, "Blocks whose copy out of vLLM's KV cache failed.")
    STORES_DROPPED = ("stores_dropped", NONE, None, None, "Pending stores dropped (request gone or tier closed).")
    STORE_SETTLE_WAITS = ("store_settle_waits", NONE, None, None,
                          "Host waits for a store still reading GPU blocks vLLM hands out again (preemption, reuse).")
    STORE_BOUNCE_FULL = ("store_bounce_full", NONE, None, None,
                         "Store chunks of scattered rows copied run by run: the store bounce ring was still in use.")
    DEVICE_STORED_BLOCKS = ("device_stored_blocks", TIER, None, None,
                            "Blocks stored into a data file straight from device memory (GPUDirect Storage writes).")
    LOAD_COPY_FAILED = ("load_copy_failed", NONE, None, None, "Copies into vLLM's KV cache that failed.")
    BLOCKS_STORE_DROPPED = ("blocks_store_dropped", NONE, None, None, "Blocks whose store the worker dropped.")
    # lazy offload
    N_LAZY_SCANNED = ("n_lazy_scanned", NONE, None, None, "Blocks the lazy offloader looked at.")
    LAZY_LOST_BLOCKS = ("lazy_lost_blocks", NONE, None, None, "Blocks vLLM reused before the lazy offloader saved them.")
    LAZY_OFFLOAD_BLOCKS = ("lazy_offload_blocks", NONE, None, None, "Blocks the lazy offloader stored.")
    LAZY_UNWRITTEN_BLOCKS = ("lazy_unwritten_blocks", NONE, None, None, "Blocks left unwritten at the lazy drain.")
    # the request recorder
    RECORDED_REQUESTS = ("recorded_requests", NONE, None, None, "Requests written to the trace.")
    RECORD_DROPPED_REQUESTS = ("record_dropped_requests", NONE, None, None, "Requests the recorder dropped.")
    RECORD_REOPENS = ("record_reopens", NONE, None, None, "Reopens of the trace file.")
    RECORD_ROTATIONS = ("record_rotations", NONE, None, None, "Rotations of the trace file.")
    RECORD_ERRORS = ("record_errors", NONE, None, None, "Failed writes of the trace.")

    # kvtier's tiers under vLLM's own tiering (kvtier/vllm): each is a value of the `event` label of
    # EVENTS_METRIC, its key the label (the shared tier's lookups count LOOKUP_TIMEOUTS / _FAILURES)
    LOOKUPS_SERVER_DOWN = ("lookups_server_down", NATIVE, None, None,
                           "Shared tier lookups answered as misses: the server is down.")
    LOAD_MISSES = ("load_misses", NATIVE, None, None,
                   "Chunks found by lookup and gone at load (evicted, quarantined or lost).")
    EVICTED = ("evicted", NATIVE, None, None, "Chunks evicted from the NVMe tier to make room.")
    STORE_SKIPPED_FULL = ("store_skipped_full", NATIVE, None, None,
                          "Chunks not stored: the NVMe tier had no evictable room.")
    WRITE_ERRORS = ("write_errors", NATIVE, None, None, "NVMe chunks whose write failed.")
    READ_ERRORS = ("read_errors", NATIVE, None, None, "NVMe chunks whose read failed (not corrupt).")
    CORRUPT_CHUNKS = ("corrupt_chunks", NATIVE, None, None, "NVMe chunks that failed verification on read.")
    STORE_ERRORS = ("store_errors", NATIVE, None, None,
                    "Stores that failed (a hook raised, or the shared tier lost the blocks).")
    LOOKUP_ERRORS = ("lookup_errors", NATIVE, None, None, "Lookups whose hook raised.")
    LOAD_ERRORS = ("load_errors", NATIVE, None, None, "Loads whose hook raised.")
    INDEX_COMMIT_ERRORS = ("index_commit_errors", NATIVE, None, None, "NVMe index commits that raised.")

    def __init__(self, key: str, per: str, export: str | None, prom: str | None, help: str) -> None:
        self.key, self.per, self.export, self.prom, self.help = key, per, export, prom, help

    def at(self, where: str, tenant: str | None = None) -> str:
        """The key for one tier (or hook): `<key>.<where>`; per tenant `<key>.<where>|<tenant>`."""
        return f"{self.key}.{where}" if tenant is None else f"{self.key}.{where}|{tenant}"

    @classmethod
    def errors_of(cls, what: str) -> "Metric":
        """The native event of a failed `what` hook: lookup, load, store or index_commit."""
        return BY_KEY[f"{what}_errors"]

    @classmethod
    def exported(cls) -> list["Metric"]:
        """The members that are Prometheus series, in declaration order."""
        return [m for m in cls if m.export is not None]


BY_KEY: dict[str, Metric] = {m.key: m for m in Metric}


def base_of(key: str) -> str:
    """A stats key's counter part: 'hit_blocks.cpu' -> 'hit_blocks', 'obs:seconds_loaded.cpu' -> 'seconds_loaded'."""
    return key.removeprefix(OBS_PREFIX).partition(".")[0]


def declared(key: str) -> Metric | None:
    """The member a stats key belongs to, None for an undeclared one."""
    return BY_KEY.get(base_of(key))


def check_declared(key: str) -> None:
    """Raise for a key no member declares (the test suite counts through this: a typo'd or
    undeclared counter fails the test that counts it)."""
    if declared(key) is None:
        raise KeyError(f"counter {key!r} is not declared in kvtier/common/counters.py (Metric)")
