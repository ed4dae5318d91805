import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TRACE = Path(os.environ.get("KVTIER_TRACE", REPO.parent / "shared" / "traces" / "mooncake_conversation.jsonl"))


@pytest.fixture
def trace_path() -> Path:
    if not TRACE.is_file():
        pytest.skip(f"trace not found at {TRACE}")
    return TRACE
