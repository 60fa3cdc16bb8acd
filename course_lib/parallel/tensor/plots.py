"""Pictures of notebook 06: which tp rank holds which slice of each weight (Megatron 1D), and which rank holds which
block of X, W and Y on the 1D, 2D, 2.5D and 3D grids. Both are drawn from the library's own layouts (`tp_plan`,
`Grid.layout`), so the picture is what the layers do."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from ...core.model import GPT
from .gpt import tp_plan
from .grid import grid_of
from .megatron import padded_vocab


def owner_map(rows: int, cols: int, dim: int, t: int, padded_rows: int | None = None) -> np.ndarray:
    """Which tp rank holds each element of a (rows, cols) weight split along `dim` (torch.chunk, as the layers
    do); a padded vocabulary is split with its padding, then cut back to `rows`."""
    own = np.zeros((padded_rows or rows, cols))
    n = own.shape[dim] // t
    for r in range(t):
        (own[r * n:(r + 1) * n, :] if dim == 0 else own[:, r * n:(r + 1) * n])[...] = r
    return own[:rows]


def plot_weight_owners(cfg, t: int):
    """One panel per weight of a block (and the head): the slice each of t ranks holds, by `tp_plan`'s style."""
    H = cfg.d_model
    styles = dict(tp_plan(GPT(cfg)))
    sketch = {"attn.wq / wk / wv": ("blocks.0.attn.wq", (H, H)), "attn.wo": ("blocks.0.attn.wo", (H, H)),
              "mlp.fc_in": ("blocks.0.mlp.fc_in", (4 * H, H)), "mlp.fc_out": ("blocks.0.mlp.fc_out", (H, 4 * H)),
              "lm_head": ("lm_head", (cfg.vocab_size, H))}
    fig, axes = plt.subplots(1, len(sketch), figsize=(13, 3.2), gridspec_kw={"width_ratios": [1, 1, 1, 4, 1]})
    cmap = plt.get_cmap("tab10", t)
    for ax, (label, (name, shape)) in zip(axes, sketch.items()):
        dim = 1 if styles[name] == "rowwise" else 0
        padded = padded_vocab(cfg.vocab_size, t) if name == "lm_head" else None
        ax.imshow(owner_map(*shape, dim, t, padded), cmap=cmap, vmin=-0.5, vmax=t - 0.5, aspect="auto",
                  interpolation="nearest")
        ax.set_title(f"{label}\n{styles[name]} ({shape[0]} × {shape[1]})", fontsize=9)
        ax.set_xlabel("in features")
    axes[0].set_ylabel("out features (weight rows)")
    fig.suptitle(f"Megatron 1D, t = {t}: the slice of each weight every rank holds", y=1.02)
    fig.tight_layout()
    fig.legend(handles=[Patch(color=cmap(r), label=f"rank {r}") for r in range(t)], loc="upper center",
               bbox_to_anchor=(0.5, 0.0), ncol=t, fontsize=8)
    return fig


GRIDS = {"1D (P = 4)": ("1D", 4, 1), "2D (q = 2)": ("2D", 4, 1), "2.5D (q = 2, d = 2)": ("2.5D", 8, 2),
         "3D (q = 2)": ("3D", 8, 1)}


def plot_grid_layouts(grids: dict = GRIDS, size: int = 8):
    """Rows: grids {label: (kind, ranks, depth)}; columns: X, W, Y of a size × size matmul; each block labelled
    with the ranks that hold it ("all" when every rank does)."""
    cmap = plt.get_cmap("tab10", 8)
    fig, axes = plt.subplots(len(grids), 3, figsize=(9, 2.75 * len(grids)), squeeze=False)
    for row, (label, (kind, P, d)) in enumerate(grids.items()):
        for col, (role, letter) in enumerate((("input", "X"), ("weight", "W"), ("output", "Y"))):
            holders = {}                                   # (rows, cols) of the matrix -> the ranks holding them
            for rank in range(P):
                rows, cols = grid_of(kind, P, rank, depth=d).layout(role, (size, size))
                holders.setdefault((rows.start, rows.stop, cols.start, cols.stop), []).append(rank)
            img = np.full((size, size), np.nan)
            ax = axes[row, col]
            for (r0, r1, c0, c1), ranks in holders.items():
                img[r0:r1, c0:c1] = ranks[0] if len(ranks) < P else np.nan
                ax.text((c0 + c1 - 1) / 2, (r0 + r1 - 1) / 2, "all" if len(ranks) == P else "/".join(map(str, ranks)),
                        ha="center", va="center", fontsize=7, color="black" if len(ranks) == P else "white")
            ax.imshow(img, cmap=cmap, vmin=-0.5, vmax=7.5, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(f"{label}: {letter}", fontsize=9)
    fig.suptitle("Which rank holds which block of X (tokens × in), W (in × out) and Y (tokens × out); "
                 "'a/b': the same block on both", fontsize=10)
    fig.tight_layout()
    return fig
