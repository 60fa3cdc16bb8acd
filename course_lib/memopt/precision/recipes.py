"""Precision recipes — what each tensor of training is stored in — and their exact bytes per parameter.

A recipe names the compute dtype (weights, activations and gradients of forward and backward), whether an fp32
master copy is what the optimizer updates, and whether the loss is scaled. Model states with Adam: fp16 mixed
precision 2 + 2 + 4 + 4 + 4 = 16 bytes per parameter (ZeRO, Rajbhandari et al. SC'20 §3.1, K = 12); 8-bit Adam's
state 2 + 8/B (Dettmers et al. 2022; formulas §7.4). The one place precision is chosen: `apply_precision` casts the
model by the recipe, `course_lib.optim.build` builds the optimizer from it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Recipe:
    """What each tensor of training is stored in.

    compute_dtype: the weights, activations and gradients that forward and backward touch (the compute copy);
    master_weights: an fp32 copy the optimizer updates (and whose dtype its state then has);
    loss_scaling: dynamic loss scaling (needed by fp16's narrow range, not by bf16's fp32-sized exponent).
    """
    name: str
    compute_dtype: torch.dtype
    master_weights: bool
    loss_scaling: bool
    description: str = ""

    @property
    def compute_bytes(self) -> int:
        return torch.empty(0, dtype=self.compute_dtype).element_size()

    @property
    def state_bytes(self) -> int:
        """Bytes per element of the optimizer's own state (Adam's m and v live in the dtype of what it updates)."""
        return 4 if self.master_weights else self.compute_bytes


RECIPES: dict[str, Recipe] = {
    "fp32": Recipe("fp32", torch.float32, False, False, "everything in fp32"),
    "bf16": Recipe("bf16", torch.bfloat16, True, False, "bf16 compute copy, fp32 master weights"),
    "fp16": Recipe("fp16", torch.float16, True, True, "fp16 compute copy, fp32 master weights, dynamic loss scale"),
    "fp16-unscaled": Recipe("fp16-unscaled", torch.float16, True, False, "fp16 + fp32 master, no loss scaling"),
    "bf16-pure": Recipe("bf16-pure", torch.bfloat16, False, False, "bf16 weights, gradients and Adam state"),
}


def get_recipe(recipe: str | Recipe) -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    if recipe not in RECIPES:
        raise ValueError(f"unknown precision recipe {recipe!r}; use one of {sorted(RECIPES)}")
    return RECIPES[recipe]


def model_state_bytes(recipe: str | Recipe, numels, *, optimizer: str = "adamw", block_size: int = 2048) -> dict:
    """Exact bytes of the model states after an optimizer step, as the memory accountant labels them:

        parameters  Σn · e_compute                  (the compute copy)
        gradients   Σn · e_compute
        optimizer   fp32 master 4Σn (if any) + adamw: m and v 2Σn·e_state + a 4-byte `step` tensor per tensor
                                               adam8bit: 2Σn (one byte each) + 2 fp32 absmax per block of each
                                                         tensor (formulas §7.4; its step count is a Python int)
    `numels`: the parameter tensors' element counts.
    """
    r = get_recipe(recipe)
    numels = [int(n) for n in numels]
    psi = sum(numels)
    master = 4 * psi if r.master_weights else 0
    if optimizer == "adamw":
        state = 2 * psi * r.state_bytes + 4 * len(numels)
    elif optimizer == "adam8bit":
        state = 2 * psi + 2 * 4 * sum(-(-n // block_size) for n in numels)
    else:
        raise ValueError(f"unknown optimizer {optimizer!r}; use 'adamw' or 'adam8bit'")
    return {"parameters": psi * r.compute_bytes, "gradients": psi * r.compute_bytes, "optimizer": master + state}


def bytes_per_parameter(recipe: str | Recipe, optimizer: str = "adamw", block_size: int = 2048) -> dict:
    """The per-parameter split in the ZeRO paper's style (no per-tensor `step` counters): weights, gradients,
    master, optimizer state — e.g. fp16 with Adam: 2 + 2 + 4 + 8 = 16 bytes (Rajbhandari et al., SC'20 §3.1)."""
    r = get_recipe(recipe)
    if optimizer not in ("adamw", "adam8bit"):
        raise ValueError(f"unknown optimizer {optimizer!r}; use 'adamw' or 'adam8bit'")
    state = 2 * r.state_bytes if optimizer == "adamw" else 2 + 8 / block_size     # 8-bit: 2 B + 2 fp32 per block
    row = {"weights": r.compute_bytes, "gradients": r.compute_bytes, "master": 4 if r.master_weights else 0,
           "optimizer state": state}
    row["total"] = sum(row.values())
    return row


__all__ = ["Recipe", "RECIPES", "get_recipe", "model_state_bytes", "bytes_per_parameter"]
