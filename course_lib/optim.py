"""The course's optimizer arithmetic, written once: one AdamW step on one tensor, in torch's order of operations.

Every optimizer the course builds from scratch — ZeRO-Offload's CPU Adam (notebook 07), the SSD tier's, 8-bit Adam
(notebook 09), the mixed-precision master-weight optimizer — updates a tensor with `adamw_`, so a change of recipe
(where the state lives, in what precision) never changes the update rule, and each can be checked bit for bit
against `torch.optim.AdamW` (single-tensor path, foreach=False) on the same numbers.

Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019 (docs/formulas.md §1).
"""
from __future__ import annotations

import torch


def adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int, *,
           lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW step on one tensor, in place (Loshchilov & Hutter, ICLR 2019), in the order of operations of
    torch.optim.AdamW's single-tensor path — so the CPU step can be checked bit for bit against torch's:

        θ ← θ·(1 − lr·λ);  m ← m + (1 − β₁)(g − m);  v ← β₂·v + (1 − β₂)·g²
        θ ← θ − lr/(1 − β₁ᵗ) · m / (√v / √(1 − β₂ᵗ) + ε)
    """
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


__all__ = ["adamw_"]
