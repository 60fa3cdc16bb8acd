"""Mixed-precision training from scratch (Micikevicius et al., "Mixed Precision Training", ICLR 2018, arXiv
1710.03740, §3): a low-precision compute copy of the weights, an fp32 master copy the optimizer updates, the loss
(a softmax over the vocabulary: a reduction) in fp32, and dynamic loss scaling where the recipe asks for it.

Precision is chosen in one place, by a recipe (`recipes.RECIPES`):

    model = apply_precision(model, mesh, recipe="bf16")     in place: the same model, of the same kind
    opt = course_lib.optim.build(model, **hyper)             fp32 masters around AdamW (`optimizer_class`)

`apply_precision` keeps each parameter's fp32 value as its master (`optim.set_master`), casts the parameters to
the compute dtype, and hooks the LM head (`lm_head`, if the model has one: a GPT, a TensorParallelGPT, the last
pipeline stage) so the logits leave it in fp32 — whatever loss the model computes from them (lm_loss, the
vocab-parallel loss) runs in fp32 — and, with loss scaling, so that backward starts from S·∂loss/∂logits.

On this CPU, fp16 matrix products have no hardware path and are emulated several times slower than fp32; the fp16
recipe therefore runs them as a GPU's tensor cores do — fp16 inputs, products and sums in fp32, the output rounded
to fp16 (`fp32_accumulation`, which `model.step_fn()` puts around forward and backward) — which is the numerics of
mixed-precision training (Micikevicius §3.3), not a shortcut.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from ...core.handles import attach
from ...optim.master import MixedPrecisionOptimizer
from .loss_scale import DynamicLossScaler
from .recipes import Recipe, get_recipe

# ============================================================================================ fp16 on a CPU
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
            torch.ops.aten.baddbmm.default}         # what matmul, linear and @ reach at the dispatcher


_HALF = (torch.float16, torch.bfloat16)


class _Fp32Accumulation(TorchDispatchMode):
    """fp16 (and bf16) matrix products on the CPU as a tensor core computes them: 16-bit inputs, every product and
    sum in fp32, the result rounded once to the inputs' dtype. (An fp16·fp16 product has ≤ 22 significant bits and a
    bf16·bf16 one ≤ 16: exact in fp32.) bf16 is included because this CPU has no bf16 matrix unit either: its
    fallback kernel also accumulates in fp32, only several times slower."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS:
            low = next((a.dtype for a in args if isinstance(a, torch.Tensor) and a.dtype in _HALF
                        and a.device.type == "cpu"), None)
            if low is not None:
                up = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
                return func(*up, **kwargs).to(low)
        return func(*args, **kwargs)


@contextlib.contextmanager
def fp32_accumulation():
    """Run fp16 and bf16 matmuls (mm, bmm, addmm, baddbmm) with fp32 accumulation inside the block — forward and
    backward."""
    with _Fp32Accumulation():
        yield


# ============================================================================================ mixed precision
class MixedPrecisionModel(nn.Module):
    """What `apply_precision` makes of a model: the model itself — its class becomes a subclass of this one and
    of its own (`MixedPrecisionGPT`, `MixedPrecisionPipelineStage`, … as FSDP2's `fully_shard` does), so it keeps
    its forward, its pieces (embed, blocks, head, loss) and its parameter names — whose parameters are the
    recipe's compute copy, with:

        recipe            the Recipe it was cast by
        scaler            its DynamicLossScaler (recipes with loss scaling), else None
        mesh              the mesh whose every rank votes on an overflowed step (None: this process alone)
        optimizer_class() what builds its optimizer (course_lib.optim.build asks it): fp32 masters around the
                          inner optimizer where the recipe keeps them, with its scaler and mesh
        step_fn()         `train.run`'s step: for fp16, forward and backward under `fp32_accumulation`

    The logits leave `lm_head` in fp32 (a hook), so the loss is an fp32 reduction, and with loss scaling the
    gradient entering them is multiplied by S (`scaler.attach`): `loss.backward()` in the plain loop
    backpropagates S·loss while the loop still reports the true loss.
    """
    recipe: Recipe
    scaler: DynamicLossScaler | None
    mesh: object

    def optimizer_class(self, inner):
        """What builds this model's optimizer over a list of parameters, `cls(params, **hyper)`: with fp32 master
        weights a `MixedPrecisionOptimizer` around `inner` (masters: each parameter's `master_of`, else an fp32
        copy of it — ZeRO's shards), its loss scaler's unscale-and-skip, every rank of `mesh` voting on a skip
        (`optim.overflow_vote`); without them, `inner` itself. A model left in fp32 for a sharder that casts its
        own gathers (`apply_precision(cast=False)`: FSDP) keeps its fp32 shards as the masters: `inner` too,
        unless the loss is scaled."""
        r = self.recipe
        if not r.master_weights or (not self.cast and not r.loss_scaling):
            return inner

        def build(params, **hyper):
            return MixedPrecisionOptimizer(params, inner, scaler=self.scaler, vote=self.mesh, **hyper)
        return build

    def step_fn(self, inner=None):
        """A `train.run` step_fn: `inner` (default: `train.forward_backward`) under fp32 accumulation for fp16."""
        from ...train import forward_backward
        inner = inner or forward_backward
        if self.recipe.compute_dtype != torch.float16:
            return inner

        def step(model, batches, step, phase):
            with fp32_accumulation():
                return inner(model, batches, step, phase)
        return step


