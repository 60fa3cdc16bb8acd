"""Context parallelism from scratch: each rank of the `cp` group holds T/cp of every sequence, and causal attention
is computed exactly by passing K/V blocks around the ring (ring attention), forward and backward.

Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite Context", arXiv 2310.01889
(2023); Megatron-LM's context parallelism (Korthikanti et al.'s successor; NVIDIA, 2024); Llama 3 (Dubey et al.,
arXiv 2407.21783, §3.3.2) trained its long-context stage with CP = 16 and the zig-zag split below. The online
softmax that merges partial results is Milakov & Gimelshein, arXiv 1805.02867 (2018), as FlashAttention uses it.

    cp = 4, T = 16, contiguous:   rank 0: t 0–3    rank 1: t 4–7    rank 2: t 8–11    rank 3: t 12–15
            zig-zag (2 chunks):   rank 0: 0–1 14–15   rank 1: 2–3 12–13   rank 2: 4–5 10–11   rank 3: 6–7 8–9

With a causal mask the contiguous split is unfair — rank 3's queries see all 16 keys, rank 0's only 4 — so the
ring's steps wait for the slowest rank. The zig-zag split gives every rank one early and one late chunk: the same
number of visible (query, key) pairs on every rank (`visible_pairs`).

Forward on rank r, ring step s = 0 … cp−1: this rank holds the K/V block of rank j = (r − s) mod cp (its own at
s = 0); it starts sending that block to rank r+1 and receiving the next from r−1, computes its queries against the
block it holds — S = Q·Kⱼᵀ/√d_h, masked by global positions — and merges with the online softmax:

    m' = max(m, rowmax S)      l ← l·e^(m−m') + rowsum e^(S−m')      o ← o·e^(m−m') + e^(S−m')·Vⱼ      m ← m'
    output O = o / l,   kept for backward: O and the log-sum-exp m + log l (not the T×T probabilities)

Backward (FlashAttention's, per block): D = rowsum(dO ∘ O), P = e^(S − lse), dV_j += Pᵀ·dO, dS = P ∘ (dO·V_jᵀ − D),
dQ += dS·K_j/√d_h, dK_j += dSᵀ·Q/√d_h; as in forward, the block's K and V move on to the next rank while this rank
computes with them, and its dK, dV accumulators follow once this rank has added its part; after the last step dK,
dV take one more hop home. The hooks are public: `rotate` (one hop, a `Transfer` to wait for) and `block_spans`
(ring attention logs each step's block computation in the ledger, for timelines and per-rank work). Bytes each rank
sends per attention layer (docs/formulas.md §11):

    forward   2·(cp − 1) blocks          backward   4·(cp − 1) + 2 blocks,     a block = b·(T/cp)·d·e bytes
    (K and V, cp − 1 hops)              (K, V, dK, dV, cp − 1 hops; then dK, dV home)

Compared with all-gathering K/V (Llama 3's choice: one all-gather of K and V, 2·(cp−1)·block bytes forward, a
reduce-scatter of dK, dV backward), the ring sends as much but holds one remote block at a time instead of all cp.

The package's one other module, `plots`, draws notebook 12's pictures (ring steps, router counts, bytes and memory per
rank of context and expert parallelism).
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn as nn

from ...core.handles import attach, inherit
from ...core.model import GPT, activation_bytes, blocks_of, get_config, lm_loss
from ...distributed.mesh import axis_comm

LAYOUTS = ("contiguous", "zigzag")


# ============================================================================================ who holds which tokens
def positions(seq_len: int, cp: int, rank: int, layout: str = "zigzag") -> torch.Tensor:
    """Global positions (int64, ascending) of the tokens cp rank `rank` holds."""
    check_cp(seq_len, cp, layout)
    if layout == "contiguous":
        n = seq_len // cp
        return torch.arange(rank * n, (rank + 1) * n)
    c = seq_len // (2 * cp)
    first, second = rank, 2 * cp - 1 - rank
    return torch.cat([torch.arange(first * c, (first + 1) * c), torch.arange(second * c, (second + 1) * c)])


def check_cp(seq_len: int, cp: int, layout: str = "zigzag") -> None:
    """One clear error if T cannot be split over cp ranks in `layout`."""
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise ValueError(f"cp must be a positive integer, got {cp!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown context-parallel layout {layout!r}; use one of {LAYOUTS}")
    parts = 2 * cp if layout == "zigzag" else cp
    if seq_len % parts:
        raise ValueError(f"the {layout} split cuts the sequence into {parts} equal chunks "
                         f"({'2·' if parts != cp else ''}"
                         f"cp = {parts}), but T={seq_len} is not a multiple of {parts}; use a seq_len that is, or "
                         f"another cp")


def visible_pairs(seq_len: int, cp: int, rank: int, layout: str = "zigzag") -> int:
    """(query, key) pairs rank `rank` computes under the causal mask: its share of the attention work."""
    q = positions(seq_len, cp, rank, layout)
    return int((q + 1).sum())                       # query at position t sees keys 0..t


def shard(x: torch.Tensor, cp: int, rank: int, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """This rank's tokens of `x` (a tensor over the whole sequence along `dim`)."""
    return x.index_select(dim, positions(x.shape[dim], cp, rank, layout))


