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

With the other axes (docs/formulas.md §12.4): under tp every tp rank holds its ep share of the experts whole and
routes the same tokens (expert-tensor-parallel size 1); under cp a rank routes its own T/cp tokens and both
reductions run over × cp (`gradient_groups`); inside a pipeline each stage's layers exchange tokens in that stage's
ep group and the load-balancing loss enters through backward (`core.moe.attach_aux_loss`); ZeRO-1/2 shard the
replicated parameters' state over dp (× cp) and the experts' over edp (× cp) (`ExpertShardedOptimizer`). Every
local expert runs even on zero rows, so every rank takes part in every all-to-all, forward and backward, and an
unused expert's gradient is zeros, as in the single-process `MoE` (`core.moe.UNUSED`).
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn

from ..core.handles import attach
from ..core.moe import MoE, attach_aux_loss, route
from ..distributed import collectives
from ..distributed.all_to_all import AllToAll, all_to_all, exchange_sizes
from ..distributed.mesh import Mesh, axis_comm


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
        self.received_rows: list = []         # per forward: rows each ep rank dispatched here (its router's counts)
        self.aux_values: list = []            # per forward: the load-balancing loss of this rank's tokens
        self.aux_grad_scale = moe.aux_grad_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        xg = x.reshape(B * T, d)                                        # this rank's tokens are one group
        r = route(self.router(xg), self.top_k, self.capacity_factor)
        self.last = [r]
        self.aux_values.append(r.aux.item())
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
        self.received_rows.append(recv_rows)
        rows = AllToAll.apply(xg[token], self.comm, send_rows, recv_rows, f"{self.tag}:dispatch")   # (R, d)
        out = self._run_experts(rows, torch.stack(counts))                                          # (R, d)
        back = AllToAll.apply(out, self.comm, recv_rows, send_rows, f"{self.tag}:combine")           # (A, d)
        y = torch.zeros_like(xg).index_add(0, token, gate[:, None] * back)
        return attach_aux_loss(y.reshape(B, T, d), r.aux, self.aux_grad_scale)

    def _run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows arrive source by source, each source's sorted by expert; counts (p, E/ep). Every local expert runs,
        on zero rows if none arrived: the output then still depends on `rows` and on the experts' parameters, so the
        backward reaches the combine's and the dispatch's all-to-all on every rank — a rank whose experts got no
        token (a collapsed router) must still send its peers their (empty) gradient pieces, or they wait forever —
        and an unused expert's gradient is zeros, as in the single-process `MoE` (`moe.UNUSED`)."""
        which = torch.arange(self.local).repeat(counts.shape[0]).repeat_interleave(counts.reshape(-1))
        out = torch.zeros_like(rows)
        for i in range(self.local):
            sel = (which == i).nonzero().squeeze(1)
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
    for _i, (name, moe) in enumerate(swaps):
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr,
                ExpertParallelMoE(moe, comm, tag=f"{name}:ep"))
    attach(model, "expert_parallel", model)
    return model


def is_expert_param(name: str) -> bool:
    return ".experts." in f".{name}"


