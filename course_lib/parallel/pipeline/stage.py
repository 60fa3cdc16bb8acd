"""Pipeline stages of the toy GPT: which blocks each stage runs, this rank's part of the model, what one
micro-batch leaves behind for backward on each stage, and the B/W split of the backward that zero-bubble
schedules need.

    GPT:      wte+wpe │ block 0 │ block 1 │ block 2 │ block 3 │ ln_f + lm_head + loss
    S=3:      ├──── stage 0 ────┤├ stage 1┤├──────── stage 2 ───────────────────────┤   (layers 2, 1, 1)
    S=2, v=2: ├ stage 0 ┤├ s. 1┤├ s. 2┤├────── stage 3 ─────────────────┤   rank 0: stages 0, 2; rank 1: 1, 3

The split is by blocks (`split_layers`, or any list of blocks per stage: uneven splits are allowed); the embedding
rides with stage 0 and the final LayerNorm, the head and the loss with the last stage. A `PipelineStage` keeps the
GPT's own modules and parameter names (`blocks.3.attn.wq.weight`), so every gradient can be compared with the
single-process model's by name, and runs the model's own `embed`, `head` and `loss` — the GPT's, or a
tensor-parallel model's (vocab-parallel head and loss, sequence-split activations), whichever was split.

Checked against: the activation bytes one micro-batch leaves on stage k (`stage_activation_bytes`, built from
`model.block_activation_bytes`) add up over the stages to `model.activation_bytes` — the whole model's count.

B/W split (Qi et al., ICLR 2024, §2): a linear layer y = x·Wᵀ + b has two gradients,

    B:  ∂L/∂x = ∂L/∂y · W            — the previous stage waits for it (critical path)
    W:  ∂L/∂W = (∂L/∂y)ᵀ · x,  ∂L/∂b = Σ ∂L/∂y   — nobody waits for it until the optimizer step

`defer_weight_grads(pending)` runs a forward whose linear layers, in backward, compute only ∂L/∂x and append
(W, b, x, ∂L/∂y) to `pending`; `run_weight_grads(pending)` computes the weight gradients later — as the authors'
ZB-H1 implementation does for linear layers (`WeightGradStore`, sail-sg/zero-bubble-pipeline-parallelism, branch
zb-h1-quick-start); LayerNorm and embedding gradients are cheap and stay in B. Until W runs, x and ∂L/∂y stay
counted as activations by any memory accountant. W is itself a (tiny) autograd backward, so its gradients reach
.grad the way every other gradient does: accumulated by autograd, announced by the post-accumulate-grad hooks that
data parallelism and ZeRO-2 act on.
"""
from __future__ import annotations

import copy
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ...core.model import GPTConfig, block_activation_bytes, embed_activation_bytes, head_activation_bytes, stage_bounds


def split_layers(n_layer: int, num_stages: int, layers=None) -> list[tuple[int, int]]:
    """[start, end) blocks of each stage: `layers` blocks per stage if given (uneven is fine), else as even as
    possible (`model.stage_bounds`: earlier stages get the extra block)."""
    if layers is None:
        return stage_bounds(n_layer, num_stages)
    layers = list(layers)
    if len(layers) != num_stages or any(not isinstance(n, int) or n < 1 for n in layers) or sum(layers) != n_layer:
        raise ValueError(f"layers={layers} must give each of the {num_stages} stages at least one block and add up "
                         f"to the model's n_layer={n_layer}, "
                         f"e.g. {[e - s for s, e in stage_bounds(n_layer, num_stages)]}")
    starts = [sum(layers[:k]) for k in range(num_stages)]
    return [(s, s + n) for s, n in zip(starts, layers)]


EMBEDDING = ("wte", "wpe", "drop")     # the modules `model.embed` runs: they ride with stage 0
HEAD = ("ln_f", "lm_head")            # the modules `model.head` and `model.loss` run: with the last stage


def _shell(model: nn.Module, keep) -> nn.Module:
    """`model` without the submodules this rank does not hold: the same object kind with the same attributes
    (a tensor-parallel model's communicator, its sequence-parallel flag …), so its own `embed`, `head` and `loss`
    run here, on the very modules the stage registers."""
    shell = copy.copy(model)                               # shallow: shares every module and attribute
    shell.__dict__["_modules"] = {n: m for n, m in model._modules.items() if n in keep}
    return shell


