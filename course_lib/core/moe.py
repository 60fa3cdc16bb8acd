"""A mixture-of-experts feed-forward for the toy GPT, on one process: E expert MLPs, a top-k router, a capacity
per expert, dropped tokens counted, and the load-balancing auxiliary loss.

Shazeer et al., "Outrageously Large Neural Networks: The Sparsely-Gated Mixture-of-Experts Layer", ICLR 2017;
Lepikhin et al., GShard, arXiv 2006.16668 (2020), §2.2 (groups, capacity, top-2); Fedus, Zoph & Shazeer, Switch
Transformers, JMLR 2022, §2.1–2.2 (top-1, capacity factor, the auxiliary loss below).

For the N tokens of one *group* (a rank's micro-batch: capacity is enforced per group, as in GShard, so that expert
parallelism can decide locally what the single process decides):

    router      p = softmax(x·W_r) (N, E);  the top-k experts of each token, gate g = p of that expert
    capacity    C = ⌈capacity_factor · k·N / E⌉ slots per expert; assignments are served first-choice-first, then by
                token order (GShard's priority); an assignment past C is dropped (the token's residual carries it)
    output      y_n = Σ over n's kept assignments (n, e) of g_{n,e} · expert_e(x_n)
    aux loss    E · Σ_e f_e · P_e,   f_e = share of the N tokens whose first choice is e,  P_e = mean_n p_{n,e}
                (Switch eq. 4; minimised, = 1, by a uniform router)

An expert no token reaches (in a group, or in the whole batch) still runs, on zero rows: its parameters get a
gradient of zeros, not None, so AdamW decays them and moves them by their momentum — Megatron-Core's semantics (its
grouped GEMM always produces the experts' gradients), and the only one expert parallelism can keep without a global
vote: a rank whose experts receive no row must still take part in the all-to-all's backward, which it does through
exactly this zero-row path (`UNUSED`).

`route` returns the plan of a group as plain tensors — the expert and slot of every kept assignment — which the
expert-parallel layer (`course_lib.parallel.expert`) turns into an all-to-all with exactly these token counts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


UNUSED = "zeros"            # what an expert no token reached gets as gradient (see the module docstring)


@dataclass(frozen=True)
class Routing:
    """One group's routing: for each kept assignment i, token[i] goes to expert[i] with weight gate[i]."""
    token: torch.Tensor           # (A,) int64, index into the group's N tokens
    expert: torch.Tensor          # (A,) int64
    gate: torch.Tensor            # (A,) differentiable (the router's probability)
    counts: torch.Tensor          # (E,) kept assignments per expert (≤ capacity)
    dropped: int                  # assignments past capacity
    capacity: int
    aux: torch.Tensor             # the load-balancing loss of this group (scalar, differentiable)


def capacity(n_tokens: int, n_expert: int, top_k: int, capacity_factor: float) -> int:
    return math.ceil(capacity_factor * top_k * n_tokens / n_expert)


def check_moe(n_expert: int, top_k: int, capacity_factor: float) -> None:
    if not isinstance(n_expert, int) or isinstance(n_expert, bool) or n_expert < 1:
        raise ValueError(f"n_expert must be a positive integer, got {n_expert!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= n_expert:
        raise ValueError(f"top_k={top_k!r} must be between 1 and n_expert={n_expert}: a token picks k distinct experts")
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0 (1.0 = exactly the average load; > 1 leaves slack), got "
                         f"{capacity_factor!r}")


def route(logits: torch.Tensor, top_k: int, capacity_factor: float) -> Routing:
    """Route one group's N tokens given router logits (N, E); see the module docstring."""
    N, E = logits.shape
    probs = F.softmax(logits, dim=-1)                                   # (N, E)
    gate, choice = probs.topk(top_k, dim=-1)                            # (N, k), descending
    C = capacity(N, E, top_k, capacity_factor)
    # priority: all first choices in token order, then all second choices, …
    expert = choice.T.reshape(-1)                                       # (k·N,)
    token = torch.arange(N).repeat(top_k)
    g = gate.T.reshape(-1)
    one_hot = F.one_hot(expert, E)                                      # (k·N, E)
    slot = (one_hot.cumsum(0) * one_hot).sum(-1) - 1                    # position in its expert's queue
    keep = slot < C
    counts = torch.bincount(expert[keep], minlength=E)
    first = F.one_hot(choice[:, 0], E).to(probs.dtype).mean(0)          # f_e
    aux = E * (first * probs.mean(0)).sum()
    return Routing(token[keep], expert[keep], g[keep], counts, int((~keep).sum()), C, aux)


