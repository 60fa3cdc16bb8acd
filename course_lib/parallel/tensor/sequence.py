"""Sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
MLSys 2023, arXiv 2205.05198, §4.2.2): the LayerNorm regions, which Megatron 1D replicates on every tp rank, are
split along the sequence instead, and each all-reduce becomes a reduce-scatter + all-gather pair (g / ḡ in
`megatron.py`).

    1D:  x ─ LN ─ f ─[ attention, split by heads ]─ g ─ + ─ LN ─ f ─[ MLP, split by columns/rows ]─ g ─ +
    SP:  x ─ LN ─ g ─[ attention, split by heads ]─ ḡ ─ + ─ LN ─ g ─[ MLP, split by columns/rows ]─ ḡ ─ +
         └ (B, T/t, d) ┘└──────── (B, T, ·/t) ─────────┘└ (B, T/t, d) ┘ …

What a region keeps for backward: its first linears (q, k, v; fc_in) need the whole sequence of their input. The
paper keeps only this rank's slice and all-gathers it again in backward (`regather=True`, Megatron-LM's choice):
activation memory is then the paper's formula, and backward makes one more all-gather per region. Keeping the
gathered input instead (`regather=False`) sends exactly 1D's bytes and stores 2·sbh more per layer.

Checked against (docs/formulas.md §4.3, bytes per layer and rank, `layer_activation_bytes`): the paper's
sbh(34 + 5as/h) → sbh(10 + 24/t + 5as/(ht)) with TP → sbh/t·(34 + 5as/h) with TP + SP, for 16-bit activations
with dropout. The toy model has no dropout and runs in e-byte elements; `layer_activation_bytes` says how that
changes each term, and the memory accountant must find exactly that.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...core.model import blocks_of
from ...memory import saved_tensors_hooks_over
from ...train import Probe
from .megatron import f, g_sp, gather_seq


# ============================================================================================ LayerNorm on a slice
class SequenceParallelLayerNorm(nn.LayerNorm):
    """LayerNorm on this rank's slice of the sequence. Its weight and bias are replicated, but each rank's
    gradient covers only its tokens: f (identity forward, all-reduce backward) on the parameters sums them."""

    def __init__(self, ln: nn.LayerNorm, comm, *, tag: str = "ln"):
        super().__init__(ln.normalized_shape, eps=ln.eps, elementwise_affine=ln.elementwise_affine,
                         bias=ln.bias is not None, dtype=ln.weight.dtype if ln.weight is not None else None)
        self.load_state_dict(ln.state_dict())
        self.comm, self.tag = comm, tag

    def forward(self, x):                                  # x: (B, T/t, d)
        w = None if self.weight is None else f.apply(self.weight, self.comm, f"sp_params/{self.tag}.weight")
        b = None if self.bias is None else f.apply(self.bias, self.comm, f"sp_params/{self.tag}.bias")
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)


# ============================================================================================ keep the slice only
class _Regather:
    """What autograd keeps instead of a gathered region input: this rank's slice, gathered again on first use."""

    def __init__(self, comm, shard: torch.Tensor, tag: str):
        self.comm, self.shard, self.tag, self.full = comm, shard, tag, None

    def gathered(self) -> torch.Tensor:
        if self.full is None:                  # the first linear's backward to need it; the others reuse it
            self.full = gather_seq(self.comm, self.shard, self.tag)
        return self.full


@contextlib.contextmanager
def saving_slice_only(comm, shard: torch.Tensor, gathered: torch.Tensor, tag: str):
    """Inside the block, a tensor autograd saves that lives in `gathered`'s storage (the linears' input, or a view
    of it) is kept as `shard` and all-gathered again in backward (Korthikanti et al. §4.2.2). Saved-tensor hooks
    that enclose this one (a memory accountant) see the slice, so it is what they count."""
    note = _Regather(comm, shard.detach(), tag)
    ptr = gathered.untyped_storage().data_ptr()
    live = [True]       # a pack after the block (ZB-H1's W keeps tensors through the hooks of their forward) must
                        # not match: by then `gathered` may be freed and its address reused by another tensor

    def pack(t):
        if not live[0] or t.untyped_storage().data_ptr() != ptr:
            return t
        kept = note.shard.view_as(note.shard)                  # a tensor, so an enclosing hook can count it
        kept._regather = (note, t.size(), t.stride(), t.storage_offset())
        return kept

    def unpack(x):
        info = getattr(x, "_regather", None)
        if info is None:
            return x
        note_, size, stride, offset = info
        return note_.gathered().as_strided(size, stride, offset)   # the same layout as the tensor that was saved

    try:
        with saved_tensors_hooks_over(pack, unpack):
            yield
    finally:
        live[0] = False


class SequenceParallelRegion:
    """Turns `module` (attention or MLP of a block) into a sequence-parallel region with forward hooks: its input
    (B, T/t, d) goes through g (all-gather along the sequence); with `regather`, what its linears save of the
    gathered input is only this rank's slice. Hooks, not a wrapper module, so parameter names do not change."""

    def __init__(self, module: nn.Module, comm, *, regather: bool = True, tag: str = "region"):
        self.comm, self.regather, self.tag = comm, regather, tag
        self._saving = None
        module.register_forward_pre_hook(self._enter)
        module.register_forward_hook(self._exit, always_call=True)

    def _enter(self, module, args):
        shard, *rest = args
        full = g_sp.apply(shard, self.comm, f"{self.tag}:g")               # (B, T, d)
        if self.regather:
            self._saving = saving_slice_only(self.comm, shard, full, f"sp_regather/{self.tag}.bwd")
            self._saving.__enter__()
        return (full, *rest)

    def _exit(self, module, args, output):
        saving, self._saving = self._saving, None
        if saving is not None:
            saving.__exit__(None, None, None)


