"""Megatron 1D tensor parallelism from scratch: the conjugate operators f and g, column- and row-parallel linears,
a vocab-parallel embedding and a vocab-parallel cross-entropy that never materialises the full logits.

Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism",
arXiv 1909.08053 (2019), §3 and Fig. 3; Narayanan et al., SC'21 (arXiv 2104.04473), §2.3. The sequence-parallel
pair g / ḡ is Korthikanti et al., MLSys 2023 (arXiv 2205.05198), §4.2.2 (`course_lib.parallel.tensor.sequence`).

Every collective here is a from-scratch ring of `course_lib.distributed.collectives` on the tp communicator, so every
byte is a real send in the ledger. Checked against (docs/formulas.md §4.1): per transformer layer and micro-batch,
two all-reduces of b·s·h elements in forward and two in backward, so rank r sends exactly

    4 · ring_all_reduce_bytes(b·s·h, t, r, e)   = 8·bsh·(t−1)/t · e  when t divides b·s·h      (`layer_bytes`)

`CollectiveLog` counts the calls, the way `torch.distributed.tensor.debug.CommDebugMode` counts DTensor's.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...distributed import collectives
from ...distributed.collectives import ring_all_gather_bytes, ring_all_reduce_bytes, ring_reduce_scatter_bytes
from ...memory import now


# ============================================================================================ counting the calls
@dataclass(frozen=True)
class Call:
    """One tensor-parallel collective: op ('all_reduce' | 'all_gather' | 'reduce_scatter'), ledger tag, elements
    of the full tensor, and its span on the ledger's clock."""
    op: str
    tag: str
    numel: int
    t0: float
    t1: float


_logs: contextvars.ContextVar = contextvars.ContextVar("course_tp_logs", default=())


class CollectiveLog:
    """`with CollectiveLog() as log:` records every tensor-parallel collective this thread runs (autograd runs a
    CPU backward in the calling thread, so backward's are seen too). `log.counts()` -> {op: calls}, like
    `CommDebugMode().get_comm_counts()`; `log.calls` keeps tag, size and span of each (for timelines)."""

    def __init__(self):
        self.calls: list[Call] = []
        self._token = None

    def __enter__(self):
        self._token = _logs.set(_logs.get() + (self,))
        return self

    def __exit__(self, *exc):
        _logs.reset(self._token)

    def counts(self, tag: str | None = None) -> Counter:
        """Calls per op, optionally only those whose tag starts with `tag`."""
        return Counter(c.op for c in self.calls if tag is None or c.tag.startswith(tag))


@contextlib.contextmanager
def _recorded(op: str, tag: str, numel: int):
    t0 = now()
    yield
    call = Call(op, tag, numel, t0, now())
    for log in _logs.get():
        log.calls.append(call)


# ============================================================================================ the three collectives
def all_reduce(comm, x: torch.Tensor, tag: str, op: str = "sum") -> torch.Tensor:
    """A new tensor: the sum (or max) of every tp rank's x, by the ring of notebook 02."""
    out = x.contiguous().clone()
    if comm.world_size > 1:
        with _recorded("all_reduce", tag, out.numel()):
            collectives.all_reduce_ring(comm, out, op, tag=tag)
    return out


def _check_seq(x: torch.Tensor, t: int, dim: int, what: str) -> None:
    if x.shape[dim] % t:
        raise ValueError(f"sequence parallelism splits dim {dim} of length {x.shape[dim]} over tp_size={t} ranks "
                         f"({what}); use a sequence length that is a multiple of {t}")


def gather_seq(comm, x: torch.Tensor, tag: str, dim: int = 1) -> torch.Tensor:
    """All-gather along `dim` (the sequence): every rank's (B, T/t, d) → (B, T, d), rank order = sequence order."""
    t = comm.world_size
    if t == 1:
        return x
    # allocated here, not as a comm buffer: with B = 1 the result below is a view of it, and a linear may save it
    out = x.new_empty(t * x.numel())                                                 # (t·B·T/t·d,): rank-major
    with _recorded("all_gather", tag, out.numel()):
        collectives.all_gather_ring(comm, x.contiguous().view(-1), out=out, tag=tag)
    # (t, B, T/t, d) → (B, t, T/t, d) → (B, T, d): rank r's slice is positions [r·T/t, (r+1)·T/t)
    return out.view(t, *x.shape).movedim(0, dim).reshape(*x.shape[:dim], t * x.shape[dim], *x.shape[dim + 1:])


