"""Crash-test worker: writes deterministic blocks into an NvmeTier, batch by batch, until killed.

    python tests/crash_worker.py run DIR SEED START [MAX_BATCHES]   # one life in this process
    python tests/crash_worker.py serve                              # fork server (see below)

Per batch: allocate -> write -> wait -> commit, then print ``C <i0>,<i1>,...`` (block indices of
seed SEED, flushed) — only after commit returned. Before evicting it prints ``E <indices>`` (intent),
so a kill mid-eviction never makes a reported block "missing". ``R <resident>`` once open.

`serve` imports everything once, then for each stdin line ``run DIR SEED START MAX`` forks a
child that does one life, prints ``PID <pid>`` and, when the child ends, ``EXIT <pid> <status>``. SIGUSR1 makes a child print every thread's stack to stderr.
That makes a trial cost milliseconds instead of a fresh interpreter + torch import.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

BLOCK_BYTES = 20000   # not a multiple of 4096: exercises padding + bounce buffers
CAPACITY = 48


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def life(directory: str, seed: int, start: int, max_batches: int) -> None:
    from kvtier.offline.blockgen import block_data, block_key, split_block_key
    from kvtier.policies.lru import LRU
    from kvtier.tiers.nvme import NvmeTier

    tier = NvmeTier("crash", directory, CAPACITY, BLOCK_BYTES, LRU(CAPACITY), io="posix", io_threads=2,
                    fingerprint={"model": "crash-test"})
    _say(f"R {tier.num_resident}")
    nxt = start
    for b in range(max_batches):
        n = 3 + b % 6
        if tier.num_free_slots < n:
            victims = []
            for v in tier.iter_free_blocks():
                victims.append(v.block_id)
                if len(victims) >= n - tier.num_free_slots:
                    break
            idx = [split_block_key(tier._key_of[s])[1] for s in victims]
            _say("E " + ",".join(map(str, idx)))
            tier.evict(victims)
        idx = list(range(nxt, nxt + n))
        nxt += n
        slots = tier.allocate([block_key(seed, i) for i in idx])
        res = tier.write(slots, [block_data(seed, i, BLOCK_BYTES) for i in idx]).wait()
        if not res.all_ok:
            _say("F " + "; ".join(res.errors))
            os._exit(3)
        tier.commit(slots)
        _say("C " + ",".join(map(str, idx)))
    tier.close()
    _say("DONE")


def serve() -> None:
    import kvtier.offline.blockgen  # noqa: F401 - warm the imports once
    import kvtier.policies.lru  # noqa: F401
    import kvtier.tiers.nvme  # noqa: F401
    _say("READY")
    for line in sys.stdin:
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "quit":
            break
        _, d, seed, start, mx = parts
        pid = os.fork()
        if pid == 0:
            faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test dumps a stuck child's stacks
            try:
                life(d, int(seed), int(start), int(mx))
                os._exit(0)
            except BaseException as e:  # report, never hang the test
                _say(f"F {type(e).__name__}: {e}")
                os._exit(2)
        _say(f"PID {pid}")
        _, status = os.waitpid(pid, 0)
        _say(f"EXIT {pid} {status}")


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve()
    else:
        life(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]) if len(sys.argv) > 5 else 10**9)