# ============================================================================================ activation bytes
def paper_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False) -> float:
    """Korthikanti et al. Table 2, as published (16-bit activations, 1-byte dropout masks), bytes per layer."""
    if sequence_parallel:
        return s * b * h / t * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, *, sequence_parallel: bool = False,
                           regather: bool = True, elem: int = 4, mlp_ratio: int = 4) -> dict:
    """Bytes one layer of the toy GPT saves for backward on one rank, term by term (exact; no dropout).

    The paper's terms at 16 bits, and what they become here with e-byte elements and no dropout:
        LayerNorm inputs 4sbh        → 2e·sbh          the two residual-stream tensors the LNs read
        QKV and fc_in inputs 4sbh    → 2e·sbh          the two LN outputs (whole sequence on every rank in 1D)
        dropout masks 2sbh           → 0               no dropout
        Q, K, V, attention out 8sbh  → 4e·sbh/t        split by heads
        GeLU in, fc_out in 16sbh     → 2r·e·sbh/t      split by columns (r = mlp_ratio = 4)
        scores 5as²b                 → e·as²b/t        softmax output only: no dropout mask (1) or output (2)
    so 34 + 5as/h becomes e·(16 + as/h) per sbh (e = 2: 32 + 2as/h). Two small terms the paper leaves out, which
    the accountant sees: LayerNorm's mean and rstd (2 per LN, e bytes per token) and the boolean causal mask (s²).
    With SP (regather) every term is divided by t; with regather=False the two region inputs stay whole (2e·sbh).
    """
    sbh, r = s * b * h, mlp_ratio
    t_rep = t if sequence_parallel else 1                  # what SP splits: the LN region
    ln_in = 2 * elem * sbh // t_rep
    region_in = 2 * elem * sbh // (t_rep if regather else 1)
    split = (4 + 2 * r) * elem * sbh // t
    scores = elem * a * s * s * b // t
    ln_stats = 2 * 2 * elem * s * b // t_rep
    mask = s * s
    out = {"LN inputs": ln_in, "region inputs": region_in, "split (QKV, attn out, MLP)": split, "scores": scores,
           "LN mean/rstd": ln_stats, "causal mask": mask}
    out["total"] = sum(out.values())
    return out


def tp_activation_bytes(cfg, batch_size: int, t: int, *, sequence_parallel: bool = False, elem: int = 4) -> int:
    """Bytes the whole TensorParallelGPT saves for backward on one tp rank in one forward (exact; no dropout,
    Megatron-LM's regather under SP): every layer's `layer_activation_bytes`, plus

        embedding   8·bs + bs          this rank's int64 ids and the bool mask of ids outside its rows
                    + 8·s'             the int64 positions of its tokens (s' = s/t under SP, else s)
        ln_f        2e·bs'h + 2e·bs'   its input and output (the head's input), mean and rstd
        loss        e·bs·V'/t + 9·bs   the vocab-parallel softmax of this rank's V'/t columns (V' = V padded to a
                                       multiple of t), the int64 local targets and their bool mask

    — the vocab-parallel head never holds the (b, s, V) logits a single process keeps."""
    from ...core.model import get_config
    from .megatron import padded_vocab
    c = get_config(cfg)
    b, s, h = batch_size, c.seq_len, c.d_model
    s_rep = s // t if sequence_parallel else s                 # tokens of the LayerNorm regions on this rank
    layers = c.n_layer * layer_activation_bytes(s, b, h, c.n_head, t, sequence_parallel=sequence_parallel,
                                                elem=elem, mlp_ratio=c.mlp_ratio)["total"]
    embed = 9 * b * s + 8 * s_rep
    ln_f = 2 * elem * b * s_rep * h + 2 * elem * b * s_rep
    loss = elem * b * s * padded_vocab(c.vocab_size, t) // t + 9 * b * s
    return layers + embed + ln_f + loss


class LayerActivationProbe(Probe):
    """Bytes each block adds to the memory accountant's 'activations' during the first forward of `at_step`
    (what that block saves for backward), read around every block `model.blocks_of(model)` finds. Needs a
    `MemoryProbe`, placed before this one in the probe list."""
    name = "layer_activations"

    def __init__(self, memory_probe, *, at_step: int = 0):
        self.memory, self.at_step = memory_probe, at_step
        self.per_layer: list[int] = []
        self._hooks, self._before, self._on = [], 0, False

    def start(self, model, optimizer):
        for block in blocks_of(model):
            self._hooks.append(block.register_forward_pre_hook(self._pre))
            self._hooks.append(block.register_forward_hook(self._post))

    def enter(self, step, phase):
        self._on = step == self.at_step and phase == "forward" and not self.per_layer

    def exit(self, step, phase):
        self._on = False

    def _pre(self, module, args):
        if self._on:
            self._before = self.memory.tracker.current["activations"]

    def _post(self, module, args, output):
        if self._on:
            self.per_layer.append(self.memory.tracker.current["activations"] - self._before)

    def close(self):
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def finish(self):
        self.close()
        return list(self.per_layer)


__all__ = ["SequenceParallelLayerNorm", "SequenceParallelRegion", "saving_slice_only", "paper_activation_bytes",
           "layer_activation_bytes", "tp_activation_bytes", "LayerActivationProbe"]