def gradient_groups(mesh: Mesh) -> tuple:
    """(replicated, expert) communicators the gradients are summed over: dp and edp — times cp under context
    parallelism, whose ranks hold partial sums over their tokens (`dp×cp`, and `edp×cp`: the ranks holding the same
    experts at every cp position). Collective on first use: every rank asks in the same order."""
    if mesh.size("cp") == 1:
        return mesh["dp"], mesh["edp"]
    ep, sizes = mesh.size("ep"), mesh.sizes
    groups = [[mesh.rank_of(pp=pp, dp=g * ep + i, cp=c, tp=tp) for g in range(sizes["dp"] // ep)
               for c in range(sizes["cp"])]
              for pp in range(sizes["pp"]) for i in range(ep) for tp in range(sizes["tp"])]
    return mesh.group("dp", "cp"), mesh.partition_group("edp×cp", groups)


def reduce_expert_parallel_grads(model: nn.Module, mesh: Mesh) -> None:
    """Average gradients as one process with the whole batch would have them: replicated parameters over dp (× cp)
    (mean), expert parameters summed over edp (× cp) and divided by dp · cp (their ep group's sum is already in
    them)."""
    dp, edp = gradient_groups(mesh)
    for name, p in model.named_parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        comm = edp if is_expert_param(name) else dp
        if comm.world_size > 1:
            collectives.all_reduce_ring(comm, p.grad, tag=f"{comm.name}:grad")
        p.grad.div_(mesh.size("dp") * mesh.size("cp"))


class ExpertDataParallel(nn.Module):
    """Data parallelism for a model with expert-parallel MoE layers: after backward,
    `finish_gradient_synchronization` reduces replicated parameters over dp and expert parameters over edp
    (`reduce_expert_parallel_grads`). `train.run` calls it, as it calls DDP's."""

    def __init__(self, module: nn.Module, mesh: Mesh):
        super().__init__()
        self.module, self.mesh = module, mesh
        gradient_groups(mesh)                   # made now, collectively, not inside the first step

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        reduce_expert_parallel_grads(self.module, self.mesh)

    @contextlib.contextmanager
    def no_sync(self):
        """Nothing to suspend: gradients are reduced only when `finish_gradient_synchronization` is called (a
        pipeline calls it once all micro-batches are done)."""
        yield

    def expected_bytes_by_group(self, elem: int) -> dict:
        """{group: bytes} one gradient reduction sends from this rank (`gradient_bytes`)."""
        return gradient_bytes(self.module, self.mesh, elem)


class ExpertShardedOptimizer:
    """ZeRO-1 or 2 for a model with expert-parallel MoE layers — DeepSeek-V3's ZeRO-1 beside EP: two
    `ShardedOptimizer`s, one sharding the replicated parameters' state over dp (× cp), one the experts' over edp
    (× cp), the group that holds the same experts (`gradient_groups`). Each averages over its own group; an expert's
    gradient already sums its ep group's tokens, so a hook divides it by ep first — the expert shard then holds
    Σ/(dp·cp), the gradient of the mean loss, as `reduce_expert_parallel_grads` leaves it."""

    def __init__(self, model: nn.Module, mesh: Mesh, optimizer_cls, *, stage: int, **optimizer_kwargs):
        from .zero import ShardedOptimizer
        dp, edp = gradient_groups(mesh)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        experts = [p for n, p in named if is_expert_param(n)]
        ep = mesh.size("ep")
        self._hooks = [p.register_hook(lambda g: g / ep) for p in experts] if ep > 1 else []
        self.parts = {dp.name: ShardedOptimizer([p for n, p in named if not is_expert_param(n)], optimizer_cls, dp,
                                                stage=stage, tag=f"{dp.name}:zero", **optimizer_kwargs),
                      edp.name: ShardedOptimizer(experts, optimizer_cls, edp, stage=stage, tag=f"{edp.name}:zero",
                                                 **optimizer_kwargs)}

    def expected_bytes_by_group(self, elem: int) -> dict:
        """{group: bytes} per step: each part's ZeRO bytes over its own group (`zero_bytes_per_step`)."""
        return {name: opt.expected_bytes_sent() for name, opt in self.parts.items() if opt.comm.world_size > 1}

    @contextlib.contextmanager
    def no_sync(self):
        with contextlib.ExitStack() as stack:
            for opt in self.parts.values():
                stack.enter_context(opt.no_sync())
            yield

    def finish_gradient_synchronization(self) -> None:
        for opt in self.parts.values():
            opt.finish_gradient_synchronization()

    def step(self, closure=None):
        for opt in self.parts.values():
            opt.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.parts.values():
            opt.zero_grad(set_to_none)

    @property
    def param_groups(self):
        return [g for opt in self.parts.values() for g in opt.param_groups]

    @property
    def state(self):
        return {k: v for opt in self.parts.values() for k, v in opt.state.items()}

    def register_step_pre_hook(self, hook):
        return _Handles([opt.register_step_pre_hook(hook) for opt in self.parts.values()])

    def register_step_post_hook(self, hook):
        return _Handles([opt.register_step_post_hook(hook) for opt in self.parts.values()])

    def close(self) -> None:
        for opt in self.parts.values():
            opt.close()


def apply_expert_zero(model: nn.Module, mesh: Mesh, stage: int = 0) -> nn.Module:
    """Data parallelism for a model with experts — `parallel.zero.apply_zero`'s form for two groups: stage 0
    wraps the model in `ExpertDataParallel` (replicated parameters all-reduced over dp, experts over edp); stages 1
    and 2 shard each part's optimizer state over its own group (`ExpertShardedOptimizer`, built by
    `course_lib.optim.build(model, …)`). `handle_of(model, "data_parallel")` is what reduces the gradients."""
    from .zero import ZeroShards
    if stage == 0:
        wrapped = ExpertDataParallel(model, mesh)
        attach(wrapped, "data_parallel", wrapped)
        return wrapped
    if stage not in (1, 2):
        raise ValueError(f"ZeRO-{stage} over a model with experts is not built here: use stage 0, 1 or 2")
    attach(model, "data_parallel", ZeroShards(
        lambda params, cls, **kw: ExpertShardedOptimizer(model, mesh, cls, stage=stage, **kw)))
    return model


class _Handles:
    """Several hook handles removed as one (what `register_step_*_hook` returns)."""

    def __init__(self, handles):
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def set_moe_groups(model: nn.Module, groups: int, *, cp: int = 1, layout: str = "zigzag", tp: int = 1) -> None:
    """Capacity groups of every single-process MoE layer of `model` — the reference must decide capacity over the
    same groups of tokens as the ranks do: one group per rank's micro-batch, with context parallelism (cp > 1) one
    per cp rank's positions of it (`context.positions` in `layout`), and with sequence parallelism (tp > 1: its
    size) one per tp rank's contiguous slice of those."""
    shards = None
    if cp > 1 or tp > 1:
        shards = functools.partial(_cp_shards, cp=cp, layout=layout, tp=tp)
    for m in model.modules():
        if isinstance(m, MoE):
            m.groups, m.shard_positions = groups, shards


def _cp_shards(seq_len: int, *, cp: int, layout: str, tp: int = 1) -> list:
    from .context import positions
    return [pos.tensor_split(tp)[t].clone() for r in range(cp) for pos in [positions(seq_len, cp, r, layout)]
            for t in range(tp)]


def expert_bytes_per_forward(sent_rows, received_rows, rank: int, d_model: int, elem: int, local_experts: int) -> dict:
    """Exact bytes one MoE layer's forward sends from `rank` (the backward sends the same data bytes again)."""
    p = len(sent_rows)
    out = sum(n for j, n in enumerate(sent_rows) if j != rank) * d_model * elem
    back = sum(n for j, n in enumerate(received_rows) if j != rank) * d_model * elem
    return {"dispatch": out, "combine": back, "counts": (p - 1) * local_experts * 8}


def expert_layers(model: nn.Module) -> list:
    """The `ExpertParallelMoE` layers of `model` (this rank's, in module order)."""
    return [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]


def ep_bytes_per_step(model: nn.Module, rank: int, elem: int, forwards_per_step: int) -> list:
    """Bytes this rank sent on the ep axis in each step so far, from the routing counts alone: for every forward of
    every MoE layer here, `expert_bytes_per_forward` of the rows its router sent and the rows its peers' routers
    sent it (the counts the small all-to-all delivered) — dispatch, combine and counts — and the dispatch and
    combine rows once more in backward (docs/formulas.md §12). `forwards_per_step`: the micro-batches M (each MoE
    layer runs once per micro-batch)."""
    layers = expert_layers(model)
    if not layers:
        return []
    d = layers[0].router.in_features
    steps = len(layers[0].sent_rows) // forwards_per_step
    out = []
    for s in range(steps):
        total = 0
        for m in layers:
            for f in range(s * forwards_per_step, (s + 1) * forwards_per_step):
                b = expert_bytes_per_forward(m.sent_rows[f], m.received_rows[f], rank, d, elem, m.local)
                total += 2 * (b["dispatch"] + b["combine"]) + b["counts"]
        out.append(total)
    return out


def aux_loss_per_step(model: nn.Module, cfg, forwards_per_step: int) -> list:
    """This rank's share of the training loss's load-balancing term in each step so far: aux_loss_coef / n_layer ×
    Σ over its MoE layers of the mean over the step's M micro-batches of each layer's aux loss. Inside a pipeline
    that term reaches the gradients through backward (`attach_aux_loss`) and the last stage reports only its
    cross-entropy: one process's loss is the last stage's plus every stage's share (per dp and cp position)."""
    layers = expert_layers(model)
    if not layers:
        return []
    M = forwards_per_step
    return [cfg.aux_loss_coef / cfg.n_layer * sum(sum(m.aux_values[s * M:(s + 1) * M]) / M for m in layers)
            for s in range(len(layers[0].aux_values) // M)]


def gradient_bytes(model: nn.Module, mesh: Mesh, elem: int) -> dict:
    """Bytes this rank sends per step reducing gradients under `ExpertDataParallel`: one ring all-reduce per
    parameter (`ring_all_reduce_bytes`), replicated ones over dp, expert ones over edp — {group name: bytes}."""
    from ..distributed.collective_bytes import ring_all_reduce_bytes
    out, (dp, edp) = {}, gradient_groups(mesh)
    for name, p in model.named_parameters():
        comm = edp if is_expert_param(name) else dp
        if comm.world_size > 1:
            out[comm.name] = out.get(comm.name, 0) + ring_all_reduce_bytes(p.numel(), comm.world_size, comm.rank,
                                                                           elem)
    return out


__all__ = ["apply_expert_zero", "ExpertShardedOptimizer", "expert_layers", "ep_bytes_per_step", "aux_loss_per_step",
           "gradient_bytes", "ExpertParallelMoE", "ExpertDataParallel", "set_moe_groups", "apply_ep", "is_expert_param",
           "reduce_expert_parallel_grads", "expert_bytes_per_forward", "exchange_sizes"]