class _AttachAux(torch.autograd.Function):
    """y unchanged forward; backward also hands `aux` the gradient `scale` — Megatron-Core's MoEAuxLossAutoScaler:
    inside a pipeline the loss lives on the last stage, so an earlier stage's load-balancing loss enters the
    backward through its own MoE layer's output instead of through the loss."""

    @staticmethod
    def forward(ctx, y, aux, scale):
        ctx.scale = scale
        return y.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=grad.dtype), None


def attach_aux_loss(y: torch.Tensor, aux: torch.Tensor, scale: float | None) -> torch.Tensor:
    """y, with `scale`·aux added to whatever loss its backward comes from (nothing when scale is None)."""
    return y if scale is None else _AttachAux.apply(y, aux, scale)


def attach_aux_losses(model: nn.Module, scale: float) -> None:
    """Every MoE layer of `model` (a pipeline stage's) adds scale × its load-balancing loss through backward
    (`attach_aux_loss`); the model's loss then must not add it again (a pipeline stage's does not)."""
    for m in model.modules():
        if hasattr(m, "aux_grad_scale"):
            m.aux_grad_scale = scale


class MoE(nn.Module):
    """E expert MLPs (d → ratio·d → GELU → d) behind a top-k router; drop-in for the GPT block's MLP.
    `forward(x)` with x (B, T, d); the B sequences form `groups` equal groups for capacity (each cut further by
    position when `shard_positions` is set, as context parallelism cuts them). After each forward,
    `self.last` holds the groups' `Routing`s (counts, dropped, aux)."""

    def __init__(self, d_model: int, n_expert: int, *, top_k: int = 1, capacity_factor: float = 1.25,
                 mlp_ratio: int = 4, bias: bool = True, groups: int = 1):
        super().__init__()
        check_moe(n_expert, top_k, capacity_factor)
        self.n_expert, self.top_k, self.capacity_factor, self.groups = n_expert, top_k, capacity_factor, groups
        self.shard_positions = None      # fn(T) -> [positions of each capacity group within a sequence], or None
        self.aux_grad_scale = None       # inside a pipeline: the load-balancing loss's weight (`attach_aux_losses`)
        self.router = nn.Linear(d_model, n_expert, bias=False)
        self.experts = nn.ModuleList(_Expert(d_model, mlp_ratio * d_model, bias) for _ in range(n_expert))
        self.last: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        if B % self.groups:
            raise ValueError(f"{B} sequences do not split into groups={self.groups} equal groups")
        out, self.last = [], []
        for xb in x.reshape(self.groups, -1, T, d):                      # (b, T, d) per group of sequences
            yb = torch.zeros_like(xb)
            for pos in self.token_shards(T):                             # and per shard of their positions
                n = len(pos)
                xg = xb.index_select(1, pos).reshape(-1, d)              # (N, d): b·n tokens, position order
                r = route(self.router(xg), self.top_k, self.capacity_factor)
                self.last.append(r)
                y = torch.zeros_like(xg)
                for e in range(self.n_expert):  # every expert runs, on no rows if none reach it (see UNUSED)
                    idx = r.token[r.expert == e]
                    y = y.index_add(0, idx, r.gate[r.expert == e, None] * self.experts[e](xg[idx]))
                yb = yb.index_copy(1, pos, y.reshape(-1, n, d))
            out.append(yb)
        return attach_aux_loss(torch.stack(out).reshape(B, T, d), self.aux_loss(), self.aux_grad_scale)

    def token_shards(self, seq_len: int) -> list:
        """The positions of each capacity group inside a group of sequences: all of them, or — to equal context
        parallelism, where each cp rank routes its own tokens — each cp rank's (`shard_positions`)."""
        if self.shard_positions is None:
            return [torch.arange(seq_len)]
        return self.shard_positions(seq_len)

    def aux_loss(self) -> torch.Tensor:
        """Mean over the groups of the last forward's load-balancing loss."""
        return torch.stack([r.aux for r in self.last]).mean()


class _Expert(nn.Module):
    def __init__(self, d: int, hidden: int, bias: bool):
        super().__init__()
        self.fc_in = nn.Linear(d, hidden, bias=bias)
        self.fc_out = nn.Linear(hidden, d, bias=bias)

    def forward(self, x):
        return self.fc_out(F.gelu(self.fc_in(x)))                       # (n, hidden) inside, (n, d) out


def expert_param_count(d_model: int, n_expert: int, mlp_ratio: int = 4, bias: bool = True) -> int:
    """Parameters of the E experts of one MoE layer (the router's E·d not included)."""
    h = mlp_ratio * d_model
    return n_expert * (2 * d_model * h + (h + d_model if bias else 0))


__all__ = ["UNUSED", "attach_aux_loss", "attach_aux_losses", "Routing", "capacity", "check_moe", "route", "MoE",
           "expert_param_count"]