def scatter_seq(comm, x: torch.Tensor, tag: str, dim: int = 1) -> torch.Tensor:
    """Reduce-scatter along `dim`: the sum over ranks of x (B, T, d), rank r keeping positions [r·T/t, (r+1)·T/t)."""
    t = comm.world_size
    if t == 1:
        return x.clone()
    _check_seq(x, t, dim, "reduce-scatter")
    shape = list(x.shape)
    shape[dim] //= t
    # (B, T, d) → (B, t, T/t, d) → (t, B, T/t, d): chunk r of the flat buffer is rank r's slice of the sequence
    blocks = x.reshape(*x.shape[:dim], t, shape[dim], *x.shape[dim + 1:]).movedim(dim, 0).contiguous()
    with _recorded("reduce_scatter", tag, x.numel()):
        mine = collectives.reduce_scatter_ring(comm, blocks.view(-1), tag=tag)
    return mine.view(shape)


# ============================================================================================ f and g (Megatron)
class f(torch.autograd.Function):
    """Megatron's f: identity in forward, all-reduce in backward (Shoeybi et al., Fig. 3).

    It stands where a replicated activation X enters a region whose weights are split over the tp ranks: every
    rank computes with the whole X, so forward has nothing to do; but each rank's part of the graph produced
    only its share of ∂L/∂X, and the true gradient is their sum.
    """

    @staticmethod
    def forward(ctx, x, comm, tag="f"):
        ctx.comm, ctx.tag = comm, tag
        return x.view_as(x)                      # the same storage: nothing is copied or saved

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(ctx.comm, grad, f"{ctx.tag}.bwd"), None, None     # '.bwd': sent in backward


class g(torch.autograd.Function):
    """Megatron's g, f's conjugate: all-reduce in forward, identity in backward.

    It closes the region: each rank holds a partial sum Y_r = X_r·B_r of the output, and Y = Σ_r Y_r. In
    backward ∂L/∂Y is already whole on every rank (everything after the region is replicated), and ∂L/∂Y_r = ∂L/∂Y.
    """

    @staticmethod
    def forward(ctx, x, comm, tag="g"):
        return all_reduce(comm, x, tag)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class g_sp(torch.autograd.Function):
    """Sequence parallelism's g (Korthikanti et al., Fig. 5): all-gather along the sequence in forward,
    reduce-scatter in backward. It replaces f where a sequence-split activation (B, T/t, d) enters a tensor-parallel
    region, which needs the whole sequence."""

    @staticmethod
    def forward(ctx, x, comm, tag="g_sp"):
        ctx.comm, ctx.tag = comm, tag
        return gather_seq(comm, x, tag)                   # (B, T, d)

    @staticmethod
    def backward(ctx, grad):
        return scatter_seq(ctx.comm, grad, f"{ctx.tag}.bwd"), None, None


class gbar_sp(torch.autograd.Function):
    """Sequence parallelism's ḡ, g_sp's conjugate: reduce-scatter along the sequence in forward (the sum of the
    partial outputs, each rank keeping its slice of the sequence), all-gather in backward. It replaces g."""

    @staticmethod
    def forward(ctx, x, comm, tag="gbar_sp"):
        ctx.comm, ctx.tag = comm, tag
        return scatter_seq(comm, x, tag)                  # (B, T/t, d)

    @staticmethod
    def backward(ctx, grad):
        return gather_seq(ctx.comm, grad.contiguous(), f"{ctx.tag}.bwd"), None, None


# ============================================================================================ layers
def _shard(weight: torch.Tensor, dim: int, rank: int, t: int) -> torch.Tensor:
    """Rank r's contiguous 1/t of `weight` along `dim` (a copy, so the full weight can be freed)."""
    return weight.detach().chunk(t, dim)[rank].clone()