def check_splittable(model) -> None:
    """One clear TypeError unless `model` can be cut into stages: the course GPT or its tensor-parallel form."""
    if isinstance(model, PipelineStage):
        raise TypeError("this model is already a pipeline stage: split the GPT (or its tensor-parallel form) once")
    missing = [a for a in ("config", "blocks", "embed", "head", "loss", "hidden_shape") if not hasattr(model, a)]
    if missing:
        inner = (f" around {type(model.module).__name__}" if isinstance(getattr(model, "module", None), nn.Module)
                 else "")
        raise TypeError(f"a pipeline stage is cut from the course GPT or its tensor-parallel form (apply_tp), which "
                        f"have {', '.join(missing)}; got {type(model).__name__}{inner}. Split the model before data "
                        f"parallelism, ZeRO, precision or offload wrap it")


class PipelineStage(nn.Module):
    """The stages of one rank: their blocks (`blocks[str(i)]`, the GPT's block i), the embedding if it holds
    stage 0, and ln_f + lm_head if it holds the last stage. Parameters keep the GPT's names.

    `model` is the course GPT or its tensor-parallel form (`tensor.apply_tp`, before or after the split): the stage
    runs that model's OWN `embed`, `head` and `loss` (`stage.model`: the model less what this rank does not hold),
    so a vocab-parallel head and loss stay what they are.

    `forward(x, targets=None, stage=None)`: stage 0 takes token ids (b, T); the others take the activations
    `hidden_shape(b, T)` — (b, T, d), or (b, T/t, d) under sequence parallelism; the last stage returns the
    model's loss over b·T tokens if `targets` is given, else logits (b, T, V) (V/t under tensor parallelism).
    """

    def __init__(self, model: nn.Module, stages, bounds, num_virtual_stages: int):
        super().__init__()
        check_splittable(model)
        if model.config.tie_weights and num_virtual_stages > 1:
            raise ValueError("the pipeline split needs untied embeddings: with tie_weights=True the LM head on the "
                             "last stage shares its weight with the embedding on stage 0 (another rank); use a config "
                             "with tie_weights=False")
        self.config: GPTConfig = model.config
        self.stages = sorted(stages)
        self.bounds = {k: tuple(bounds[k]) for k in self.stages}
        self.last = num_virtual_stages - 1
        held = dict(model.named_children())
        first = [n for n in EMBEDDING if 0 in self.stages and n in held]
        end = [n for n in HEAD if self.last in self.stages and n in held]
        for name in first:                                  # registered in the GPT's order: embedding, blocks, head
            setattr(self, name, held[name])
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for k in self.stages for i in range(*self.bounds[k])})
        for name in end:
            setattr(self, name, held[name])
        self.rebind(_shell(model, first + end))

    @property
    def model(self) -> nn.Module:
        """The model whose `embed`, `head`, `loss` and `hidden_shape` this stage runs (not a registered submodule:
        its modules are the stage's own)."""
        return self.__dict__["_model"]

    def rebind(self, model: nn.Module) -> None:
        """Run the embedding, head and loss through `model`, whose modules are this stage's — what `apply_tp` does
        to a stage after it made the stage's modules tensor-parallel."""
        self.__dict__["_model"] = model

    def hidden_shape(self, batch_size: int, seq_len: int | None = None) -> tuple:
        """What one micro-batch sends across a stage boundary (the executor's receive buffers)."""
        return self.model.hidden_shape(batch_size, seq_len)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, stage: int | None = None):
        if stage is None:
            if len(self.stages) != 1:
                raise ValueError(f"this rank holds stages {self.stages}: say which one runs (stage=…)")
            stage = self.stages[0]
        if stage not in self.bounds:
            raise ValueError(f"stage {stage} does not run on this rank, which holds stages {self.stages}")
        if stage == 0:
            x = self.model.embed(x)                             # (b, T) ids → hidden_shape(b, T)
        for i in range(*self.bounds[stage]):
            x = self.blocks[str(i)](x)                          # hidden_shape(b, T)
        if stage != self.last:
            return x
        logits = self.model.head(x)                             # (b, T, V), or (b, T, V/t) under TP
        return logits if targets is None else self.model.loss(logits, targets)


