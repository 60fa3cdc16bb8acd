"""Pictures for notebook 12: which K/V block each cp rank holds at each ring step, the router's token counts per
expert, and the bytes and memory per rank of context and expert parallelism as the sizes change (the formulas of
docs/formulas.md §11–12, from `course_lib.parallel.context` and `course_lib.core.moe`; nothing is computed twice here).

`block_spans(comm)` (ring attention's own hook, `course_lib.parallel.context.block_spans`, re-exported here) marks
each ring step's block computation as a compute span in the traffic ledger — the window between posting the K/V
transfer and waiting for it — so `course_lib.core.plots.plot_timeline` can show the transfer overlapping the
computation.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from .. import context as C
from ..expert import expert_bytes_per_forward
from . import (  # noqa: F401  (re-exported: notebook 12)
    allgather_activation_bytes,
    block_spans,  # noqa: F401  (re-exported: notebook 12 draws with it)
    ring_activation_bytes,
)

CMAP = plt.get_cmap("tab10")


def plot_ring_steps(seq_len: int, cp: int, *, layouts=C.LAYOUTS):
    """One panel per layout: row = cp rank, column = ring step s; the cell shows the rank j = (r − s) mod cp whose
    K/V block rank r holds at step s, and how many of its (query, key) pairs the causal mask keeps."""
    fig, axes = plt.subplots(1, len(layouts), figsize=(4.6 * len(layouts), 0.7 + 0.55 * cp), squeeze=False)
    for ax, layout in zip(axes[0], layouts):
        pos = [C.positions(seq_len, cp, j, layout) for j in range(cp)]
        for r in range(cp):
            for s in range(cp):
                j = (r - s) % cp
                pairs = int((pos[r][:, None] >= pos[j][None, :]).sum())
                ax.add_patch(plt.Rectangle((s, cp - 1 - r), 0.95, 0.9, color=CMAP(j), alpha=0.25 + 0.75 * (pairs > 0)))
                ax.text(s + 0.47, cp - 1 - r + 0.45, f"K/V {j}\n{pairs} pairs", ha="center", va="center", fontsize=7)
        ax.set_xlim(0, cp)
        ax.set_ylim(0, cp)
        ax.set_xticks(np.arange(cp) + 0.47, [f"step {s}" for s in range(cp)])
        ax.set_yticks(np.arange(cp) + 0.45, [f"rank {r}" for r in reversed(range(cp))])
        ax.set_title(f"{layout}: block held at each step (T={seq_len}, cp={cp})", fontsize=9)
        ax.set_xlabel("ring step (a block moves one rank down per step)")
    fig.tight_layout()
    return fig


def plot_router_counts(counts, capacity: int, *, dropped: int, demand=None,
                       title: str = "Tokens routed to each expert"):
    """Bars of kept assignments per expert, the capacity as a line, the dropped count in the title; with `demand`
    (assignments the router asked of each expert), what overflowed the capacity as hatched bars above."""
    counts = np.asarray(counts)
    fig, ax = plt.subplots(figsize=(6, 2.8))
    if demand is not None:
        over = np.asarray(demand) - counts
        ax.bar(np.arange(len(counts)), over, bottom=counts, color="none", edgecolor="#C44E52", hatch="///",
               label="dropped (over capacity)")
    ax.bar(np.arange(len(counts)), counts, color=[CMAP(e % 10) for e in range(len(counts))])
    ax.axhline(capacity, color="k", ls="--", lw=1, label=f"capacity C = {capacity}")
    ax.set_xticks(np.arange(len(counts)), [f"expert {e}" for e in range(len(counts))], fontsize=8)
    ax.set_ylabel("assignments (tokens)")
    ax.set_title(f"{title} ({dropped} dropped)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_cp_explorer(seq_len: int = 4096, cp: int = 4, n_expert: int = 8, top_k: int = 2, *, micro_batch_size=1,
                     d_model=1024, n_head=16, elem=2):
    """Bytes and activation memory per rank for one attention layer (ring vs all-gathered K/V) as cp varies, and
    the expert all-to-all's bytes per rank for E experts, top-k, on ep = cp ranks (uniform routing)."""
    cps = [c for c in (1, 2, 4, 8, 16, 32) if seq_len % (2 * c) == 0]
    b, d, e = micro_batch_size, d_model, elem
    ring = [sum(C.ring_bytes_per_layer(b, seq_len, d, c, e).values()) for c in cps]
    gather = [sum(C.allgather_bytes_per_layer(b, seq_len, d, c, e).values()) for c in cps]
    mem_ring = [ring_activation_bytes(b, seq_len, d, n_head, c, e) for c in cps]
    mem_gather = [allgather_activation_bytes(b, seq_len, d, n_head, c, e) for c in cps]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.2))
    axes[0].plot(cps, np.array(ring) / 2**20, "o-", label="ring")
    axes[0].plot(cps, np.array(gather) / 2**20, "s--", label="all-gather K/V")
    axes[0].set_title(f"bytes sent per rank, one layer (T={seq_len})", fontsize=9)
    axes[0].set_ylabel("MiB")
    axes[1].plot(cps, np.array(mem_ring) / 2**20, "o-", label="ring")
    axes[1].plot(cps, np.array(mem_gather) / 2**20, "s--", label="all-gather K/V")
    axes[1].set_yscale("log")
    axes[1].set_title("attention activations saved per rank", fontsize=9)
    axes[1].set_ylabel("MiB (log)")
    for ax in axes[:2]:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cp")
        ax.axvline(cp, color="k", lw=0.8, ls=":")
        ax.legend(fontsize=8)
    eps = [p for p in (1, 2, 4, 8, 16) if n_expert % p == 0]
    tokens = b * seq_len // max(cp, 1)
    sent = []
    for p in eps:                       # uniform routing: k·N/p rows to every ep rank; backward sends the data again
        rows = [top_k * tokens / p] * p
        f = expert_bytes_per_forward(rows, rows, 0, d, e, n_expert // p)
        sent.append(2 * (f["dispatch"] + f["combine"]) + f["counts"])
    axes[2].bar([str(p) for p in eps], np.array(sent) / 2**20, color="#8172B3")
    axes[2].set_title(f"expert all-to-all per rank (E={n_expert}, k={top_k}, {tokens} tokens, uniform)", fontsize=9)
    axes[2].set_xlabel("ep")
    axes[2].set_ylabel("MiB per layer, fwd + bwd")
    fig.tight_layout()
    return fig


__all__ = ["plot_ring_steps", "plot_router_counts", "block_spans", "plot_cp_explorer", "ring_activation_bytes",
           "allgather_activation_bytes"]