class ColumnParallelLinear(nn.Linear):
    """Y = X·A with A split by columns (nn.Linear's weight by rows): rank r holds A_r, and Y_r = X·A_r.

        X (B, T, k) ──f──┬─▶ X·A_0 = Y_0 (B, T, n/t)   rank 0      A = [ A_0 | A_1 | … ]   (k × n)
                         └─▶ X·A_1 = Y_1 (B, T, n/t)   rank 1      bias split the same way

    No communication in forward: the output stays split by columns, ready for an elementwise op (GeLU) or for a
    split by heads, and then for a RowParallelLinear. `out_features` is the LOCAL width (the toy attention reads it
    to know how many heads this rank has). `input_f=False` leaves f to the caller: three linears that share one
    input (q, k, v) then all-reduce its gradient once, not three times.
    """

    def __init__(self, linear: nn.Linear, comm, *, input_f: bool = True, tag: str = "col"):
        t = comm.world_size
        if linear.out_features % t:
            raise ValueError(f"ColumnParallelLinear: tp_size={t} does not divide out_features={linear.out_features}")
        w = linear.weight
        super().__init__(linear.in_features, linear.out_features // t, bias=linear.bias is not None,
                         dtype=w.dtype, device=w.device)
        with torch.no_grad():
            self.weight.copy_(_shard(w, 0, comm.rank, t))          # (n/t, k)
            if self.bias is not None:
                self.bias.copy_(_shard(linear.bias, 0, comm.rank, t))
        self.comm, self.input_f, self.tag, self.full_out_features = comm, input_f, tag, linear.out_features

    def reset_parameters(self):
        """Nothing to draw: the slices come from the whole layer (and no random numbers are used up here)."""

    def forward(self, x):
        if self.input_f:
            x = f.apply(x, self.comm, f"{self.tag}:f")
        return F.linear(x, self.weight, self.bias)                  # (B, T, n/t)


class RowParallelLinear(nn.Linear):
    """Y = X·B with B split by rows (nn.Linear's weight by columns): rank r holds B_r and the matching slice X_r of
    its input (what a ColumnParallelLinear left there), computes a partial sum, and g adds them up.

        X_0 (B, T, k/t) ─▶ X_0·B_0 ─┐                      B = [ B_0 ]   (k × n)
        X_1 (B, T, k/t) ─▶ X_1·B_1 ─┴─g─▶ Y (B, T, n) + b       [ B_1 ]
                                                                [  …  ]
    The bias is whole on every rank and added once, after g. With `sequence_parallel`, g becomes ḡ (a
    reduce-scatter along the sequence, Korthikanti et al.) and the bias, added to a slice of the sequence, gets
    its gradient summed over the ranks by f.
    """

    def __init__(self, linear: nn.Linear, comm, *, sequence_parallel: bool = False, tag: str = "row"):
        t = comm.world_size
        if linear.in_features % t:
            raise ValueError(f"RowParallelLinear: tp_size={t} does not divide in_features={linear.in_features}")
        w = linear.weight
        super().__init__(linear.in_features // t, linear.out_features, bias=linear.bias is not None,
                         dtype=w.dtype, device=w.device)
        with torch.no_grad():
            self.weight.copy_(_shard(w, 1, comm.rank, t))          # (n, k/t)
            if self.bias is not None:
                self.bias.copy_(linear.bias.detach())
        self.comm, self.sequence_parallel, self.tag = comm, sequence_parallel, tag

    def reset_parameters(self):
        """Nothing to draw: the slices come from the whole layer (and no random numbers are used up here)."""

    def forward(self, x):
        partial = F.linear(x, self.weight)                          # (B, T, n): this rank's share of the sum
        if self.sequence_parallel:
            y = gbar_sp.apply(partial, self.comm, f"{self.tag}:gbar")   # (B, T/t, n)
            return y if self.bias is None else y + f.apply(self.bias, self.comm, f"sp_params/{self.tag}.bias")
        y = g.apply(partial, self.comm, f"{self.tag}:g")            # (B, T, n)
        return y if self.bias is None else y + self.bias