_CLASSES: dict = {}


def _mixed_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"MixedPrecision{cls.__name__}", (MixedPrecisionModel, cls), {"__module__": __name__})
    return _CLASSES[cls]


class _Fp32Logits:
    """The head's forward hook: logits to fp32, and the owner's loss scale attached to them. It reads the scaler
    from its owner at every call (a deep copy of the model then uses the copy's scaler)."""

    def __init__(self, owner: nn.Module):
        self.owner = owner

    def __call__(self, module, args, out):
        out = out.float()                                  # (B, T, V) or (B, T, V/t): the loss reduces in fp32
        scaler = self.owner.scaler
        return scaler.attach(out) if scaler is not None else out


def apply_precision(model: nn.Module, mesh=None, *, recipe: str | Recipe = "bf16",
                    scaler: DynamicLossScaler | None = None, head: str = "lm_head",
                    cast: bool = True) -> MixedPrecisionModel:
    """Cast `model` to the recipe's compute precision, in place; returns the same object, now also a
    MixedPrecisionModel (see there). Run it after tensor parallelism and the pipeline split (it casts whatever
    parameters this rank holds) and before data parallelism / ZeRO, which then reduce and shard the compute
    copy's gradients (half the bytes of fp32); build the optimizer last, with `course_lib.optim.build`.

    mesh: every rank of it (pp, dp and tp) agrees on whether a step overflowed (`optim.overflow_vote`). head: the
    submodule whose output are the logits (none: e.g. a pipeline stage without the head — the scaled gradient
    then arrives from the next stage). cast=False: the parameters stay fp32 and are their own masters, for a
    sharder that casts them itself (FSDP with compute_dtype=model.recipe.compute_dtype); only the fp32 logits and
    the loss scale are installed."""
    r = get_recipe(recipe)
    if isinstance(model, MixedPrecisionModel):
        raise ValueError(f"apply_precision: this model is already cast by recipe {model.recipe.name!r}; apply it once")
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError("apply_precision expects an fp32 model (it keeps the fp32 values as master weights); "
                         f"got parameters of {sorted({str(p.dtype) for p in model.parameters()})}")
    from ...optim.master import set_master  # the optimizer module finds the masters there
    if cast and r.master_weights:
        for p in model.parameters():
            set_master(p, p.detach().clone())
    if cast:
        model.to(r.compute_dtype)                             # in place: the same Parameter objects
    model.__class__ = _mixed_class(type(model))
    model.recipe = r
    model.scaler = (scaler or DynamicLossScaler()) if r.loss_scaling else None
    model.mesh = mesh
    model.cast = cast
    attach(model, "precision", model)
    lm_head = dict(model.named_modules()).get(head)
    if lm_head is not None and (r.compute_dtype != torch.float32 or model.scaler is not None):
        lm_head.register_forward_hook(_Fp32Logits(model))
    return model


# ============================================================================================ activation and
#                                                                                              parameter gradients
def backward_gradients(module: nn.Module, idx: torch.Tensor, targets: torch.Tensor, *, scale: float = 1.0) -> dict:
    """One backward of a GPT-shaped module (any dtype) on S·loss, the loss taken in fp32 from its logits; returns
    float64 copies, divided by S, of the gradients as the module's dtype held them: 'activations' (the logits and
    every block's output: what backward passes from layer to layer) and 'parameters'. A value that underflowed in
    fp16 is exactly 0 here."""
    from ...core.model import lm_loss
    acts = []
    hooks = [b.register_full_backward_hook(lambda mod, gin, gout: acts.append(gout[0].detach().double().flatten()))
             for b in module.blocks]
    module.zero_grad(set_to_none=True)
    ctx = fp32_accumulation() if next(module.parameters()).dtype == torch.float16 else contextlib.nullcontext()
    try:
        with ctx:
            logits, _ = module(idx)
            logits.retain_grad()
            (lm_loss(logits.float(), targets) * scale).backward()
    finally:
        for h in hooks:
            h.remove()
    out = {"activations": torch.cat([logits.grad.double().flatten()] + acts) / scale,
           "parameters": torch.cat([p.grad.double().flatten() for p in module.parameters()]) / scale}
    module.zero_grad(set_to_none=True)
    return out


def underflow_fraction(reference: torch.Tensor, low: torch.Tensor) -> float:
    """Of the elements that are non-zero in the fp32 reference, the fraction that are exactly 0 in low precision."""
    nonzero = reference != 0
    return float(((low == 0) & nonzero).sum()) / max(1, int(nonzero.sum()))


__all__ = ["fp32_accumulation", "MixedPrecisionModel", "apply_precision", "backward_gradients", "underflow_fraction"]
