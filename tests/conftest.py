from pathlib import Path

import pytest

from kvtier.offline.trace import default_trace

REPO = Path(__file__).resolve().parent.parent
TRACE = default_trace()  # the bundled trace unless KVTIER_TRACE names another


@pytest.fixture
def trace_path() -> Path:
    assert TRACE.is_file(), f"trace not found at {TRACE}"
    return TRACE


# -- real redis-server fixtures (tests/redis_util.py). A server that will not start fails the test
# (one line naming the cause, then the server log's tail), it is never skipped.

def _redis_util():
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import redis_util
    return redis_util


def _redis_started(obj):
    try:
        return obj.start()
    except _redis_util().HarnessError as e:
        msg = str(e)
    obj.close()
    pytest.fail(msg, pytrace=False)


@pytest.fixture(scope="session")
def redis_server():
    """One plain redis-server for the session (maxmemory 256mb, allkeys-lru). Shared: a test that
    needs an empty db calls FLUSHALL itself; prefer unique keys otherwise."""
    s = _redis_started(_redis_util().RedisServer(maxmemory="256mb"))
    yield s
    s.close()


@pytest.fixture(scope="session")
def redis_cluster():
    """A 3-master Redis Cluster for the session (`url`, `startup_nodes`, `client()`). Shared: a test
    that needs it empty runs FLUSHALL on every node (`for n in c.nodes: n.client().flushall()`)."""
    cl = _redis_started(_redis_util().RedisCluster3())
    yield cl
    cl.close()


@pytest.fixture
def redis_factory():
    """Start extra servers for one test: `redis_factory(password=..., acl_user=(name, pw), tls=True,
    maxmemory="64mb", ...)` -> started RedisServer (RedisServer's kwargs); all closed after the test."""
    made = []

    def start(**kw):
        s = _redis_util().RedisServer(**kw)
        made.append(s)
        return _redis_started(s)

    yield start
    for s in made:
        s.close()


# -- vLLM end-to-end (tests/vllm_util.py): a tiny random model built at test time, no downloads.

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama for the module, vLLM's test environment set (a module that needs
    another model defines its own `model_dir`)."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import vllm_util
    vllm_util.set_env()
    return vllm_util.build_tiny_llama(tmp_path_factory.mktemp("tinyllama"))


@pytest.fixture(autouse=True)
def _declared_counters_only(monkeypatch):
    """Every count in a test goes through `check_declared`: counting a name `Metric` does not
    declare (kvtier/common/counters.py) fails fast instead of making a series nobody exports."""
    from kvtier.core.plan import Counters
    from kvtier.common.counters import check_declared
    count = Counters.count

    def strict(self, key, v=1):
        check_declared(key)
        count(self, key, v)

    monkeypatch.setattr(Counters, "count", strict)
