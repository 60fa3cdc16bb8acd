"""Pipeline stages of the toy GPT: which blocks each stage runs, this rank's part of the model, what one
micro-batch leaves behind for backward on each stage, and the B/W split of the backward that zero-bubble
schedules need.

    GPT:      wte+wpe │ block 0 │ block 1 │ block 2 │ block 3 │ ln_f + lm_head + loss
    S=3:      ├──── stage 0 ────┤├ stage 1┤├──────── stage 2 ───────────────────────┤   (layers 2, 1, 1)
    S=2, v=2: ├ stage 0 ┤├ s. 1┤├ s. 2┤├────── stage 3 ─────────────────┤   rank 0: stages 0, 2; rank 1: 1, 3

The split is by blocks (`split_layers`, or any list of blocks per stage: uneven splits are allowed); the embedding
rides with stage 0 and the final LayerNorm, the head and the loss with the last stage. A `PipelineStage` keeps the
GPT's own modules and parameter names (`blocks.3.attn.wq.weight`), so every gradient can be compared with the
single-process model's by name.

Checked against: the activation bytes one micro-batch leaves on stage k (`stage_activation_bytes`, built from
`model.block_activation_bytes`) add up over the stages to `model.activation_bytes` — the whole model's count.

B/W split (Qi et al., ICLR 2024, §2): a linear layer y = x·Wᵀ + b has two gradients,

    B:  ∂L/∂x = ∂L/∂y · W            — the previous stage waits for it (critical path)
    W:  ∂L/∂W = (∂L/∂y)ᵀ · x,  ∂L/∂b = Σ ∂L/∂y   — nobody waits for it until the optimizer step

`defer_weight_grads(pending)` runs a forward whose linear layers, in backward, compute only ∂L/∂x and append
(W, b, x, ∂L/∂y) to `pending`; `run_weight_grads(pending)` computes the weight gradients later — as the authors'
ZB-H1 implementation does for linear layers (`WeightGradStore`, sail-sg/zero-bubble-pipeline-parallelism, branch
zb-h1-quick-start); LayerNorm and embedding gradients are cheap and stay in B. Until W runs, x and ∂L/∂y stay
counted as activations by any memory accountant.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ...model import GPT, GPTConfig, block_activation_bytes, lm_loss, stage_bounds


def split_layers(n_layer: int, num_stages: int, layers=None) -> list[tuple[int, int]]:
    """[start, end) blocks of each stage: `layers` blocks per stage if given (uneven is fine), else as even as
    possible (`model.stage_bounds`: earlier stages get the extra block)."""
    if layers is None:
        return stage_bounds(n_layer, num_stages)
    layers = list(layers)
    if len(layers) != num_stages or any(not isinstance(n, int) or n < 1 for n in layers) or sum(layers) != n_layer:
        raise ValueError(f"layers={layers} must give each of the {num_stages} stages at least one block and add up "
                         f"to the model's n_layer={n_layer}, e.g. {[e - s for s, e in stage_bounds(n_layer, num_stages)]}")
    starts = [sum(layers[:k]) for k in range(num_stages)]
    return [(s, s + n) for s, n in zip(starts, layers)]


class PipelineStage(nn.Module):
    """The stages of one rank: their blocks (`blocks[str(i)]`, the GPT's block i), the embedding if it holds
    stage 0, and ln_f + lm_head if it holds the last stage. Parameters keep the GPT's names.

    `forward(x, targets=None, stage=None)`: stage 0 takes token ids (b, T); the others take (b, T, d) activations;
    the last stage returns the mean loss over b·T tokens if `targets` is given, else logits (b, T, V).
    """

    def __init__(self, model: GPT, stages, bounds, num_virtual_stages: int):
        super().__init__()
        if model.config.tie_weights:
            raise ValueError("the pipeline split needs untied embeddings: with tie_weights=True the LM head on the last "
                             "stage shares its weight with the embedding on stage 0 (another rank); use a config "
                             "with tie_weights=False")
        self.config: GPTConfig = model.config
        self.stages = sorted(stages)
        self.bounds = {k: tuple(bounds[k]) for k in self.stages}
        self.last = num_virtual_stages - 1
        if 0 in self.stages:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop      # GPT.embed: embedding dropout too
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for k in self.stages for i in range(*self.bounds[k])})
        if self.last in self.stages:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, stage: int | None = None):
        if stage is None:
            if len(self.stages) != 1:
                raise ValueError(f"this rank holds stages {self.stages}: say which one runs (stage=…)")
            stage = self.stages[0]
        if stage == 0:
            x = GPT.embed(self, x)                              # (b, T) ids → (b, T, d)
        for i in range(*self.bounds[stage]):
            x = self.blocks[str(i)](x)                          # (b, T, d)
        if stage != self.last:
            return x
        logits = GPT.head(self, x)                              # (b, T, V)
        return logits if targets is None else lm_loss(logits, targets)


def stage_activation_bytes(cfg: GPTConfig, bounds, stage: int, micro_batch_size: int, elem_bytes: int = 4) -> int:
    """Bytes one micro-batch leaves saved for backward on `stage` (float32 by default): its blocks, plus the token
    ids and positions the embedding saves on stage 0 (and its dropout mask, with dropout on), plus ln_f, the
    log-softmax, the targets and cross-entropy's total weight on the last stage. Stage k > 0 saves its received
    input as its first block's input, so the stages add up to `model.activation_bytes` exactly."""
    B, T, d, V = micro_batch_size, cfg.seq_len, cfg.d_model, cfg.vocab_size
    start, end = bounds[stage]
    n = (end - start) * block_activation_bytes(cfg, B, T, elem_bytes)
    if stage == 0:
        n += 8 * B * T + 8 * T                                   # token ids (int64) and positions
        n += elem_bytes * B * T * d if cfg.dropout > 0 else 0    # the embedding dropout's mask
    if stage == len(bounds) - 1:
        n += elem_bytes * B * T * (2 * d + V) + 8 * B * T        # ln_f in/out, log-softmax out; ln_f mean and rstd
        n += 8 * B * T + 4                                       # targets (int64), cross-entropy's total weight
    return n


# ============================================================================================ B/W split
def _holder():
    """How to keep a tensor 'saved for backward' outside autograd: through the saved-tensor hooks active now (a
    memory accountant's, which then goes on counting it as an activation), or as it is."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        return lambda t: (lambda: t)
    pack, unpack = hooks
    return lambda t: functools.partial(unpack, pack(t))


class _LinearDeferredW(torch.autograd.Function):
    """y = x·Wᵀ + b whose backward returns only ∂L/∂x and leaves (W, b, x, ∂L/∂y) in `pending` for W."""

    @staticmethod
    def forward(ctx, x, weight, bias, pending):
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias, ctx.pending, ctx.hold = weight, bias, pending, _holder()
        return F.linear(x, weight, bias)                       # (…, in) → (…, out)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        ctx.pending.append((ctx.weight, ctx.bias, ctx.hold(x), ctx.hold(grad_out)))
        return grad_out @ ctx.weight, None, None, None         # (…, out) @ (out, in) → (…, in)


class defer_weight_grads(TorchFunctionMode):
    """`with defer_weight_grads(pending): out = stage(x)` — every linear layer of this forward defers its weight
    gradient to `run_weight_grads(pending)`."""

    def __init__(self, pending: list):
        super().__init__()
        self.pending = pending

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return _LinearDeferredW.apply(x, weight, bias, self.pending)
        return func(*args, **kwargs)


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    p.grad = g if p.grad is None else p.grad.add_(g)


@torch.no_grad()
def run_weight_grads(pending: list) -> None:
    """W: the deferred weight gradients, ∂L/∂W = (∂L/∂y)ᵀ·x and ∂L/∂b = Σ ∂L/∂y, accumulated into .grad; empties
    `pending` (and with it the x and ∂L/∂y it held)."""
    while pending:
        weight, bias, x, grad_out = pending.pop()
        g = grad_out().reshape(-1, weight.shape[0])             # (N, out), N = b·T
        _accumulate(weight, g.T @ x().reshape(-1, weight.shape[1]))   # (out, N) @ (N, in) → (out, in)
        if bias is not None:
            _accumulate(bias, g.sum(0))                          # (out,)


__all__ = ["PipelineStage", "split_layers", "stage_activation_bytes", "defer_weight_grads", "run_weight_grads"]
