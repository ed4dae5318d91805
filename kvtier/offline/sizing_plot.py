"""The `kvtier plan` PNG: hit ratio and TTFT saved by capacity, the configured tiers marked."""

from __future__ import annotations

import numpy as np

from kvtier.offline.sizing import Sizing, capacity_grid
from kvtier.common.units import format_size


def plot(rep: dict, sz: Sizing, path: str) -> dict:
    """Left: block and token hit ratio of one lru tier by its capacity (a band: the sampling
    error), Belady's MIN at a few points, the configured tiers' reach as vertical lines (fleet:
    per instance), each labelled on its own row. The x axis reaches every configured tier (past
    the unique blocks the curve is flat). Right: TTFT saved per request by capacity, at the
    prefill speed the trace states (measured by the server) or an assumed one, said in the title;
    fleet: what the shared tier adds. Returns {path, x_range_bytes, labels: [(name, x0, y0, x1, y1)]}
    with the labels' drawn extents (pixels)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        raise RuntimeError("--png needs matplotlib (pip install 'kvtier[plot]')") from None
    bb, bt = rep["block_bytes"], rep["block_tokens"]
    marks = []
    if "stack" in rep:
        marks = [(t["name"], t["reach_blocks"]) for t in rep["stack"]["tiers"]]
    elif "fleet" in rep:
        marks = [("local, per instance", rep["fleet"]["local_capacity_blocks"])]
    marks = [(n, c) for n, c in marks if c]
    top = max([sz.unique_blocks] + [int(c * 1.5) for _, c in marks])
    caps = capacity_grid(max(1, top), 160)
    caps = caps[caps >= sz.resolution()]
    hr = sz.hit_ratio(caps)
    tok = hr * sz.refs * bt / max(1, sz.input_tokens)
    x = caps * bb
    fmt = FuncFormatter(lambda v, _: format_size(v).replace(".00", ""))
    from matplotlib.ticker import FixedLocator, NullLocator

    def bytes_axis(a, lo: float, hi: float) -> None:
        a.set_xscale("log")
        a.xaxis.set_major_locator(FixedLocator([2.0 ** k for k in range(10, 61, 2) if lo / 4 <= 2.0 ** k <= hi * 4]))
        a.xaxis.set_minor_locator(NullLocator())
        a.xaxis.set_major_formatter(fmt)
        a.tick_params(axis="x", labelsize=8)
        a.grid(True, which="both", alpha=0.3)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    ax.plot(x, 100 * hr, color="C0", linewidth=2, label="block hits, lru")
    ax.plot(x, 100 * tok, color="C0", linestyle=":", label="token hits, lru")
    if sz.sample_rate < 1:
        e = sz.error()
        ax.fill_between(x, 100 * np.clip(hr - e, 0, 1), 100 * np.clip(hr + e, 0, 1), color="C0", alpha=0.15,
                        label=f"sampling error (rate {sz.sample_rate:g})")
    bel = rep.get("belady", [])
    if bel:
        bm = rep.get("belady_method") or {}
        err = 100 * bm.get("error", 0.0)
        ax.errorbar([b["capacity_blocks"] * bb for b in bel], [100 * b["hit_ratio"] for b in bel],
                    yerr=err if err else None, fmt="kx", markersize=8, capsize=3,
                    label="Belady (MIN, deepest-first)" + (f", sampled +/-{err:.1f}%" if err else ""))
    texts = []
    lo_x, hi_x = float(x[0]), float(x[-1])
    for i, (name, c) in enumerate(sorted(marks, key=lambda m: m[1])):   # one row per tier: never on each other
        xc = c * bb
        ax.axvline(xc, color=f"C{i + 1}", linestyle="--", linewidth=1)
        right = np.log(xc / lo_x) > 0.6 * np.log(hi_x / lo_x) if hi_x > lo_x else False
        texts.append((name, ax.text(xc, 0.04 + 0.075 * i, f" {name} {format_size(xc)} ", color=f"C{i + 1}",
                                    fontsize=8, va="bottom", ha="right" if right else "left",
                                    transform=ax.get_xaxis_transform(),
                                    bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1})))
    s = rep.get("suggestion")
    if s and "fleet" not in rep:
        ax.plot([s["capacity_blocks"] * bb], [100 * s["hit_ratio"]], "o", color="C3", label=f"suggested: {s['goal']}")
    bytes_axis(ax, float(x[0]), float(x[-1]))
    ax.set_xlabel(f"capacity ({format_size(bb)} blocks of {bt} tokens)")
    ax.set_ylabel("hit ratio (%)")
    ax.set_title(f"{rep['requests']} requests, {rep['unique_blocks']} unique blocks")
    ax.legend(fontsize=8, loc="upper left")
    if "fleet" in rep:
        f = rep["fleet"]
        sc = capacity_grid(max(1, sz.unique_blocks), 160)
        add = sz.hit_ratio(sc, shared=True)
        ax2.plot(sc * bb, 100 * (f["local_hit_ratio"] + add), color="C0", linewidth=2, label="fleet block hits")
        ax2.axhline(100 * f["local_hit_ratio"], color="gray", linestyle=":", label="no shared tier")
        if f["shared"]["capacity_blocks"]:
            ax2.axvline(f["shared"]["capacity_blocks"] * bb, color="C1", linestyle="--", linewidth=1,
                        label=f"{f['shared']['name']} configured")
        ax2.set_xlabel("shared tier capacity")
        ax2.set_ylabel("fleet hit ratio (%)")
        ax2.set_title(f"{f['instances']} instances, {f['routing']} routing")
        ax2.legend(fontsize=8, loc="upper left")
        bytes_axis(ax2, float(sc[0] * bb), float(sc[-1] * bb))
    else:
        cm = rep["cost_model"]
        bw = next(iter(cm["load_gbps"].values()), 20.0)
        src = cm.get("prefill_source", "")
        how = "measured by the server" if src.startswith("measured") else \
            "given" if src.startswith("--") else "assumed: pass --prefill-tokens-per-s"
        ttft = 1000 * hr * sz.refs * (bt / cm["prefill_tokens_per_s"] - bb / (bw * 1e9)) / max(1, sz.requests)
        ax2.plot(x, ttft, color="C2", linewidth=2)
        for i, (name, c) in enumerate(sorted(marks, key=lambda m: m[1])):
            ax2.axvline(c * bb, color=f"C{i + 1}", linestyle="--", linewidth=1)
        ax2.set_xlabel("capacity of one lru tier")
        ax2.set_ylabel("TTFT saved per request (ms, model)")
        ax2.set_title(f"prefill {cm['prefill_tokens_per_s']:.0f} tokens/s ({how}), loads at {bw:g} GB/s",
                      fontsize=10)
        bytes_axis(ax2, float(x[0]), float(x[-1]))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    r = fig.canvas.get_renderer()
    labels = [(n, *t.get_window_extent(r).extents.tolist()) for n, t in texts]
    lim = [float(v) for v in ax.get_xlim()]
    plt.close(fig)
    return {"path": path, "x_range_bytes": lim, "labels": labels}
