"""Expert parallelism from scratch: the E experts of every MoE layer spread over the `ep` ranks (E/ep each), tokens
sent to the rank that owns their expert and combined back with an all-to-all built from send/recv.

Lepikhin et al., GShard, arXiv 2006.16668 (2020), §2.2–3; Fedus et al., Switch Transformers, JMLR 2022, §2.2;
Rajbhandari et al., DeepSpeed-MoE, ICML 2022 (expert + data parallelism). The single-process layer it must equal is
`course_lib.core.moe.MoE` (groups = the ranks' micro-batches: capacity is decided per group, locally).

    rank r:   route its N tokens (the router is replicated)  →  kept assignments sorted by expert
              dispatch: rows for expert e go to rank e // (E/ep)       (all-to-all, uneven splits)
              each rank runs its E/ep experts on the rows it received  (grouped by expert)
              combine: the outputs go back the same way                (the reverse all-to-all)
              y_n = Σ gate · output over n's kept assignments

Bytes rank r sends per MoE layer and micro-batch, exactly (docs/formulas.md §12): dispatch Σ_{j≠r} a_{r→j}·d·e,
combine Σ_{j≠r} a_{j→r}·d·e (what it received, sent back), the same again in backward, plus the counts of each
(source, expert) pair — 8·(E/ep) bytes to each other rank — where a_{r→j} is the number of rows r routes to rank
j's experts.

Gradients: a rank's expert receives the gradients of every rank's tokens through the backward all-to-all, so after
backward it holds the sum over its ep group; the ranks holding the same experts (the `edp` group) then sum theirs,
and the total is divided by the data-parallel size — the gradient of the mean loss, as if one process had seen
the whole batch. The router, attention and embeddings are replicated and reduced over all of dp, as in plain DP.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..core.handles import attach
from ..distributed import collectives
from ..distributed.all_to_all import AllToAll, all_to_all, exchange_sizes
from ..distributed.mesh import Mesh, axis_comm
from ..core.moe import MoE, route


class ExpertParallelMoE(nn.Module):
    """This rank's part of an MoE layer under expert parallelism: the router (replicated) and experts
    [rank·E/ep, (rank+1)·E/ep) under their global names (`experts.5.fc_in.weight`)."""

    def __init__(self, moe: MoE, comm, *, tag: str = "ep"):
        super().__init__()
        E, p = moe.n_expert, comm.world_size
        if E % p:
            raise ValueError(f"n_expert={E} does not split over ep={p} ranks; use an ep size that divides {E}, e.g. "
                             f"{[k for k in range(1, E + 1) if E % k == 0]}")
        self.comm, self.tag = comm, tag
        self.n_expert, self.top_k, self.capacity_factor = E, moe.top_k, moe.capacity_factor
        self.local = E // p
        self.first = comm.rank * self.local
        self.router = moe.router
        self.experts = nn.ModuleDict({str(e): moe.experts[e] for e in range(self.first, self.first + self.local)})
        self.last: list = []
        self.sent_rows: list = []             # per forward: rows dispatched to each ep rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        xg = x.reshape(B * T, d)                                        # this rank's tokens are one group
        r = route(self.router(xg), self.top_k, self.capacity_factor)
        self.last = [r]
        order = torch.argsort(r.expert, stable=True)                    # rows grouped by expert, ascending
        token, expert, gate = r.token[order], r.expert[order], r.gate[order]
        p, L = self.comm.world_size, self.local
        per_expert = torch.bincount(expert, minlength=self.n_expert)    # (E,) rows this rank sends per expert
        send_rows = per_expert.reshape(p, L).sum(1).tolist()
        # how many rows of each of my experts every rank sends me: one small all-to-all of counts
        counts = all_to_all(self.comm, list(per_expert.reshape(p, L)), tag=f"{self.tag}:counts",
                            out_sizes=[L] * p)
        recv_rows = [int(c.sum()) for c in counts]
        self.sent_rows.append(send_rows)
        rows = AllToAll.apply(xg[token], self.comm, send_rows, recv_rows, f"{self.tag}:dispatch")   # (R, d)
        out = self._run_experts(rows, torch.stack(counts))                                          # (R, d)
        back = AllToAll.apply(out, self.comm, recv_rows, send_rows, f"{self.tag}:combine")           # (A, d)
        y = torch.zeros_like(xg).index_add(0, token, gate[:, None] * back)
        return y.reshape(B, T, d)

    def _run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows arrive source by source, each source's sorted by expert; counts (p, E/ep)."""
        which = torch.arange(self.local).repeat(counts.shape[0]).repeat_interleave(counts.reshape(-1))
        out = torch.empty_like(rows)
        for i in range(self.local):
            sel = (which == i).nonzero().squeeze(1)
            if sel.numel():
                out = out.index_copy(0, sel, self.experts[str(self.first + i)](rows[sel]))
        return out

    def aux_loss(self) -> torch.Tensor:
        return self.last[0].aux