def padded_vocab(vocab_size: int, t: int) -> int:
    """The vocabulary rounded up to a multiple of t (Megatron pads to a multiple of 128·t for fast kernels)."""
    return -(-vocab_size // t) * t


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    extra = rows - weight.shape[0]
    return weight.detach() if extra == 0 else torch.cat([weight.detach(), weight.new_zeros(extra, weight.shape[1])])


class VocabParallelEmbedding(nn.Module):
    """The token embedding split by vocabulary rows: rank r holds rows [r·V/t, (r+1)·V/t) of the (padded) table.

    Each rank looks up the ids that fall in its range and writes zeros for the others; the sum over ranks (g, an
    all-reduce — or ḡ, a reduce-scatter along the sequence, with sequence parallelism) is the embedding.
    """

    def __init__(self, embedding: nn.Embedding, comm, *, vocab: int, sequence_parallel: bool = False,
                 tag: str = "wte"):
        super().__init__()
        t, r = comm.world_size, comm.rank
        self.per_rank = vocab // t
        self.start = r * self.per_rank
        self.weight = nn.Parameter(_pad_rows(embedding.weight, vocab)[self.start:self.start + self.per_rank].clone())
        self.comm, self.sequence_parallel, self.tag = comm, sequence_parallel, tag

    def forward(self, idx):
        outside = (idx < self.start) | (idx >= self.start + self.per_rank)
        local = (idx - self.start).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)   # (B, T, d)
        if self.sequence_parallel:
            return gbar_sp.apply(partial, self.comm, f"{self.tag}:gbar")               # (B, T/t, d)
        return g.apply(partial, self.comm, f"{self.tag}:g")


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from logits split by vocabulary, without ever assembling a (B·T, V) tensor.

    log-softmax needs two numbers per token that span the whole vocabulary — the max (for stability) and the sum
    of exponentials — and the loss needs the target's logit, which lives on one rank. So: all-reduce(max) of N
    values, then one all-reduce of 2N values (Σ exp and the target logit, zero on the ranks that do not hold it).
    Backward is local: ∂loss/∂logits = softmax − one-hot, on this rank's columns only.
    """

    @staticmethod
    def forward(ctx, logits, targets, comm, start, valid, tag):
        # logits: (N, V/t) this rank's columns, global ids start … start + V/t − 1; columns ≥ valid are padding
        if valid < logits.shape[1]:
            logits = logits.masked_fill(torch.arange(logits.shape[1]) >= valid, float("-inf"))
        m = all_reduce(comm, logits.max(dim=1).values, f"{tag}:max", op="max")          # (N,)
        shifted = logits - m[:, None]                                                    # (N, V/t)
        exp = shifted.exp()
        outside = (targets < start) | (targets >= start + logits.shape[1])
        local = (targets - start).masked_fill(outside, 0)
        target_logit = shifted.gather(1, local[:, None]).squeeze(1).masked_fill(outside, 0.0)
        sums = all_reduce(comm, torch.stack([exp.sum(dim=1), target_logit]), f"{tag}:sum")   # (2, N)
        exp.div_(sums[0][:, None])                                                       # softmax, in place
        ctx.save_for_backward(exp, local, outside)
        return sums[0].log() - sums[1]                                                   # (N,)

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        grad_logits = softmax.clone()
        rows = torch.arange(softmax.shape[0])
        grad_logits[rows, local] -= (~outside).to(softmax.dtype)       # − one-hot, where this rank holds the target
        return grad_logits * grad[:, None], None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, comm, *, start: int,
                                 vocab_size: int, tag: str = "loss") -> torch.Tensor:
    """Mean cross-entropy over B·T tokens of logits (B, T, V/t) split by vocabulary; columns whose global id is
    ≥ vocab_size are padding and count as −∞ (so the result equals the unpadded model's loss)."""
    flat = logits.reshape(-1, logits.shape[-1])                                         # (B·T, V/t)
    valid = min(max(vocab_size - start, 0), flat.shape[1])
    return VocabParallelCrossEntropy.apply(flat, targets.reshape(-1), comm, start, valid, tag).mean()


# ============================================================================================ closed forms
def layer_bytes(b: int, s: int, h: int, t: int, rank: int, elem: int) -> int:
    """Bytes rank `rank` sends per transformer layer and micro-batch in Megatron 1D: 4 ring all-reduces of b·s·h
    (g after attention and MLP in forward, f before them in backward). 8·bsh·(t−1)/t·elem when t divides bsh."""
    return 4 * ring_all_reduce_bytes(b * s * h, t, rank, elem)


def sp_layer_bytes(b: int, s: int, h: int, t: int, rank: int, elem: int) -> int:
    """Sequence parallelism's g / ḡ per layer: 4 all-gathers (b·s·h out) and 4 reduce-scatters (b·s·h in).
    A ring all-reduce is one of each, so this equals `layer_bytes` (Korthikanti et al. §4.2.2)."""
    return 4 * (ring_all_gather_bytes(b * s * h, t, rank, elem) + ring_reduce_scatter_bytes(b * s * h, t, rank, elem))


__all__ = ["f", "g", "g_sp", "gbar_sp", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "padded_vocab", "all_reduce", "gather_seq", "scatter_seq",
           "CollectiveLog", "Call", "layer_bytes", "sp_layer_bytes"]
