"""Dynamic loss scaling (Micikevicius et al., "Mixed Precision Training", ICLR 2018, arXiv 1710.03740, §3.2;
docs/formulas.md §7.1): × S before backward, ÷ S before the step, skip the step and back off S on inf/NaN, grow S
after `growth_interval` clean steps — the same trajectory as `torch.amp.GradScaler`, which `grad_scaler_trajectory`
runs as the reference. Which ranks must agree on an overflow: `course_lib.optim.overflow_vote`.
"""
from __future__ import annotations

import math

import torch

from .formats import _f32


class DynamicLossScaler:
    """Dynamic loss scaling (Micikevicius et al. 2018 §3.2; PyTorch's GradScaler rule, formulas §7.1).

        backward on S·loss          small gradients are multiplied by S, so they stay above fp16's 2^−24
        unscale: g ← g / S          in fp32, on the master copy's gradients (exact: S is a power of two)
        inf or NaN in any g?        yes: skip the optimizer step, S ← S · backoff_factor, counter ← 0
                                    no:  step; counter += 1; when counter == growth_interval: S ← S · growth_factor
                                         (unless that overflows), counter ← 0

    Usable from any training loop: `scale_loss(loss)` before backward (a custom step_fn), or `attach(loss)`, which
    multiplies the gradient entering `loss` by S so that `loss.backward()` in the plain loop backpropagates S·loss
    while the loop still reports the true loss; then `unscale_(grads)` → found_inf and `update(found_inf)`.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"init_scale must be a positive finite number, got {init_scale!r}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1 (the scale grows after clean steps), got {growth_factor!r}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1) (the scale shrinks on overflow), "
                             f"got {backoff_factor!r}")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive integer, got {growth_interval!r}")
        self.scale = _f32(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.growth_tracker = 0              # clean steps since the last change of scale
        self.history: list[tuple[float, bool]] = []   # (scale used, found_inf) for every update

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def attach(self, loss: torch.Tensor) -> torch.Tensor:
        """Make `loss.backward()` backpropagate S·loss (a hook on the gradient entering `loss`); returns `loss`."""
        if loss.requires_grad:
            loss.register_hook(lambda g: g * self.scale)
        return loss

    @torch.no_grad()
    def unscale_(self, grads) -> bool:
        """Divide every gradient by S in place (fp32 tensors, please); True if any holds an inf or a NaN."""
        inv = _f32(1.0 / self.scale)                 # GradScaler multiplies by the float32 reciprocal
        found_inf = False
        for g in grads:
            if g is None:
                continue
            g.mul_(inv)
            found_inf = found_inf or not bool(torch.isfinite(g).all())
        return found_inf

    def update(self, found_inf: bool) -> None:
        """The state machine: back off on overflow, grow after `growth_interval` clean steps in a row."""
        self.history.append((self.scale, bool(found_inf)))
        if found_inf:
            self.scale = _f32(self.scale * self.backoff_factor)
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            grown = _f32(self.scale * self.growth_factor)
            if math.isfinite(grown):
                self.scale = grown
            self.growth_tracker = 0

    @property
    def skipped_steps(self) -> int:
        return sum(inf for _, inf in self.history)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.growth_tracker = _f32(state["scale"]), int(state["growth_tracker"])


def scaler_trajectory(scaler, found_infs) -> list[float]:
    """The scale after each `update(found_inf)` of any scaler with `.scale` and `.update` (ours, or a learner's)."""
    out = []
    for inf in found_infs:
        scaler.update(bool(inf))
        out.append(float(scaler.scale))
    return out


def grad_scaler_trajectory(found_infs, *, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                           backoff_factor: float = 0.5, growth_interval: int = 2000) -> list[float]:
    """The reference: torch.amp.GradScaler("cpu") fed the same overflow / no-overflow steps (a one-element model
    whose gradient is inf or finite); its scale after each `update()`."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    gs = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=growth_factor,
                              backoff_factor=backoff_factor, growth_interval=growth_interval)
    out = []
    for inf in found_infs:
        gs.scale(torch.zeros(()))                    # GradScaler creates its scale tensor on first use
        p.grad = torch.full((1,), math.inf if inf else 1.0)
        gs.step(opt)                                 # unscale_, find the inf, skip or step
        gs.update()
        out.append(float(gs.get_scale()))
    return out


__all__ = ["DynamicLossScaler", "scaler_trajectory", "grad_scaler_trajectory"]
