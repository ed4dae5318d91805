from pathlib import Path

import pytest

from kvtier.trace import default_trace

REPO = Path(__file__).resolve().parent.parent
TRACE = default_trace()  # the bundled trace unless KVTIER_TRACE names another


@pytest.fixture
def trace_path() -> Path:
    assert TRACE.is_file(), f"trace not found at {TRACE}"
    return TRACE
