"""A `SupportsHMA` KV connector that never matches and records how vLLM ends requests: the sibling
of kvtier under MultiConnector in tests/test_e2e_hybrid.py (vLLM keeps its hybrid KV-cache manager on
only when every child supports it)."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                 SupportsHMA)

FINISHED_ALL_GROUPS: list[tuple] = []


class HMARecorder(KVConnectorBase_V1, SupportsHMA):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, None]:
        FINISHED_ALL_GROUPS.append(tuple(list(b) for b in block_ids))
        return False, None
