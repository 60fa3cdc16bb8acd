"""Weight-only post-training quantization by round-to-nearest: int8 per output channel, int4 per group of
`group_size` input weights, fp16 scales (docs/formulas.md §7.5); dequantized on the fly in forward. Built on the
block-wise codes (`blockwise`): a group is a block.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from .blockwise import QTensor, dequantize_blockwise, payload_bytes, quantize_blockwise


class QuantizedLinear(nn.Module):
    """A Linear whose weight is stored as int8 (per output channel) or packed int4 (per group of `group_size`
    consecutive input weights, each row's last group zero-padded when group_size does not divide in_features),
    with fp16 scales (formulas §7.5); forward dequantizes the weight and runs an fp32 linear (weight-only: the
    activations stay fp32). Storage: out·in bytes (int8) or out·⌈in/g⌉·g/2 (int4), + 2 bytes per scale."""

    def __init__(self, lin: nn.Linear, bits: int = 8, group_size: int | None = None):
        super().__init__()
        if bits not in (8, 4):
            raise ValueError(f"weight-only quantization supports 8 or 4 bits, got {bits!r}")
        out_f, in_f = lin.weight.shape
        g = in_f if group_size is None else group_size
        if not isinstance(g, int) or g < 1:
            raise ValueError(f"group_size must be a positive integer (or None: one group per output channel), "
                             f"got {group_size!r}")
        self.in_features, self.out_features, self.bits, self.group_size = in_f, out_f, bits, g
        groups = -(-in_f // g)
        w = F.pad(lin.weight.detach().float(), (0, groups * g - in_f))      # (out, G·g): pad each row's last group
        q = quantize_blockwise(w, g, "int8" if bits == 8 else "int4", scale_dtype=torch.float16)
        self.register_buffer("codes", q.codes)
        self.register_buffer("scales", q.scales)                            # (out·G,) fp16
        self.bias = None if lin.bias is None else nn.Parameter(lin.bias.detach().clone(), requires_grad=False)

    def error_bound(self) -> torch.Tensor:
        """(out, in): Δ/2 of each weight's group, plus one fp32 rounding of the dequantized value (formulas §7.5)."""
        g, qmax = self.group_size, 127 if self.bits == 8 else 7
        step = self.scales.float().view(self.out_features, -1).repeat_interleave(g, dim=1)[:, :self.in_features]
        return step / 2 + qmax * step * 2.0 ** -24

    def dequantized_weight(self) -> torch.Tensor:
        g = self.group_size
        groups = -(-self.in_features // g)
        q = QTensor(self.codes, self.scales, torch.Size([self.out_features, groups * g]),
                    "int8" if self.bits == 8 else "int4", g)
        return dequantize_blockwise(q)[:, :self.in_features]                # (out, in)

    def forward(self, x):
        return F.linear(x, self.dequantized_weight(), self.bias)


def quantize_weights(model: nn.Module, *, bits: int = 8, group_size: int | None = None, filter=None) -> nn.Module:
    """A copy of `model` with every nn.Linear (whose name passes `filter`) replaced by a QuantizedLinear."""
    model = copy.deepcopy(model)
    swaps = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and (filter is None or filter(n))]
    for name, lin in swaps:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, QuantizedLinear(lin, bits, group_size))
    return model


def model_bytes(model: nn.Module) -> int:
    """Bytes of everything a checkpoint of the model stores: parameters and persistent buffers, unique storages."""
    seen, total = set(), 0
    for t in list(model.parameters()) + [b for n, b in model.named_buffers() if _persistent(model, n)]:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _persistent(model: nn.Module, name: str) -> bool:
    parent, _, child = name.rpartition(".")
    return child not in model.get_submodule(parent)._non_persistent_buffers_set


def ptq_bytes(model: nn.Module, *, bits: int, group_size: int | None = None, filter=None) -> int:
    """Closed form of `model_bytes(quantize_weights(model, ...))`: each quantized Linear's codes and fp16 scales,
    everything else at its own size."""
    total = model_bytes(model)
    for name, lin in model.named_modules():
        if isinstance(lin, nn.Linear) and (filter is None or filter(name)):
            out_f, in_f = lin.weight.shape
            g = in_f if group_size is None else group_size
            padded = out_f * -(-in_f // g) * g
            total += payload_bytes(padded, "int4" if bits == 4 else "int8") + 2 * (padded // g) \
                - lin.weight.numel() * lin.weight.element_size()
    return total


__all__ = ["QuantizedLinear", "quantize_weights", "model_bytes", "ptq_bytes"]