def apply_ep(model: nn.Module, mesh: Mesh) -> nn.Module:
    """Expert parallelism over the mesh's ep sub-axis: every `MoE` in `model` is replaced, in place and under the
    same name, by this rank's `ExpertParallelMoE`. Returns the model."""
    comm = axis_comm(mesh, "ep") if isinstance(mesh, Mesh) else mesh
    swaps = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
    if not swaps:
        raise TypeError(f"apply_ep found no MoE layer in {type(model).__name__}: build the GPT with n_expert > 0 "
                        f"(course_lib.core.moe.MoE feed-forwards)")
    for i, (name, moe) in enumerate(swaps):
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr,
                ExpertParallelMoE(moe, comm, tag=f"{name}:ep"))
    attach(model, "expert_parallel", model)
    return model


def is_expert_param(name: str) -> bool:
    return ".experts." in f".{name}"


def reduce_expert_parallel_grads(model: nn.Module, mesh: Mesh) -> None:
    """Average gradients as one process with the whole batch would have them: replicated parameters over dp (mean),
    expert parameters summed over edp and divided by dp (their ep group's sum is already in them)."""
    dp, edp = mesh["dp"], mesh["edp"]
    for name, p in model.named_parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        comm = edp if is_expert_param(name) else dp
        if comm.world_size > 1:
            collectives.all_reduce_ring(comm, p.grad, tag=f"{comm.name}:grad")
        p.grad.div_(mesh.size("dp"))


class ExpertDataParallel(nn.Module):
    """Data parallelism for a model with expert-parallel MoE layers: after backward,
    `finish_gradient_synchronization` reduces replicated parameters over dp and expert parameters over edp
    (`reduce_expert_parallel_grads`). `train.run` calls it, as it calls DDP's."""

    def __init__(self, module: nn.Module, mesh: Mesh):
        super().__init__()
        self.module, self.mesh = module, mesh

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        reduce_expert_parallel_grads(self.module, self.mesh)


def set_moe_groups(model: nn.Module, groups: int) -> None:
    """Capacity groups of every single-process MoE layer of `model` — the reference must decide capacity over the
    same groups of tokens as the ranks do: one group per rank's micro-batch."""
    for m in model.modules():
        if isinstance(m, MoE):
            m.groups = groups


def expert_bytes_per_forward(sent_rows, received_rows, rank: int, d_model: int, elem: int, local_experts: int) -> dict:
    """Exact bytes one MoE layer's forward sends from `rank` (the backward sends the same data bytes again)."""
    p = len(sent_rows)
    out = sum(n for j, n in enumerate(sent_rows) if j != rank) * d_model * elem
    back = sum(n for j, n in enumerate(received_rows) if j != rank) * d_model * elem
    return {"dispatch": out, "combine": back, "counts": (p - 1) * local_experts * 8}


__all__ = ["ExpertParallelMoE", "ExpertDataParallel", "set_moe_groups", "apply_ep", "is_expert_param", "reduce_expert_parallel_grads",
           "expert_bytes_per_forward", "exchange_sizes"]
