"""The course's optimizers, written once, and the one factory every training setup builds its optimizer with.

    adamw      `adamw_`, the one AdamW step on one tensor, in torch's order of operations (Loshchilov & Hutter,
               ICLR 2019); `AdamW`, the optimizer applying it — bit for bit torch.optim.AdamW(foreach=False)
    master     fp32 master weights for a low-precision compute copy (Micikevicius et al., ICLR 2018):
               `MixedPrecisionOptimizer` around any inner optimizer, dynamic loss scaling's unscale and skip, and
               `overflow_vote`, which makes every rank of a mesh skip the same steps
    eightbit   `Adam8bit`: AdamW's m and v kept as block-wise quantized bytes (Dettmers et al., ICLR 2022)

ZeRO-Offload's host and SSD tiers (course_lib.memopt.offload) step with the same `adamw_`.

Built once, at the end of the composition, from the precision recipe (course_lib.memopt.precision):

    make(params, recipe, *, optimizer="adamw", scaler=None, vote=None, **hyper)      an optimizer over params
    optimizer_class(recipe, *, optimizer="adamw", scaler=None, vote=None)            cls(params, **hyper) for a
                                                                                     sharder that builds it itself

A recipe with master weights gives a MixedPrecisionOptimizer whose inner optimizer is `optimizer`; one without
gives `optimizer` itself. ZeRO-1/2 shards it by building it over this rank's flat shards:
`ShardedOptimizer(params, optimizer_class(recipe, scaler=..., vote=mesh), comm, stage=..., **hyper)`.
"""
from __future__ import annotations

from .adamw import AdamW, adamw_
from .eightbit import Adam8bit, adam8bit_state_bytes
from .master import MixedPrecisionOptimizer, kept_master, master_of, overflow_vote, set_master

OPTIMIZERS = {"adamw": AdamW, "adam8bit": Adam8bit}


def _inner(optimizer):
    if isinstance(optimizer, str):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {optimizer!r}; use one of {sorted(OPTIMIZERS)} or an optimizer class")
        return OPTIMIZERS[optimizer]
    if not callable(optimizer):
        raise ValueError(f"optimizer must be a name ({sorted(OPTIMIZERS)}) or an optimizer class, got {optimizer!r}")
    return optimizer


def optimizer_class(recipe="fp32", *, optimizer="adamw", scaler=None, vote=None):
    """What builds this recipe's optimizer over a list of parameters: `cls(params, **hyper)`.

    recipe: a precision Recipe or its name (course_lib.memopt.precision.RECIPES); with master weights, the result
    builds a MixedPrecisionOptimizer (masters: each parameter's `master_of`, else an fp32 copy of it — ZeRO's
    shards) around `optimizer`. scaler: the model's DynamicLossScaler (`model.scaler` after `apply_precision`);
    vote: who must agree on skipping a step (a Mesh: every rank) — see `overflow_vote`."""
    from ..memopt.precision.recipes import get_recipe     # the recipe table lives with the formats it names
    r, inner = get_recipe(recipe), _inner(optimizer)
    if r.loss_scaling and scaler is None:
        raise ValueError(f"recipe {r.name!r} scales the loss: pass the model's scaler (model.scaler after "
                         f"apply_precision), or the gradients would never be unscaled")
    if not r.master_weights:
        if scaler is not None:
            raise ValueError(f"recipe {r.name!r} has no master weights, so nothing would unscale the gradients; "
                             f"use a recipe with master weights for loss scaling")
        return inner

    def build(params, **hyper):
        return MixedPrecisionOptimizer(params, inner, scaler=scaler, vote=vote, **hyper)
    return build


def make(params, recipe="fp32", *, optimizer="adamw", scaler=None, vote=None, **hyper):
    """The optimizer of a training run: `optimizer_class(recipe, ...)(params, **hyper)` (hyper: lr, betas, eps,
    weight_decay, and e.g. block_size for 8-bit Adam)."""
    return optimizer_class(recipe, optimizer=optimizer, scaler=scaler, vote=vote)(params, **hyper)


__all__ = ["adamw_", "AdamW", "Adam8bit", "adam8bit_state_bytes", "MixedPrecisionOptimizer", "master_of",
           "kept_master", "set_master", "overflow_vote", "OPTIMIZERS", "optimizer_class", "make"]