def unshard(parts, seq_len: int, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """Every rank's tokens (`parts[r]`) put back in sequence order: the inverse of `shard`."""
    cp = len(parts)
    order = torch.cat([positions(seq_len, cp, r, layout) for r in range(cp)])
    out = torch.cat(list(parts), dim)
    return out.index_select(dim, torch.argsort(order))


def ring_bytes_per_layer(micro_batch_size: int, seq_len: int, d_model: int, cp: int, elem: int) -> dict:
    """Bytes one cp rank sends for one attention layer's forward and backward (see the module docstring)."""
    block = micro_batch_size * (seq_len // cp) * d_model * elem
    return {"forward": 2 * (cp - 1) * block, "backward": (4 * (cp - 1) + 2) * block if cp > 1 else 0}


# ============================================================================================ ring attention
def _block_scores(q, k, pos_q, pos_k, scale):
    """S = Q·Kᵀ/√d_h with the causal mask by global position; None if this block is masked out entirely."""
    visible = pos_q[:, None] >= pos_k[None, :]                       # (n, n)
    if not bool(visible.any()):
        return None
    s = (q @ k.transpose(-2, -1)) * scale                            # (B, nh, n, n)
    return s.masked_fill(~visible, float("-inf"))


# ---------------------------------------------------------------------------- the ring's hooks (public, for labs)
class Transfer:
    """One ring hop in flight (`rotate`): the sends to the next cp rank and the receives from the previous one are
    posted; `wait()` returns the received tensors once they have arrived and the sends have completed."""

    def __init__(self, sends, recvs, bufs):
        self.sends, self.recvs, self.bufs = sends, recvs, bufs

    def wait(self) -> tuple:
        for h in self.recvs + self.sends:
            h.wait()
        return tuple(self.bufs)


def rotate(comm, tensors, tag: str) -> Transfer:
    """Start sending `tensors` to the next cp rank, (r + 1) mod cp, and receiving the same shapes from the previous
    one: the one hop of the ring, which ring attention posts before computing on the block it holds."""
    r, p = comm.rank, comm.world_size
    sends = [comm.isend(t.contiguous(), (r + 1) % p, tag=tag) for t in tensors]
    bufs = [torch.empty(t.shape, dtype=t.dtype) for t in tensors]
    recvs = [comm.irecv(b, (r - 1) % p, tag=tag) for b in bufs]
    return Transfer(sends, recvs, bufs)


_SPANS: list = []          # the communicators `block_spans` logs to (innermost last)


@contextlib.contextmanager
def block_spans(comm):
    """While active, ring attention logs every ring step's block computation, forward and backward, in `comm`'s
    ledger: a 'compute' event tagged 'block' from the moment the step's transfer is posted to the moment it is
    waited for — the window in which the transfer overlaps the computation (`course_lib.core.plots.plot_timeline`
    draws it; the sum of the spans is the rank's attention work)."""
    _SPANS.append(comm)
    try:
        yield
    finally:
        _SPANS.remove(comm)


def block_span():
    """The span of one ring step's block computation (see `block_spans`); nothing when no one logs them."""
    return _SPANS[-1].compute("block") if _SPANS else contextlib.nullcontext()


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm, all_pos, tag):
        r, p = comm.rank, comm.world_size
        scale = 1.0 / math.sqrt(q.shape[-1])
        pos_q = all_pos[r]
        o = torch.zeros_like(q)                                                     # (B, nh, n, hs)
        m = torch.full(q.shape[:-1] + (1,), float("-inf"), dtype=q.dtype)           # (B, nh, n, 1)
        l = torch.zeros_like(m)
        kv = (k, v)
        for s in range(p):
            with block_span():
                pending = rotate(comm, kv, f"{tag}:kv") if s < p - 1 else None   # the next block, meanwhile:
                j = (r - s) % p
                scores = _block_scores(q, kv[0], pos_q, all_pos[j], scale)
                if scores is not None:
                    m_new = torch.maximum(m, scores.amax(-1, keepdim=True))   # finite: step 0 is the diagonal block
                    alpha = torch.exp(m - m_new)
                    e = torch.exp(scores - m_new)
                    l = l * alpha + e.sum(-1, keepdim=True)
                    o = o * alpha + e @ kv[1]
                    m = m_new
            if pending is not None:
                kv = pending.wait()
        out = o / l
        ctx.save_for_backward(q, k, v, out, m + torch.log(l))
        ctx.comm, ctx.all_pos, ctx.tag, ctx.scale = comm, all_pos, tag, scale
        return out

    @staticmethod
    def backward(ctx, d_out):
        """The same ring, with the same overlap as forward: K and V of the block held move on while this rank
        computes with them; the block's dK, dV accumulators follow once this rank has added its part."""
        q, k, v, out, lse = ctx.saved_tensors
        comm, all_pos, tag, scale = ctx.comm, ctx.all_pos, ctx.tag, ctx.scale
        r, p = comm.rank, comm.world_size
        pos_q = all_pos[r]
        d_out = d_out.contiguous()
        delta = (d_out * out).sum(-1, keepdim=True)                                  # (B, nh, n, 1)
        dq = torch.zeros_like(q)
        kv, dkv = (k, v), (torch.zeros_like(k), torch.zeros_like(v))                 # K, V and dK, dV of rank j
        for s in range(p):
            j = (r - s) % p
            with block_span():
                moving = rotate(comm, kv, f"{tag}:kv.bwd") if s < p - 1 else None   # K, V go on meanwhile
                (kj, vj), (dkj, dvj) = kv, dkv
                scores = _block_scores(q, kj, pos_q, all_pos[j], scale)
                if scores is not None:
                    prob = torch.exp(scores - lse)                                   # (B, nh, n, n)
                    dvj = dvj + prob.transpose(-2, -1) @ d_out
                    ds = prob * (d_out @ vj.transpose(-2, -1) - delta)
                    dq = dq + (ds @ kj) * scale
                    dkj = dkj + (ds.transpose(-2, -1) @ q) * scale
            if moving is not None:        # dK, dV follow their K, V; the last pair held is rank r+1's: it goes home
                following = rotate(comm, (dkj, dvj), f"{tag}:dkv.bwd")
                kv, dkv = moving.wait(), following.wait()
            else:
                dkv = (dkj, dvj)
        if p > 1:
            dk, dv = rotate(comm, dkv, f"{tag}:dkv.bwd").wait()
        else:
            dk, dv = dkv
        return dq, dk, dv, None, None, None


def ring_attention(q, k, v, mesh_or_comm, *, seq_len: int, layout: str = "zigzag", tag: str = "cp"):
    """Exact causal attention softmax(QKᵀ/√d_h)·V of this rank's queries against every rank's keys, for q, k, v of
    shape (B, nh, T/cp, hs) holding this rank's tokens in `layout`; returns (B, nh, T/cp, hs)."""
    comm = axis_comm(mesh_or_comm, "cp")
    all_pos = [positions(seq_len, comm.world_size, j, layout) for j in range(comm.world_size)]
    return RingAttention.apply(q, k, v, comm, all_pos, tag)


def allgather_attention(q, k, v, mesh_or_comm, *, seq_len: int, layout: str = "zigzag", tag: str = "cp_ag"):
    """The same attention by Llama 3's choice: all-gather every rank's K and V (ring all-gathers, `g_sp`), attend
    to all T keys at once, reduce-scatter dK and dV in backward. Bytes per layer: 2·(cp−1) blocks forward and
    2·(cp−1) backward (`allgather_bytes_per_layer`) — fewer than the ring's — but every rank holds all T keys and
    values, and its (T/cp)×T scores, for backward."""
    from ..tensor.megatron import g_sp
    comm = axis_comm(mesh_or_comm, "cp")
    cp = comm.world_size
    B, nh, n, hs = k.shape

    def gather(t, name):
        flat = t.transpose(1, 2).reshape(B, n, nh * hs)                       # (B, T/cp, d)
        full = g_sp.apply(flat, comm, f"{tag}:{name}")                         # (B, T, d), rank by rank
        return full.reshape(B, cp * n, nh, hs).transpose(1, 2)                 # (B, nh, T, hs)

    keys, values = gather(k, "k"), gather(v, "v")
    pos_k = torch.cat([positions(seq_len, cp, j, layout) for j in range(cp)])
    pos_q = positions(seq_len, cp, comm.rank, layout)
    s = (q @ keys.transpose(-2, -1)) / math.sqrt(hs)                          # (B, nh, T/cp, T)
    s = s.masked_fill(~(pos_q[:, None] >= pos_k[None, :]), float("-inf"))
    return torch.softmax(s, -1) @ values                                       # (B, nh, T/cp, hs)


def allgather_bytes_per_layer(micro_batch_size: int, seq_len: int, d_model: int, cp: int, elem: int) -> dict:
    """Bytes one cp rank sends per attention layer with all-gathered K/V: a ring all-gather of K and of V forward,
    a ring reduce-scatter of dK and of dV backward, (cp − 1) blocks each."""
    block = micro_batch_size * (seq_len // cp) * d_model * elem
    return {"forward": 2 * (cp - 1) * block, "backward": 2 * (cp - 1) * block}


def reference_attention(q, k, v) -> torch.Tensor:
    """The single-process causal attention the ring must equal (the toy GPT's, without dropout)."""
    T = q.shape[-2]
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v


# ============================================================================================ the GPT, split by tokens
class ContextParallelGPT(nn.Module):
    """The course GPT on one cp rank: the same modules under the same names; `embed` keeps this rank's tokens of
    the (B, T) input and their positions, every block's attention core is ring attention, `loss` is the mean over
    this rank's tokens. The cp ranks' gradients are partial sums: reduce them over dp × cp, as DDP does
    (`apply_dp(model, mesh.group("dp", "cp"))`): the mean of the cp ranks' means is the mean over all T tokens.
    A pipeline cuts it like the GPT (`apply_pipeline`): each stage runs this model's embed, head and loss, and its
    blocks' ring attention over the cp peers that hold the same stage; (B, T/cp, d) crosses each boundary."""

    def __init__(self, model, comm, layout: str):
        super().__init__()
        cfg = model.config
        if cfg.dropout > 0:
            raise ValueError("context parallelism here needs dropout=0: ring attention recombines blocks of the "
                             "attention map, whose dropout masks would have to match the single process's; use a "
                             "config with dropout=0")
        check_cp(cfg.seq_len, comm.world_size, layout)
        self.config, self.comm, self.layout = cfg, comm, layout
        self.wte, self.wpe, self.drop, self.blocks, self.ln_f, self.lm_head = (model.wte, model.wpe, model.drop,
                                                                               model.blocks, model.ln_f, model.lm_head)
        for block in blocks_of(model):
            block.attn.attend = functools.partial(_ring_attend, comm=comm, layout=layout)

    def _positions(self, seq_len: int) -> torch.Tensor:
        return positions(seq_len, self.comm.world_size, self.comm.rank, self.layout)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.config.seq_len:
            raise ValueError(f"sequence of length {T} is longer than the model's seq_len={self.config.seq_len}")
        pos = self._positions(T)
        return self.drop(self.wte(idx.index_select(1, pos)) + self.wpe(pos))       # (B, T/cp, d)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))                                            # (B, T/cp, V)

    def hidden_shape(self, batch_size: int, seq_len: int | None = None) -> tuple[int, int, int]:
        """What flows between blocks on this rank — and across a pipeline stage boundary: (B, T/cp, d)."""
        return (batch_size, (seq_len or self.config.seq_len) // self.comm.world_size, self.config.d_model)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, targets.index_select(1, self._positions(targets.shape[1])))

    # the GPT's own forward (embed → blocks → head → loss, + the load-balancing loss of this rank's tokens' routing)
    # over this rank's pieces: its positions' embedding, ring attention in the blocks, the loss on its tokens
    forward = GPT.forward
    aux_loss = GPT.aux_loss


def _ring_attend(q, k, v, *, comm, layout):
    return ring_attention(q, k, v, comm, seq_len=q.shape[-2] * comm.world_size, layout=layout,
                          tag="cp")


def apply_cp(model, mesh_or_comm, *, layout: str = "zigzag") -> ContextParallelGPT:
    """Context parallelism over the cp axis: the course GPT (same seed on every rank) as this rank's
    `ContextParallelGPT`. Apply data parallelism over `mesh.group("dp", "cp")` afterwards."""
    if not isinstance(model, GPT):
        raise TypeError(f"apply_cp splits the course GPT's sequence (course_lib.core.model.GPT), got "
                        f"{type(model).__name__}; apply it before the other techniques")
    cp = ContextParallelGPT(model, axis_comm(mesh_or_comm, "cp"), layout)
    inherit(cp, model)
    attach(cp, "context_parallel", cp)
    return cp


def ring_activation_bytes(b: int, seq_len: int, d_model: int, n_head: int, cp: int, elem: int) -> int:
    """What ring attention saves for backward on one rank: Q, K, V and O of its T/cp tokens, and the log-sum-exp
    of each (head, query) row: e·b·(T/cp)·(4d + nh)."""
    return elem * b * (seq_len // cp) * (4 * d_model + n_head)


def allgather_activation_bytes(b: int, seq_len: int, d_model: int, n_head: int, cp: int, elem: int) -> int:
    """What `allgather_attention` saves on one rank: its Q (T/cp tokens), all T keys and values, the (T/cp) × T
    probabilities of every head, and the causal mask as bools: e·b·((T/cp)·d + 2·T·d + nh·(T/cp)·T) + (T/cp)·T."""
    n = seq_len // cp
    return elem * b * (n * d_model + 2 * seq_len * d_model + n_head * n * seq_len) + n * seq_len


def cp_activation_bytes(cfg, batch_size: int, cp: int, elem: int = 4) -> int:
    """Bytes the whole ContextParallelGPT saves for backward on one cp rank in one forward (exact; no dropout): the
    single-process count (`model.activation_bytes`) at T/cp tokens, with each block's attention core replaced by
    ring attention's — no (T/cp)² probabilities and causal mask, but one log-sum-exp per head and query (its Q, K, V
    and O are the tensors of width d the block already counts)."""
    c = get_config(cfg)
    b, n = batch_size, c.seq_len // cp
    core = elem * b * n * c.n_head * n + n * n                      # what a one-process block keeps: softmax, mask
    lse = elem * b * n * c.n_head
    return activation_bytes(c, b, n, elem) + c.n_layer * (lse - core)


__all__ = ["ContextParallelGPT", "apply_cp", "LAYOUTS", "positions", "check_cp", "visible_pairs", "shard", "unshard",
           "ring_bytes_per_layer", "ring_attention", "allgather_attention", "allgather_bytes_per_layer",
           "reference_attention", "Transfer", "rotate", "block_spans", "block_span", "ring_activation_bytes",
           "allgather_activation_bytes", "cp_activation_bytes"]
