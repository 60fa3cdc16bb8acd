"""The course's optimizer, written once, and the one factory every training setup builds its optimizer with.

    adamw      `adamw_`, the one AdamW step on one tensor, in torch's order of operations (Loshchilov & Hutter,
               ICLR 2019); `AdamW`, the optimizer applying it — bit for bit torch.optim.AdamW(foreach=False)
    master     fp32 master weights for a low-precision compute copy (Micikevicius et al., ICLR 2018):
               `MixedPrecisionOptimizer` around any inner optimizer, dynamic loss scaling's unscale and skip, and
               `overflow_vote`, which makes every rank of a mesh skip the same steps

8-bit Adam (`memopt.quantize.Adam8bit`) and ZeRO-Offload's host and SSD tiers (`memopt.offload.OffloadAdam`) step
with the same `adamw_`.

The optimizer is built once, last, over what the techniques applied to the model left it to update:

    optimizer = build(model, optimizer="adamw", **hyper)      hyper: lr, betas, eps, weight_decay, …

`build` asks the handles the techniques left on the model (`core.handles`), each for its part, and imports none of
them: precision wraps the optimizer class in fp32 master weights (`optimizer_class`), offload replaces it by its
host or disk optimizer (`optimizer_class`), and what reduces the gradients builds it over its shards
(`build_optimizer`: ZeRO-1/2) — or, with none of them, `optimizer(model.parameters(), **hyper)`.
"""
from __future__ import annotations

from ..core.handles import handles
from .adamw import AdamW, adamw_
from .master import MixedPrecisionOptimizer, kept_master, master_of, overflow_vote, set_master

OPTIMIZERS = {"adamw": AdamW}
# what may change the optimizer class, innermost first: the compute copy's masters, then where the step runs
CLASS_CHANGERS = ("precision", "optimizer_offload")


def resolve(optimizer):
    """An optimizer class from a name in OPTIMIZERS, or the class (any torch.optim.Optimizer) as it is."""
    if isinstance(optimizer, str):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {optimizer!r}; use one of {sorted(OPTIMIZERS)} or an optimizer class")
        return OPTIMIZERS[optimizer]
    if not callable(optimizer):
        raise ValueError(f"optimizer must be a name ({sorted(OPTIMIZERS)}) or an optimizer class, got {optimizer!r}")
    return optimizer


def build(model, *, optimizer="adamw", **hyper):
    """The optimizer of a training run over `model` (after every `apply_<technique>`): `optimizer` (a name or a
    class) as the techniques applied to the model change it — see the module docstring."""
    applied = handles(model)
    cls = resolve(optimizer)
    for technique in CLASS_CHANGERS:
        if technique in applied:
            cls = applied[technique].optimizer_class(cls)
    sharder = getattr(applied.get("data_parallel"), "build_optimizer", None)
    if sharder is not None:
        return sharder(model.parameters(), cls, **hyper)
    return cls(model.parameters(), **hyper)


__all__ = ["adamw_", "AdamW", "MixedPrecisionOptimizer", "master_of", "kept_master", "set_master", "overflow_vote",
           "OPTIMIZERS", "resolve", "build"]
