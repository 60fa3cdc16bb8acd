"""FP8 training simulated on a CPU: Micikevicius et al., "FP8 Formats for Deep Learning", 2022 (arXiv
2209.05433), and Transformer Engine's delayed scaling (formulas §7.3).

Per tensor, scale = fp8_max / max(amax history) · 2^−margin, taken from amaxes recorded *before* this step; E4M3 for
inputs and weights, E5M2 for output gradients, in the linear layers. Simulated: the matmul inputs are real float8
tensors (1 byte each, saved for backward as such); the products are accumulated in fp32 on the CPU. Checked
against torchao's float8 training (current scaling) in tests/unit/test_precision.py.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from .formats import _f32, get_format, saturating_cast, spacing


class Fp8Scaling:
    """One tensor's FP8 scaling factor (formulas §7.3).

    delayed=True (Transformer Engine's DelayedScaling): scale = fp8_max / max(last `history_len` amaxes) · 2^−margin,
    from amaxes recorded BEFORE this cast; the current amax is appended afterwards. With no history yet the scale is
    1 (TE's initial value). delayed=False: the current tensor's own amax (torchao's dynamic "tensorwise" scaling).
    Values beyond the range saturate; a non-finite input is cast to NaN and its amax is not recorded.
    """

    def __init__(self, fmt="fp8_e4m3", *, delayed: bool = True, history_len: int = 16, margin: int = 0):
        self.fmt = get_format(fmt)
        if self.fmt.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"FP8 scaling needs fp8_e4m3 or fp8_e5m2, got {self.fmt.name}")
        if not isinstance(history_len, int) or history_len < 1:
            raise ValueError(f"history_len must be a positive integer, got {history_len!r}")
        self.delayed, self.history_len, self.margin = delayed, history_len, margin
        # a scaled value beyond the last rounding interval (max + half a step) is clipped, not rounded
        self.beyond = self.fmt.max + float(spacing(self.fmt.max, self.fmt)) / 2
        self.amax_history: list[float] = []      # finite amaxes, newest last
        self.scales: list[float] = []            # the scale used at each cast
        self.amaxes: list[float] = []            # the tensor's own amax at each cast
        self.saturated: list[int] = []           # elements clipped at each cast (beyond max + half a step)

    def scale_for(self, amax: float) -> float:
        if not amax > 0 or not math.isfinite(amax):
            return 1.0
        # as torchao: fp8_max / amax in float64, then float32
        return _f32(self.fmt.max / amax * 2.0 ** -self.margin)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(x·scale as a float8 tensor, scale); x ≈ x_fp8 / scale."""
        amax = float(x.detach().abs().max()) if x.numel() else 0.0
        ref = max(self.amax_history[-self.history_len:], default=0.0) if self.delayed else amax
        scale = self.scale_for(ref)
        scaled = x.detach().float() * scale
        self.scales.append(scale)
        self.amaxes.append(amax)
        self.saturated.append(int((scaled.abs() > self.beyond).sum()) if amax * scale > self.beyond else 0)
        if math.isfinite(amax):
            self.amax_history.append(amax)
            del self.amax_history[:-self.history_len]
        return saturating_cast(scaled, self.fmt), scale


class Fp8Matmul(torch.autograd.Function):
    """y = x·Wᵀ with x, W cast to E4M3 and, in backward, ∂y cast to E5M2; the float8 tensors are what is saved."""

    @staticmethod
    def forward(ctx, x, weight, mod):
        x8, sx = mod.fp8["input"].quantize(x)                       # (..., in) float8_e4m3fn
        w8, sw = mod.fp8["weight"].quantize(weight)                 # (out, in) float8_e4m3fn
        ctx.save_for_backward(x8, w8)
        ctx.scales, ctx.mod, ctx.dtypes = (sx, sw), mod, (x.dtype, weight.dtype)
        y = (x8.float() / sx) @ (w8.float() / sw).t()               # (..., in) @ (in, out): fp32 accumulation
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        x8, w8 = ctx.saved_tensors
        sx, sw = ctx.scales
        g8, sg = ctx.mod.fp8["grad_output"].quantize(grad_y)        # (..., out) float8_e5m2
        g, x, w = g8.float() / sg, x8.float() / sx, w8.float() / sw
        grad_x = g @ w                                              # (..., out) @ (out, in) → (..., in)
        grad_w = g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])   # (out, N) @ (N, in) → (out, in)
        return grad_x.to(ctx.dtypes[0]), grad_w.to(ctx.dtypes[1]), None


def _scalings(*, delayed: bool = True, history_len: int = 16, margin: int = 0) -> dict:
    """One Fp8Scaling per tensor of a linear layer: E4M3 for its input and weight, E5M2 for its output gradient."""
    kw = dict(delayed=delayed, history_len=history_len, margin=margin)
    return {"input": Fp8Scaling("fp8_e4m3", **kw), "weight": Fp8Scaling("fp8_e4m3", **kw),
            "grad_output": Fp8Scaling("fp8_e5m2", **kw)}


class Fp8Linear(nn.Linear):
    """nn.Linear whose matmul runs in simulated FP8 (forward E4M3, backward E5M2), one Fp8Scaling per tensor.
    The bias is added outside the FP8 product, in the input's dtype (so its gradient is the unquantized one)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, delayed: bool = True,
                 history_len: int = 16, margin: int = 0):
        super().__init__(in_features, out_features, bias=bias)
        self.fp8 = _scalings(delayed=delayed, history_len=history_len, margin=margin)

    @classmethod
    def from_linear(cls, lin: nn.Linear, **kw) -> Fp8Linear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = lin.in_features, lin.out_features
        new.weight, new.bias = lin.weight, lin.bias                 # the same Parameter objects
        new.fp8 = _scalings(**kw)
        return new

    def forward(self, x):
        y = Fp8Matmul.apply(x, self.weight, self)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def apply_fp8(model: nn.Module, *, delayed: bool = True, history_len: int = 16, margin: int = 0,
              filter=None) -> nn.Module:
    """Swap every nn.Linear whose name passes `filter` (default: those inside the transformer blocks — the LM head
    stays in high precision, a common choice) for an Fp8Linear sharing its parameters. In place; returns `model`."""
    filter = filter or (lambda name: "blocks." in name)
    swaps = [(name, mod) for name, mod in model.named_modules() if type(mod) is nn.Linear and filter(name)]
    if not swaps:
        raise ValueError("apply_fp8 found no nn.Linear to convert (check `filter`)")
    for name, lin in swaps:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child,
                Fp8Linear.from_linear(lin, delayed=delayed, history_len=history_len, margin=margin))
    return model


def fp8_scalings(model: nn.Module) -> dict:
    """{linear name: {'input' | 'weight' | 'grad_output': Fp8Scaling}} of every Fp8Linear in `model`."""
    return {name: mod.fp8 for name, mod in model.named_modules() if isinstance(mod, Fp8Linear)}


__all__ = ["Fp8Scaling", "Fp8Linear", "apply_fp8", "fp8_scalings"]
