"""A bad kvtier config under vLLM's OpenAI server (real vLLM, CPU build) stops the start with one
line, `kvtier: error: <file>: <field>: <cause>`, before vLLM sizes the KV cache or builds a
connector, with no kvtier traceback (issue 27 item 5).

On this build the check runs in `get_required_kvcache_layout`, after the model is loaded (vLLM 0.32
calls no connector method with the config earlier unless full CUDA graphs are on; see
connector/start_check.py). The engine core prints the line as it ends (vLLM's executor may log
its shutdown after it); vLLM's API server then prints its own "Engine core initialization
failed" traceback (vLLM's frames only) and, as it exits, the line again."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import server_util as S  # noqa: E402
import vllm_util as U  # noqa: E402

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not U.vllm_available(), reason="vLLM not installed")]

EXIT_S = 600          # a failed start on a loaded 2-core machine (about 40 s idle)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return U.build_tiny_llama(tmp_path_factory.mktemp("tinyllama"))


def _kvtier_dirs() -> list[str]:
    """The folders of kvtier's installed packages (a traceback frame in one is a kvtier traceback)."""
    import kvtier
    import kvtier.connector.config
    import kvtier.policies
    import kvtier.tiers
    mods = (kvtier, kvtier.connector.config, kvtier.policies, kvtier.tiers)
    return sorted({str(Path(m.__file__).resolve().parent) for m in mods})


def test_a_typo_in_the_yaml_stops_the_server_in_one_line(model_dir, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n  - name: cpu\n    kind: cpu\n    capacity_blocks: 64\n    evicton: lru\n")
    run = tmp_path / "run"
    srv = S.Server(model_dir, tmp_path / "server.log", S.kvtier_transfer_config(config=str(bad)),
                   env={"KVTIER_RUN_DIR": str(run)})
    try:
        rc = srv.proc.wait(timeout=EXIT_S)
    finally:
        srv.stop()
    text = (tmp_path / "server.log").read_text(errors="replace")
    lines = text.splitlines()
    line = f"kvtier: error: {bad}: tiers.0.evicton: unknown key"
    assert rc != 0, text[-3000:]
    # printed by the engine core as it ends, then again by the API server as it ends
    assert lines.count(line) == 2 and sum("evicton" in ln for ln in lines) == 2, text[-3000:]
    # the last line, but for the warning Python's resource tracker (another process) prints after it
    tracker = ("resource_tracker", "warnings.warn(")
    assert [ln for ln in lines if ln.strip() and not any(t in ln for t in tracker)][-1] == line, text[-3000:]
    assert list(run.iterdir()) == []            # the engine core's note to the API server was read and removed
    assert not [d for d in _kvtier_dirs() if f'File "{d}/' in text], text[-3000:]
    # refused before vLLM sized the KV cache or built a connector object
    assert "KV cache size" not in text and "Creating v1 connector" not in text, text[-3000:]