def stage_activation_bytes(cfg: GPTConfig, bounds, stage: int, micro_batch_size: int, elem_bytes: int = 4) -> int:
    """Bytes one micro-batch leaves saved for backward on `stage` (float32 by default): its blocks, plus what the
    embedding saves on stage 0 (`model.embed_activation_bytes`) and what the head and the loss save on the last
    (`model.head_activation_bytes`). Stage k > 0 saves its received input as its first block's input, so the
    stages add up to `model.activation_bytes` exactly."""
    B, T = micro_batch_size, cfg.seq_len
    start, end = bounds[stage]
    n = (end - start) * block_activation_bytes(cfg, B, T, elem_bytes)
    if stage == 0:
        n += embed_activation_bytes(cfg, B, T, elem_bytes)
    if stage == len(bounds) - 1:
        n += head_activation_bytes(cfg, B, T, elem_bytes)
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


class LinearDeferredW(torch.autograd.Function):
    """y = x·Wᵀ + b whose backward returns only ∂L/∂x and leaves (W, b, x, ∂L/∂y) in `pending` for W. W and b come
    in a tuple, not as inputs autograd tracks: B does not touch their .grad, nor announce (with a hook) a gradient
    that is not there yet."""

    @staticmethod
    def forward(ctx, x, params, pending):
        weight, bias = params
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias, ctx.pending, ctx.hold = weight, bias, pending, _holder()
        return F.linear(x, weight, bias)                       # (…, in) → (…, out)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        ctx.pending.append((ctx.weight, ctx.bias, ctx.hold(x), ctx.hold(grad_out)))
        return grad_out @ ctx.weight, None, None               # (…, out) @ (out, in) → (…, in)


class defer_weight_grads(TorchFunctionMode):
    """`with defer_weight_grads(pending): out = stage(x)` — every linear layer of this forward whose input needs a
    gradient defers its weight gradient to `run_weight_grads(pending)` (one whose input does not has no B to split
    from: it keeps its weight gradient in the ordinary backward)."""

    def __init__(self, pending: list):
        super().__init__()
        self.pending = pending

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and args[0].requires_grad and torch.is_grad_enabled():
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return LinearDeferredW.apply(x, (weight, bias), self.pending)
        return func(*args, **kwargs)


class _WeightGrad(torch.autograd.Function):
    """W of one deferred linear as an autograd node over (W, b): its backward returns ∂L/∂W = (∂L/∂y)ᵀ·x and
    ∂L/∂b = Σ ∂L/∂y, so autograd itself accumulates them into .grad and then fires each parameter's
    post-accumulate-grad hooks — the one gradient-ready path DDP's overlap and ZeRO-2's buckets listen to."""

    @staticmethod
    def forward(ctx, weight, bias, x, grad_out):            # x, grad_out: how to get the held tensors back
        ctx.x, ctx.grad_out, ctx.has_bias = x, grad_out, bias is not None
        return weight.new_zeros(())                          # a handle to call backward on

    @staticmethod
    def backward(ctx, _):
        x, grad_out, ctx.x, ctx.grad_out = ctx.x, ctx.grad_out, None, None     # freed once W ran
        g = grad_out()
        g = g.reshape(-1, g.shape[-1])                                          # (N, out), N = b·T
        x = x()
        grad_w = g.T @ x.reshape(-1, x.shape[-1])                               # (out, N) @ (N, in) → (out, in)
        return grad_w, g.sum(0) if ctx.has_bias else None, None, None          # (out,)


def run_weight_grads(pending: list) -> None:
    """W: the deferred weight gradients, ∂L/∂W = (∂L/∂y)ᵀ·x and ∂L/∂b = Σ ∂L/∂y, accumulated into .grad by
    autograd (so gradient hooks fire as after any backward); empties `pending` (and with it the x and ∂L/∂y it
    held)."""
    handles = []
    while pending:
        weight, bias, x, grad_out = pending.pop()
        if weight.requires_grad or (bias is not None and bias.requires_grad):
            with torch.enable_grad():
                handles.append(_WeightGrad.apply(weight, bias, x, grad_out))
    if handles:
        torch.autograd.backward(handles)


__all__ = ["PipelineStage", "check_splittable", "EMBEDDING", "HEAD", "split_layers", "stage_activation_bytes",
           "defer_weight_grads", "run_weight_grads"]
