"""Deterministic generator of Mooncake-format workloads of documented shapes.

Each shape builds token streams out of labelled *segments* (a shared system prompt, a document,
a user turn, a model answer, a tool result); a request's input is a prefix of one stream. The
stream is cut into ``block_tokens``-token blocks and each block gets a chained id: the id of
(parent id, content of the block), assigned in order of first appearance, so a block id stands
for its whole prefix as in the Mooncake trace. A partial last block has content unique to the
request (its tokens change when the stream grows). Timestamps are ms; everything is drawn
from ``random.Random(seed)``, so a (shape, seed, params) triple always gives the same trace.

Shapes (``SHAPES``; parameters are the keyword arguments of each function):

- ``agent``: long-context agent sessions. A session starts with one of a few shared agent
  system prompts and a task, then loops: the model acts (output tokens), a tool answers
  (tokens appended), the next step re-sends the whole context, until the context reaches
  100k+ tokens. Some steps spawn a sub-agent: a short session with its own shared sub-agent
  prompt whose final answer is appended to the parent's context.
- ``chat``: multi-turn chat with think time: a conversation re-sends its history each turn,
  after a lognormal think time; a few shared system prompts (Zipf popularity).
- ``rag``: retrieval-augmented QA over a shared corpus: system prompt + top-k documents
  (Zipf popularity, the most relevant first) + question; sometimes a follow-up turn.
- ``api``: single-turn API calls: one of many applications' shared system prompts (with
  few-shot examples; Zipf popularity) + a unique user input.
- ``mix``: the four shapes at once, merged by time.
- ``tenants``: two tenants on one cache, one tenant's burst over the other's steady traffic
  (each request carries its ``tenant``).

Tuning vs evaluation: policies in kvtier were developed on ``TUNING_SEEDS`` only; the figures
in docs/policies.md are on ``EVAL_SEEDS`` (and on the bundled Mooncake trace).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import random
from typing import Callable, Iterable

from kvtier.offline.trace import Request

TUNING_SEEDS = (0,)
EVAL_SEEDS = (1, 2)


class _Blocks:
    """Chained block ids: id(parent, content label), assigned in order of first appearance."""

    def __init__(self, block_tokens: int) -> None:
        self.bt = block_tokens
        self.ids: dict[tuple, int] = {}
        self.uniq = 0

    def chain(self, segments: list[tuple[object, int]]) -> list[int]:
        """Block ids of the stream `segments` = [(label, tokens), ...] (the last block may be partial)."""
        bt, ids = self.bt, self.ids
        out: list[int] = []
        parent = -1
        content: list[tuple[object, int, int]] = []   # (label, offset in segment, tokens) of the current block
        fill = 0
        for label, n in segments:
            off = 0
            while n > 0:
                take = min(n, bt - fill)
                content.append((label, off, take))
                fill += take
                off += take
                n -= take
                if fill == bt:
                    key = (parent, tuple(content))
                    b = ids.get(key)
                    if b is None:
                        b = ids[key] = len(ids)
                    out.append(b)
                    parent, content, fill = b, [], 0
        if fill:
            self.uniq += 1       # a partial block: unique content
            key = (parent, ("partial", self.uniq))
            out.append(ids.setdefault(key, len(ids)))
        return out


def _zipf(rng: random.Random, n: int, s: float) -> int:
    """An index in [0, n) with P(i) ~ 1 / (i + 1)^s."""
    # inverse transform on the continuous approximation (fast, deterministic)
    if s == 1.0:
        x = math.exp(rng.random() * math.log(n + 1)) - 1
    else:
        a = 1.0 - s
        x = ((n + 1) ** a - 1) * rng.random()
        x = (x + 1) ** (1 / a) - 1
    return min(n - 1, int(x))


def _lognorm(rng: random.Random, median: float, sigma: float, lo: float = 1.0, hi: float = 1e12) -> float:
    return min(hi, max(lo, median * math.exp(sigma * rng.gauss(0.0, 1.0))))


def _req(blocks: _Blocks, t: float, segments: list[tuple[object, int]], out_tokens: int) -> Request:
    return Request(round(t), sum(n for _, n in segments), int(out_tokens), tuple(blocks.chain(segments)))


def agent(seed: int = 0, sessions: int = 24, duration_s: float = 3600.0, prompts: int = 3,
          prompt_tokens: int = 12000, target_tokens: tuple[int, int] = (100_000, 160_000),
          tool_tokens: float = 2500.0, act_tokens: float = 300.0, step_s: float = 8.0,
          subagent_p: float = 0.08, sub_steps: tuple[int, int] = (4, 12), block_tokens: int = 512,
          _blocks: _Blocks | None = None, _tag: str = "agent") -> list[Request]:
    """Long-context agent sessions with sub-agents.

    `sessions` start uniformly over `duration_s`; each picks one of `prompts` shared system
    prompts of `prompt_tokens` (Zipf 1.0) plus a 500-3000-token task, then steps until its
    context reaches a target drawn uniformly in `target_tokens`. A step: the model acts
    (lognormal, median `act_tokens`), a tool answers (lognormal, median `tool_tokens`,
    sigma 1), the next request (after lognormal `step_s`, sigma 0.5) re-sends the context.
    With probability `subagent_p` a step spawns a sub-agent: `sub_steps` steps on its own
    shared sub-agent prompt (4k tokens) + a 1-4k-token brief, running before the parent's next
    step; its last answer (about 1k tokens) becomes the parent's tool result.
    """
    rng = random.Random(f"agent/{seed}")
    blocks = _blocks or _Blocks(block_tokens)
    out: list[Request] = []
    for sid in range(sessions):
        t = rng.uniform(0, duration_s) * 1000.0
        p = _zipf(rng, prompts, 1.0)
        ctx: list[tuple[object, int]] = [((_tag, "sys", p), prompt_tokens), ((_tag, sid, "task"), rng.randint(500, 3000))]
        target = rng.randint(*target_tokens)
        step = 0
        while sum(n for _, n in ctx) < target:
            act = int(_lognorm(rng, act_tokens, 0.7, 20, 4000))
            out.append(_req(blocks, t, ctx, act))
            ctx.append(((_tag, sid, step, "act"), act))
            t += _lognorm(rng, step_s, 0.5, 0.5, 120) * 1000.0
            if rng.random() < subagent_p:
                sub = [((_tag, "subsys", p), 4000), ((_tag, sid, step, "brief"), rng.randint(1000, 4000))]
                for j in range(rng.randint(*sub_steps)):
                    sa = int(_lognorm(rng, act_tokens, 0.7, 20, 4000))
                    out.append(_req(blocks, t, sub, sa))
                    sub.append(((_tag, sid, step, "sub", j, "act"), sa))
                    sub.append(((_tag, sid, step, "sub", j, "tool"), int(_lognorm(rng, tool_tokens / 2, 1.0, 50, 20000))))
                    t += _lognorm(rng, step_s, 0.5, 0.5, 120) * 1000.0
                ctx.append(((_tag, sid, step, "subresult"), rng.randint(500, 1500)))
            else:
                ctx.append(((_tag, sid, step, "tool"), int(_lognorm(rng, tool_tokens, 1.0, 50, 30000))))
            step += 1
    return sorted(out, key=lambda r: r.timestamp)


def chat(seed: int = 0, conversations: int = 3000, duration_s: float = 3600.0, prompts: int = 20,
         prompt_tokens: tuple[int, int] = (300, 3000), turns_mean: float = 4.0, user_tokens: float = 150.0,
         answer_tokens: float = 400.0, think_s: float = 45.0, block_tokens: int = 512,
         _blocks: _Blocks | None = None, _tag: str = "chat") -> list[Request]:
    """Multi-turn chat with think time.

    `conversations` start uniformly over `duration_s` on one of `prompts` shared system prompts
    (Zipf 1.1, lengths uniform in `prompt_tokens`); the number of turns is geometric with mean
    `turns_mean`; user messages are lognormal (median `user_tokens`, sigma 1), answers lognormal
    (median `answer_tokens`, sigma 0.8); between an answer and the next turn the user thinks
    for a lognormal time (median `think_s`, sigma 1). Every turn re-sends the whole history.
    """
    rng = random.Random(f"chat/{seed}")
    blocks = _blocks or _Blocks(block_tokens)
    plen = [rng.randint(*prompt_tokens) for _ in range(prompts)]
    out: list[Request] = []
    for cid in range(conversations):
        t = rng.uniform(0, duration_s) * 1000.0
        p = _zipf(rng, prompts, 1.1)
        ctx: list[tuple[object, int]] = [((_tag, "sys", p), plen[p])]
        turn = 0
        while True:
            ctx.append(((_tag, cid, turn, "user"), int(_lognorm(rng, user_tokens, 1.0, 5, 20000))))
            ans = int(_lognorm(rng, answer_tokens, 0.8, 5, 4000))
            out.append(_req(blocks, t, ctx, ans))
            ctx.append(((_tag, cid, turn, "answer"), ans))
            turn += 1
            if rng.random() < 1.0 / turns_mean:
                break
            t += (ans / 50.0 + _lognorm(rng, think_s, 1.0, 2, 3600)) * 1000.0
    return sorted(out, key=lambda r: r.timestamp)


def rag(seed: int = 0, requests: int = 8000, duration_s: float = 3600.0, corpus: int = 2000,
        doc_tokens: tuple[int, int] = (1000, 6000), top_k: int = 4, zipf_s: float = 0.9,
        prompt_tokens: int = 800, followup_p: float = 0.3, think_s: float = 30.0, block_tokens: int = 512,
        _blocks: _Blocks | None = None, _tag: str = "rag") -> list[Request]:
    """Retrieval-augmented generation over shared documents.

    `requests` questions arrive uniformly over `duration_s`. Each: a shared system prompt of
    `prompt_tokens`, then `top_k` distinct documents of a `corpus` (Zipf `zipf_s` popularity,
    lengths uniform in `doc_tokens`), most relevant first, then a question (lognormal, median
    60 tokens). With probability `followup_p` a follow-up question comes after a lognormal
    think time (median `think_s`), re-sending the context and the first answer.
    """
    rng = random.Random(f"rag/{seed}")
    blocks = _blocks or _Blocks(block_tokens)
    dlen = [rng.randint(*doc_tokens) for _ in range(corpus)]
    out: list[Request] = []
    for qid in range(requests):
        t = rng.uniform(0, duration_s) * 1000.0
        docs: list[int] = []
        while len(docs) < top_k:
            d = _zipf(rng, corpus, zipf_s)
            if d not in docs:
                docs.append(d)
        ctx: list[tuple[object, int]] = [((_tag, "sys"), prompt_tokens)] + [((_tag, "doc", d), dlen[d]) for d in docs]
        ctx.append(((_tag, qid, "q"), int(_lognorm(rng, 60, 0.7, 5, 2000))))
        ans = int(_lognorm(rng, 250, 0.7, 10, 3000))
        out.append(_req(blocks, t, ctx, ans))
        if rng.random() < followup_p:
            ctx.append(((_tag, qid, "a"), ans))
            ctx.append(((_tag, qid, "q2"), int(_lognorm(rng, 40, 0.7, 5, 2000))))
            t += (ans / 50.0 + _lognorm(rng, think_s, 1.0, 2, 1800)) * 1000.0
            out.append(_req(blocks, t, ctx, int(_lognorm(rng, 250, 0.7, 10, 3000))))
    return sorted(out, key=lambda r: r.timestamp)


def api(seed: int = 0, requests: int = 20000, duration_s: float = 3600.0, apps: int = 200,
        prompt_tokens: tuple[int, int] = (500, 8000), zipf_s: float = 1.0, input_tokens: float = 400.0,
        block_tokens: int = 512, _blocks: _Blocks | None = None, _tag: str = "api") -> list[Request]:
    """Single-turn API calls with shared system prompts.

    `requests` calls arrive uniformly over `duration_s`; each uses one of `apps` applications
    (Zipf `zipf_s` popularity), whose shared system prompt with few-shot examples has a length
    uniform in `prompt_tokens`, followed by a unique user input (lognormal, median
    `input_tokens`, sigma 1.2). Outputs are short (lognormal, median 150).
    """
    rng = random.Random(f"api/{seed}")
    blocks = _blocks or _Blocks(block_tokens)
    plen = [rng.randint(*prompt_tokens) for _ in range(apps)]
    out: list[Request] = []
    for rid in range(requests):
        t = rng.uniform(0, duration_s) * 1000.0
        a = _zipf(rng, apps, zipf_s)
        ctx = [((_tag, "sys", a), plen[a]), ((_tag, rid), int(_lognorm(rng, input_tokens, 1.2, 5, 30000)))]
        out.append(_req(blocks, t, ctx, int(_lognorm(rng, 150, 0.8, 1, 4000))))
    return sorted(out, key=lambda r: r.timestamp)


def mix(seed: int = 0, block_tokens: int = 512, scale: float = 0.5) -> list[Request]:
    """The four shapes at once, each at `scale` of its default size, merged by time."""
    blocks = _Blocks(block_tokens)
    reqs = (agent(seed, sessions=max(1, int(24 * scale)), _blocks=blocks)
            + chat(seed, conversations=max(1, int(3000 * scale)), _blocks=blocks)
            + rag(seed, requests=max(1, int(8000 * scale)), _blocks=blocks)
            + api(seed, requests=max(1, int(20000 * scale)), _blocks=blocks))
    return sorted(reqs, key=lambda r: r.timestamp)


def tenants(seed: int = 0, duration_s: float = 600.0, steady_requests: int = 1200, apps: int = 12,
            prompt_tokens: tuple[int, int] = (2000, 6000), burst_requests: int = 1500,
            burst_tokens: tuple[int, int] = (4000, 12000), burst: tuple[float, float] = (0.3, 0.7),
            burst_repeat: int = 2, block_tokens: int = 512) -> list[Request]:
    """Two tenants on one cache: one tenant's burst over the other's steady traffic.

    Tenant ``steady``: `steady_requests` API calls spread over `duration_s` on `apps` shared
    system prompts (the ``api`` shape: Zipf 1.0, lengths uniform in `prompt_tokens`). Tenant
    ``burst``: `burst_requests` requests in the `burst` fraction of the run: documents (lengths
    uniform in `burst_tokens`) arriving uniformly, each sent `burst_repeat` times, 1-10 s apart,
    then never again (so a frequency-aware policy sees them as reused too). Each request carries
    its ``tenant``; their blocks are disjoint (as with vLLM's per-tenant ``cache_salt``).
    """
    from dataclasses import replace
    rng = random.Random(f"tenants/{seed}")
    blocks = _Blocks(block_tokens)
    out = [replace(r, tenant="steady") for r in api(seed, requests=steady_requests, duration_s=duration_s, apps=apps,
                                                     prompt_tokens=prompt_tokens, _blocks=blocks, _tag="steady")]
    lo, hi = burst[0] * duration_s * 1000.0, burst[1] * duration_s * 1000.0
    rep = max(1, int(burst_repeat))
    for i in range(burst_requests // rep):
        seg = [(("burst", i), rng.randint(*burst_tokens))]
        t = rng.uniform(lo, hi)
        for _ in range(rep):
            out.append(replace(_req(blocks, t, seg, 100), tenant="burst"))
            t += rng.uniform(1000.0, 10000.0)
    return sorted(out, key=lambda r: r.timestamp)


SHAPES: dict[str, Callable[..., list[Request]]] = {"agent": agent, "chat": chat, "rag": rag, "api": api, "mix": mix,
                                                   "tenants": tenants}


def generate(shape: str, seed: int = 0, block_tokens: int = 512, **params) -> list[Request]:
    """The requests of workload `shape` (one of SHAPES) for `seed`."""
    if shape not in SHAPES:
        raise ValueError(f"unknown workload shape {shape!r}; known: {', '.join(SHAPES)}")
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
    return SHAPES[shape](seed=seed, block_tokens=block_tokens, **params)


def write_trace(reqs: Iterable[Request], path: str | os.PathLike, block_tokens: int | None = None) -> int:
    """Write Mooncake JSONL (gzipped when the name ends in .gz); `block_tokens`, when given, goes on
    every line (kvtier.offline.trace reads it). Returns the number of lines."""
    opener = gzip.open if os.fspath(path).endswith(".gz") else open
    extra = {} if block_tokens is None else {"block_tokens": int(block_tokens)}
    n = 0
    with opener(path, "wt", encoding="utf-8") as f:
        for r in reqs:
            ten = {} if r.tenant is None else {"tenant": r.tenant}
            f.write(json.dumps({"timestamp": int(r.timestamp), "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids), **ten, **extra}) + "\n")
            n += 1
    return n


def stats(reqs: list[Request], block_tokens: int = 512) -> dict:
    """Shape statistics: requests, block refs, unique blocks, mean/max input tokens, share of
    block refs that were seen before (the infinite-cache hit ratio)."""
    seen: set[int] = set()
    again = refs = 0
    for r in reqs:
        for h in r.hash_ids:
            refs += 1
            if h in seen:
                again += 1
            else:
                seen.add(h)
    n = len(reqs)
    return {"requests": n, "block_refs": refs, "unique_blocks": len(seen),
            "mean_input_tokens": sum(r.input_length for r in reqs) / n if n else 0.0,
            "max_input_tokens": max((r.input_length for r in reqs), default=0),
            "reuse_ratio": again / refs if refs else 0.0,
            "duration_s": (reqs[-1].timestamp - reqs[0].timestamp) / 1000.0 if n else 0.0}
