"""One vLLM instance (CPU, one process) driven over JSON lines: a fleet member for test_e2e_fleet.

    python fleet_driver.py '{"model": DIR, "kv": {"config": YAML} | null, "max_num_seqs": 8,
                             "prefix_caching": false}'

Protocol on stdout (vLLM's own output goes to stderr): one JSON object a line.
- started: {"ready": true}
- {"op": "generate", "prompts": [[ids]], "max_tokens": 8, "pause_after": N | null}
    greedy tokens per prompt; with pause_after, once N requests have finished it writes
    {"paused": N} and waits for any line on stdin before it steps on (the test acts meanwhile);
    with pause_tokens: N, the same once the first request has N tokens (and is still running);
    until it pauses, every step waits for the shared tier's lookups in flight (a fixed order);
    answers {"tokens": [[ids]], "stats": ...}
- {"op": "drain"}: waits until every shared-tier write in flight has reached the server
- {"op": "stats"}: {"stats": {"sched": totals, "worker": totals, "shared": the tier's stats}}
- {"op": "quit"}: shuts vLLM down, answers {"bye": true, "stats": ...}
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

_OUT = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # anything else printed goes to stderr


def say(obj: dict) -> None:
    _OUT.write(json.dumps(obj) + "\n")
    _OUT.flush()


def stats() -> dict:
    out: dict = {"sched": {}, "worker": {}, "shared": {}}
    if ARGS.get("kv") is None:
        return out
    import kvtier.connector as C
    for c in C.live_connectors("scheduler"):
        if c.sched is not None:
            out["sched"] = dict(c.sched.totals)
            if c.sched.ctrl.shared is not None:
                out["shared"] = c.sched.tiers[c.sched.ctrl.shared].stats()
    for c in C.live_connectors("worker"):
        if c.worker is not None:
            out["worker"] = dict(c.worker.totals)
    return out


def _settle() -> None:
    """Wait until the shared tier's lookups in flight are answered: vLLM skips a request whose
    lookup is pending and schedules the next, so without this the order would follow the server."""
    import kvtier.connector as C
    for c in C.live_connectors("scheduler"):
        if c.sched is not None and c.sched.ctrl.shared is not None:
            for fut, _, _ in list(c.sched.tiers[c.sched.ctrl.shared]._probes.values()):
                fut.result(timeout=60)


def _pause(done: int) -> None:
    """Tell the test, once the shared tier's lookups in flight are answered; wait for its go."""
    _settle()
    say({"paused": done})
    if not sys.stdin.readline():
        raise SystemExit("stdin closed")


def generate(llm, prompts: list[list[int]], max_tokens: int, pause_after: int | None,
             pause_tokens: int | None = None) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    global SEQ
    eng = llm.llm_engine
    ids = []
    for p in prompts:
        SEQ += 1
        rid = f"r{SEQ}"
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.CUMULATIVE)
        eng.add_request(rid, TokensPrompt(prompt_token_ids=p), sp)
        ids.append(rid)
    done: dict[str, list[int]] = {}
    first = 0   # tokens of the first request so far
    paused = pause_after is None and pause_tokens is None
    while eng.has_unfinished_requests():
        if not paused:
            _settle()   # requests are scheduled in the order they were added
        for o in eng.step():
            if o.request_id == ids[0]:
                first = len(o.outputs[0].token_ids)
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
        if paused:
            continue
        if pause_after is not None and len(done) >= pause_after:
            paused = True
            _pause(len(done))
        elif pause_tokens is not None and first >= pause_tokens and ids[0] not in done:
            paused = True   # the first request is still running: nothing after it has started
            _pause(len(done))
    return [done[r] for r in ids]


def drain() -> None:
    import kvtier.connector as C
    for c in C.live_connectors("worker"):
        if c.worker is not None and c.worker.shared is not None:
            c.worker.shared.drain()


def main() -> None:
    import vllm_util as U

    kw = {"max_num_seqs": int(ARGS.get("max_num_seqs", 8)),
          "enable_prefix_caching": bool(ARGS.get("prefix_caching", False))}
    kv = U.kvtier_config(**ARGS["kv"]) if ARGS.get("kv") is not None else None
    llm = U.make_llm(ARGS["model"], kv, **kw)
    say({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "generate":
            toks = generate(llm, cmd["prompts"], int(cmd.get("max_tokens", 8)), cmd.get("pause_after"),
                            cmd.get("pause_tokens"))
            say({"tokens": toks, "stats": stats()})
        elif op == "drain":
            drain()
            say({"drained": True, "stats": stats()})
        elif op == "stats":
            say({"stats": stats()})
        elif op == "quit":
            st = stats()
            U.shutdown(llm)
            say({"bye": True, "stats": st})
            return
        else:
            raise SystemExit(f"unknown op {op!r}")


SEQ = 0
ARGS = json.loads(sys.argv[1])

if __name__ == "__main__":
    main()
