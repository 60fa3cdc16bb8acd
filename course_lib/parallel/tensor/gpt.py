"""`apply_tp(model, mesh)`: the course GPT made tensor-parallel over the mesh's tp axis, from a table of
(module, style) built on `course_lib.core.model.TP_PLAN` — Megatron 1D, optionally with sequence parallelism.

    style              what happens to the module                                           communication
    vocab_embedding    VocabParallelEmbedding: rows of the (padded) vocabulary              g  (SP: ḡ)
    region             attention / MLP: f on its input, once (SP: g, the sequence gathered) f  (SP: g_sp)
    colwise            ColumnParallelLinear (q, k, v, fc_in)                                none
    rowwise            RowParallelLinear (wo, fc_out)                                       g  (SP: ḡ)
    sequence           LayerNorm (SP): on a slice of the sequence, parameter gradients summed    (SP only)
    replicate          kept whole on every rank (1D LayerNorms, positions)                  none
    vocab_head         lm_head split by vocabulary rows → logits (B, T, V/t) → vocab-parallel cross-entropy

Why "region" and not f inside every column-parallel linear: q, k and v share one input, so three f's would
all-reduce its gradient three times — 6 all-reduces per block instead of Megatron's 4 (`plan="naive"` shows it;
DTensor's plain ColwiseParallel plan does the same until `PrepareModuleInput` replicates the attention input once).

The model keeps its parameter names (`blocks.0.attn.wq.weight` is now this rank's rows of it), so gradients and
weights compare name by name with the single-process model: `local_shard(name, full)` cuts the reference's tensor
the way this rank holds it. Checked against: loss and every gradient equal the single-process model's (float64),
and per layer the ledger shows `megatron.layer_bytes` (docs/formulas.md §4.1).
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from ...core.handles import attach, inherit
from ...distributed.mesh import axis_comm
from ...distributed.collectives import ring_all_gather_bytes, ring_all_reduce_bytes, ring_reduce_scatter_bytes
from ...core.model import GPT, TP_PLAN, blocks_of
from ..pipeline.stage import PipelineStage
from .megatron import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, all_reduce, f, g_sp,
                       layer_bytes,
                       padded_vocab, sp_layer_bytes, vocab_parallel_cross_entropy)
from .sequence import SequenceParallelLayerNorm, SequenceParallelRegion, saving_slice_only

STYLES = ("vocab_embedding", "region", "colwise", "rowwise", "sequence", "replicate", "vocab_head")
_KIND_TO_STYLE = {"column": "colwise", "row": "rowwise"}


def tp_plan(model, *, sequence_parallel: bool = False, plan: str = "megatron") -> list[tuple[str, str]]:
    """The table `apply_tp` follows: (module name, style) for every module tensor parallelism touches — of a GPT,
    or of a pipeline stage (its blocks, under the GPT's indices, and the embedding or head only where it holds
    them). plan='megatron' puts f (or SP's g) once at the entry of attention and MLP; 'naive' lets every
    column-parallel linear apply its own f (1D only)."""
    if plan not in ("megatron", "naive"):
        raise ValueError(f"plan must be 'megatron' (f once per region: 4 all-reduces per block) or 'naive' "
                         f"(f in every column-parallel linear: 6), got {plan!r}")
    if plan == "naive" and sequence_parallel:
        raise ValueError("sequence parallelism needs plan='megatron': the sequence is gathered once per region")
    per_rank = "sequence" if sequence_parallel else "replicate"
    held = dict(model.named_children())
    table = [(n, style) for n, style in (("wte", "vocab_embedding"), ("wpe", per_rank)) if n in held]
    for i, block in model.blocks.named_children():   # '0', '1', … of a GPT; the GPT's block indices on a stage
        for region in ("attn", "mlp"):
            table.append((f"blocks.{i}.{'ln1' if region == 'attn' else 'ln2'}", per_rank))
            if region == "mlp" and not hasattr(block.mlp, "fc_in"):   # a mixture of experts: whole on every rank
                continue
            if plan == "megatron":
                table.append((f"blocks.{i}.{region}", "region"))
            table += [(f"blocks.{i}.{n}", _KIND_TO_STYLE[k]) for n, k in TP_PLAN.items() if n.startswith(region + ".")]
    return table + [(n, style) for n, style in (("ln_f", per_rank), ("lm_head", "vocab_head")) if n in held]


def check_tp(cfg, tp_size: int, *, sequence_parallel: bool = False, pad_vocab: bool = True) -> int:
    """Raise one clear error if the model cannot be split over tp_size ranks (called before any communication).
    Returns the vocabulary size the embedding and head are split with (padded to a multiple of tp_size)."""
    t = tp_size
    divisors = [k for k in range(1, cfg.n_head + 1) if cfg.n_head % k == 0]
    if cfg.n_head % t:
        raise ValueError(f"tensor parallelism splits attention by heads: tp_size={t} does not divide "
                         f"n_head={cfg.n_head}; use tp_size in {divisors} (or a model with more heads)")
    if cfg.d_model % t or (cfg.mlp_ratio * cfg.d_model) % t:
        raise ValueError(f"tp_size={t} does not divide the hidden size d_model={cfg.d_model} (or the MLP's "
                         f"{cfg.mlp_ratio * cfg.d_model}); use tp_size in {divisors}")
    if sequence_parallel and cfg.seq_len % t:
        raise ValueError(f"sequence parallelism splits the sequence: tp_size={t} does not divide "
                         f"seq_len={cfg.seq_len}; use a seq_len that is a multiple of {t}")
    if cfg.vocab_size % t and not pad_vocab:
        raise ValueError(f"tp_size={t} does not divide vocab_size={cfg.vocab_size}: pass pad_vocab=True to pad the "
                         f"vocabulary to {padded_vocab(cfg.vocab_size, t)} (rows never looked up, logits masked to "
                         f"-inf, so the loss is unchanged), or use a tp_size that divides {cfg.vocab_size}")
    return padded_vocab(cfg.vocab_size, t)


class TensorParallelGPT(nn.Module):
    """The course GPT after `apply_tp`: the same submodules under the same names, each in its tensor-parallel form.
    `forward(idx, targets)` returns (this rank's logits (B, T, V/t), loss); `embed`, `blocks`, `head` and `loss`
    are the pieces, as in `GPT`. With sequence parallelism, what flows between blocks is (B, T/t, d)
    (`hidden_shape`). Built over a pipeline stage, it holds only the stage's modules (the stage runs its pieces)."""

    def __init__(self, model: nn.Module, comm, table, *, sequence_parallel: bool, regather: bool, vocab: int):
        super().__init__()
        self.config, self.comm, self.table = model.config, comm, list(table)
        self.sequence_parallel, self.regather, self.vocab = sequence_parallel, regather, vocab
        held = dict(model.named_children())
        for name in ("wte", "wpe", "blocks", "ln_f", "lm_head"):
            if name in held:
                setattr(self, name, held[name])
        self._split = {}                          # parameter name -> (dim, rows padded to) of what this rank holds
        for name, module in self.named_modules():
            if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
                rows = vocab if name in ("wte", "lm_head") else None
                self._split.update({f"{name}.{p}": (0, rows) for p, _ in module.named_parameters()})
            elif isinstance(module, RowParallelLinear):
                self._split[f"{name}.weight"] = (1, None)

    @property
    def tp_size(self) -> int:
        return self.comm.world_size

    context = None             # (cp communicator, layout) when built over a ContextParallelGPT (`apply_tp`)

    def _cp_positions(self, seq_len: int):
        """The global positions of the tokens this cp rank holds (None without context parallelism)."""
        if self.context is None:
            return None
        from ..context import positions
        comm, layout = self.context
        return positions(seq_len, comm.world_size, comm.rank, layout)

    def hidden_shape(self, batch_size: int, seq_len: int | None = None) -> tuple[int, int, int]:
        """What flows between blocks on this rank: (B, T, d), or this rank's slice (B, T/t, d) under SP; T is the
        cp rank's T/cp tokens under context parallelism."""
        T = (seq_len or self.config.seq_len) // (1 if self.context is None else self.context[0].world_size)
        if self.sequence_parallel and T % self.tp_size:
            raise ValueError(f"sequence parallelism splits the sequence: length {T} is not a multiple of "
                             f"tp_size={self.tp_size}")
        return (batch_size, T // self.tp_size if self.sequence_parallel else T, self.config.d_model)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.config.seq_len:
            raise ValueError(f"sequence of length {T} is longer than the model's seq_len={self.config.seq_len}")
        pos = self._cp_positions(T)                              # CP: this cp rank's tokens, T/cp of them
        if pos is None:
            pos = torch.arange(T)
        else:
            idx = idx.index_select(1, pos)
        x = self.wte(idx)                                       # (B, T, d), or (B, T/t, d) with SP
        if not self.sequence_parallel:
            return x + self.wpe(pos)
        n = len(pos) // self.tp_size                             # SP: the positions of this rank's slice
        pos = pos[self.comm.rank * n:(self.comm.rank + 1) * n].clone()     # own storage: embedding saves it
        return x + nn.functional.embedding(pos, f.apply(self.wpe.weight, self.comm, "sp_params/wpe.weight"))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_f(x)
        if not self.sequence_parallel:
            return self.lm_head(f.apply(x, self.comm, "lm_head:f"))        # (B, T, V/t)
        full = g_sp.apply(x, self.comm, "lm_head:g")                      # (B, T, d)
        if not self.regather:
            return self.lm_head(full)
        with saving_slice_only(self.comm, x, full, "sp_regather/lm_head.bwd"):
            return self.lm_head(full)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = self._cp_positions(targets.shape[1])
        if pos is not None:                                      # CP: the mean over this cp rank's tokens
            targets = targets.index_select(1, pos)
        return vocab_parallel_cross_entropy(logits, targets, self.comm, start=self.comm.rank * logits.shape[-1],
                                            vocab_size=self.config.vocab_size)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        self.hidden_shape(1, idx.shape[1])         # one clear error if SP cannot split this rank's tokens
        x = self.embed(idx)
        for block in blocks_of(self):
            x = block(x)
        logits = self.head(x)
        loss = None if targets is None else self.loss(logits, targets)
        if loss is not None and self.config.n_expert:          # the load-balancing loss, as the GPT adds it
            from ...core.model import moe_aux_loss              # (SP: each tp rank's share of the mean over its
            loss = loss + moe_aux_loss(self) / (self.tp_size if self.sequence_parallel else 1)   # slices' groups)
        return logits, loss

    def stage_bounds(self, n_stages: int):
        from ...core.model import stage_bounds
        return stage_bounds(self.config.n_layer, n_stages)

    def local_shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of `full` (a parameter or gradient of the single-process model named `name`)."""
        if name not in self._split:
            return full
        dim, rows = self._split[name]
        if rows is not None and rows > full.shape[0]:            # the padded vocabulary: zero rows at the end
            full = torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])
        return full.chunk(self.tp_size, dim)[self.comm.rank]


def _check_tp_input(model) -> bool:
    """True for a pipeline stage, False for a GPT; one clear TypeError for anything else."""
    if isinstance(model, PipelineStage):
        if isinstance(model.model, TensorParallelGPT):
            raise TypeError("this pipeline stage is tensor-parallel already: apply_tp once, before or after the split")
        if not isinstance(model.model, GPT):
            raise TypeError(f"apply_tp rewrites a stage of the course GPT, not of {type(model.model).__name__}")
        return True
    from ..context import ContextParallelGPT
    if isinstance(model, (GPT, ContextParallelGPT)):
        return False
    if isinstance(model, TensorParallelGPT):
        raise TypeError("this model is tensor-parallel already: apply_tp once")
    inner = f" around {type(model.module).__name__}" if isinstance(getattr(model, "module", None), nn.Module) else ""
    raise TypeError(f"apply_tp rewrites the course GPT (course_lib.core.model.GPT) or a PipelineStage of it, got "
                    f"{type(model).__name__}{inner}: apply tensor parallelism before data parallelism, ZeRO, "
                    f"precision, recomputation or offload")


def apply_tp(model, mesh_or_comm, *, sequence_parallel: bool = False, regather: bool = True,
             plan: str = "megatron", pad_vocab: bool = True):
    """Tensor parallelism over the tp axis of `mesh_or_comm` (a Mesh, or a Communicator used as the tp group).

    `model` is the course GPT — returns its `TensorParallelGPT` — or a `PipelineStage` of it (pipeline first):
    the stage's modules are rewritten in place, it then runs a TensorParallelGPT's embedding, head and loss, and
    the same stage is returned. Every rank must hold the same model (built from the same seed); each keeps its
    slices. Sequence parallelism (Korthikanti et al.) splits the LayerNorm regions along the sequence; `regather`
    keeps only a slice of each region's input for backward (and gathers it again there). `pad_vocab` pads a
    vocabulary tp_size does not divide.
    """
    is_stage = _check_tp_input(model)
    comm = axis_comm(mesh_or_comm, "tp")
    table = tp_plan(model, sequence_parallel=sequence_parallel, plan=plan)
    vocab = check_tp(model.config, comm.world_size, sequence_parallel=sequence_parallel, pad_vocab=pad_vocab)
    tied = model.config.tie_weights
    for name, style in table:
        module = model.get_submodule(name)
        parent, _, attr = name.rpartition(".")
        new = None
        if style == "vocab_embedding":
            new = VocabParallelEmbedding(module, comm, vocab=vocab, sequence_parallel=sequence_parallel, tag=name)
        elif style == "colwise":
            new = ColumnParallelLinear(module, comm, input_f=plan == "naive", tag=name)
        elif style == "rowwise":
            new = RowParallelLinear(module, comm, sequence_parallel=sequence_parallel, tag=name)
        elif style == "sequence" and isinstance(module, nn.LayerNorm):
            new = SequenceParallelLayerNorm(module, comm, tag=name)
        elif style == "region" and sequence_parallel:
            SequenceParallelRegion(module, comm, regather=regather, tag=name)
        elif style == "region":
            module.register_forward_pre_hook(lambda m, args, tag=f"{name}:f": (f.apply(args[0], comm, tag),
                                                                              *args[1:]))
        elif style == "vocab_head":
            padded = nn.Linear(module.in_features, vocab, bias=False, dtype=module.weight.dtype)
            with torch.no_grad():
                padded.weight.copy_(torch.cat([module.weight.detach(), module.weight.new_zeros(
                    vocab - module.out_features, module.in_features)]))
            new = ColumnParallelLinear(padded, comm, input_f=False, tag=name)
            if tied:                                 # one parameter: the embedding's rows are the head's rows
                new.weight = model.wte.weight
        if new is not None:
            setattr(model.get_submodule(parent) if parent else model, attr, new)
    if sequence_parallel:                 # experts on a slice of the sequence: their gradients summed over tp
        for i, block in model.blocks.named_children():
            if not hasattr(block.mlp, "fc_in"):
                for pname, p in block.mlp.named_parameters():
                    p.register_hook(functools.partial(all_reduce, comm, tag=f"sp_params/blocks.{i}.mlp.{pname}"))
    tp = TensorParallelGPT(model, comm, table, sequence_parallel=sequence_parallel, regather=regather, vocab=vocab)
    if hasattr(model, "layout"):          # a ContextParallelGPT: its tokens and ring attention (on this rank's heads)
        tp.context = (model.comm, model.layout)
    if is_stage:
        model.rebind(tp)                # the stage's modules, now tensor-parallel, under TP's embed, head and loss
        attach(model, "tensor_parallel", tp)
        return model
    inherit(tp, model)
    attach(tp, "tensor_parallel", tp)
    return tp


# ============================================================================================ traffic
def layer_traffic(ledger, layer: int, group: str | None = None) -> dict:
    """Bytes this rank sent for block `layer`'s activations, split by phase (tags ending in '.bwd' were sent in
    backward), from the ledger. Parameter-gradient sums (SP's 'sp_params/…') and re-gathers are not included."""
    out = {"forward": 0, "backward": 0}
    for e in ledger.events:
        if e.sent and group in (None, e.group) and e.tag.startswith(f"blocks.{layer}."):
            out["backward" if e.tag.endswith(".bwd") else "forward"] += e.sent
    return out


def tp_bytes_per_microbatch(cfg, micro_batch_size: int, tp_size: int, rank: int, elem: int, *,
                            sequence_parallel: bool = False, regather: bool = True, plan: str = "megatron",
                            seq_len: int | None = None, layers: int | None = None, embed: bool = True,
                            head: bool = True, loss_elem: int | None = None,
                            experts_held: int | None = None) -> dict:
    """Bytes tp rank `rank` sends in one forward + backward of `apply_tp`'s model, by part (exact, ring collectives).
    A pipeline stage sends only its part: `layers` blocks (default: all n_layer), the embedding's collectives if
    it holds the embedding, the head's and the loss's if it holds the head (`PipelineLayout.parts(pp_rank)`).

        layers      `layers` × 4 all-reduces of b·s·h (`layer_bytes`); SP: 4 all-gathers + 4 reduce-scatters
        naive       plan='naive': q, k, v (and fc_in) each all-reduce their input gradient: 2 more per layer
        embed+head  the embedding's g and the head's f (SP: ḡ and g), b·s·h each
        loss        the vocab-parallel cross-entropy: all-reduce(max) of b·s, all-reduce of 2·b·s, at `loss_elem`
                    bytes an element (default `elem`; 4 under a mixed-precision recipe, whose hook hands the
                    loss fp32 logits)
        regather    SP with regather: the input of both regions of each layer and of the head, gathered again
        sp_params   SP: the gradients of what is replicated but used on a slice of the sequence (LayerNorms,
                    row-parallel biases, positions; with experts the router and the `experts_held` experts of
                    every MoE block, default all n_expert, once per tensor), summed over the tp ranks
    """
    b, s, h, t = micro_batch_size, seq_len or cfg.seq_len, cfg.d_model, tp_size
    L = cfg.n_layer if layers is None else layers
    ar = ring_all_reduce_bytes(b * s * h, t, rank, elem)
    ag = ring_all_gather_bytes(b * s * h, t, rank, elem)
    rs = ring_reduce_scatter_bytes(b * s * h, t, rank, elem)
    per_layer = (sp_layer_bytes if sequence_parallel else layer_bytes)(b, s, h, t, rank, elem)
    if cfg.n_expert:               # experts whole on every tp rank (`tp_plan`): only attention's 2 collectives
        per_layer //= 2
    out = {"layers": L * per_layer,
           "embed+head": (embed + head) * ((ag + rs) if sequence_parallel else ar),
           "loss": head * (ring_all_reduce_bytes(b * s, t, rank, loss_elem or elem)
                            + ring_all_reduce_bytes(2 * b * s, t, rank, loss_elem or elem))}
    if plan == "naive":
        out["naive"] = L * 2 * ar
    if sequence_parallel and regather:
        out["regather"] = ((1 if cfg.n_expert else 2) * L + head) * ag     # MoE blocks: attention's region only
    if sequence_parallel:
        nb = 1 if cfg.bias else 0
        per_block = [h] * (2 * (1 + nb) + 2 * nb)              # ln1, ln2; wo's and fc_out's biases
        if cfg.n_expert:                                        # no fc_out: the router and the experts held
            r, E = cfg.mlp_ratio * h, cfg.n_expert if experts_held is None else experts_held
            per_block = [h] * (2 * (1 + nb) + nb) + [cfg.n_expert * h] + E * ([r * h, h * r] + nb * [r, h])
        sizes = L * per_block + head * [h] * (1 + nb) + embed * [cfg.seq_len * h]
        out["sp_params"] = sum(ring_all_reduce_bytes(n, t, rank, elem) for n in sizes)
    return out


def tp_bytes_per_step(cfg, micro_batch_size: int, tp_size: int, rank: int, elem: int, *, num_microbatches: int = 1,
                      **options) -> int:
    """Bytes tp rank `rank` sends per optimizer step: M micro-batches (gradient accumulation or a pipeline's
    micro-batches), each forward + backward sending `tp_bytes_per_microbatch(…, **options)`."""
    return num_microbatches * sum(tp_bytes_per_microbatch(cfg, micro_batch_size, tp_size, rank, elem,
                                                          **options).values())


# ============================================================================================ PyTorch's own
def torch_tp_plan(*, prepare_input: bool = True) -> dict:
    """The DTensor plan for one Block: ColwiseParallel for q, k, v, fc_in; RowwiseParallel for wo, fc_out. With
    `prepare_input`, PrepareModuleInput marks the attention and MLP inputs replicated once — Megatron's f —
    which takes the block from 6 all-reduces to 4."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
    plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(), "mlp.fc_in": ColwiseParallel(), "mlp.fc_out": RowwiseParallel()}
    if prepare_input:
        for region in ("attn", "mlp"):
            plan[region] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
    return plan


def torch_parallelize_blocks(model: GPT, device_mesh, *, prepare_input: bool = True) -> GPT:
    """`parallelize_module` on every block of `model` over a 1-D DeviceMesh (the reference for `apply_tp`;
    embedding and head stay whole). The toy attention reads `wq.out_features` to count its heads, and
    parallelize_module leaves that at the global width while wq's output is now local: set it to the local one."""
    from torch.distributed.tensor.parallel import parallelize_module
    t = device_mesh.size()
    for block in blocks_of(model):
        parallelize_module(block, device_mesh, torch_tp_plan(prepare_input=prepare_input))
        block.attn.wq.out_features //= t
    return model


__all__ = ["apply_tp", "tp_plan", "check_tp", "TensorParallelGPT", "STYLES", "layer_traffic",
           "tp_bytes_per_microbatch", "tp_bytes_per_step", "torch_tp_plan", "torch_parallelize_blocks"]
