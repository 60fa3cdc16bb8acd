"""Block-wise quantization and its error bound: a tensor, flattened, cut into blocks of `block_size` (the last one
may be shorter: it is quantized as a shorter block, nothing is padded on the wire); each block b is normalized by
its own absmax N_b, so one outlier spoils only its block.

Codes: 'int8' / 'int4' (symmetric round-to-nearest, Δ_b = N_b / 127 or / 7), 'dynamic' / 'dynamic_unsigned' (the
nearest of 256 values of Dettmers' dynamic map: Dettmers, Lewis, Shleifer & Zettlemoyer, "8-bit Optimizers via
Block-wise Quantization", ICLR 2022, arXiv 2110.02861), 'fp8_e4m3' / 'fp8_e5m2' (x·fp8_max/N_b cast to fp8).
Nearest rounding errs by at most half the gap of the grid around a value: ≤ N_b/254 for int8, N_b/14 for int4
(docs/formulas.md §7.5), N_b·gap/2 for the dynamic map (`error_bound` gives the bound element by element).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..precision.formats import get_format, saturating_cast, spacing

KINDS = ("int8", "int4", "dynamic", "dynamic_unsigned", "fp8_e4m3", "fp8_e5m2")
PAPER_BLOCK_SIZE = 2048            # Dettmers et al. 2022 §2


# ============================================================================================ the dynamic map
def dynamic_map(signed: bool = True) -> torch.Tensor:
    """Dettmers' dynamic quantization map: 256 sorted float32 values in [−1, 1] (unsigned: [0, 1]).

    A code is a decimal exponent and a linear fraction: for i = 0..6 the values 10^(i−6)·f, with f the midpoints of
    2^i (signed; unsigned: 2^(i+1)) equal steps of [0.1, 1] — so the smallest magnitudes get few, coarse codes and the
    top decade gets the most — plus 0 and 1 (and their negatives, when signed); unused codes are 0. The relative error
    is then roughly the same from 1e−6 to 1, which suits Adam's moments (they span many orders of magnitude).
    Built with the same float32 arithmetic as bitsandbytes' `create_dynamic_map`, which it equals exactly.
    """
    values = []
    for i in range(7):
        n = (2 ** i if signed else 2 ** (i + 1)) + 1
        bounds = torch.linspace(0.1, 1, n, dtype=torch.float32)
        mags = (10 ** (i - 6)) * ((bounds[:-1] + bounds[1:]) / 2.0)     # (n − 1,) midpoints of the fraction steps
        values += mags.tolist() + ((-mags).tolist() if signed else [])
    values += [0.0, 1.0]
    values += [0.0] * (256 - len(values))
    return torch.tensor(sorted(values), dtype=torch.float32)


_MAPS: dict = {}


def _smallest_positive(code: torch.Tensor) -> int:
    """Index of the map's smallest positive value (the unsigned map: 0, then 3.25e−7, …)."""
    key = ("smallest", code.data_ptr())
    if key not in _MAPS:
        _MAPS[key] = int((code > 0).nonzero()[0])
    return _MAPS[key]


def _map(kind: str) -> torch.Tensor:
    if kind not in _MAPS:
        _MAPS[kind] = dynamic_map(signed=kind == "dynamic")
    return _MAPS[kind]


def _mids(kind: str) -> torch.Tensor:
    """The 255 decision boundaries of a map: midpoints of neighbouring values."""
    if ("mids", kind) not in _MAPS:
        code = _map(kind)
        _MAPS["mids", kind] = (code[1:] + code[:-1]) / 2
    return _MAPS["mids", kind]


# ============================================================================================ block-wise codes
@dataclass
class QTensor:
    """A block-wise quantized tensor: `codes` (one per element; int4: two per byte) and one scale per block."""
    codes: torch.Tensor        # int8 | uint8 (dynamic: map index; int4: packed nibbles) | float8
    scales: torch.Tensor       # (blocks,): absmax N_b (dynamic), step Δ_b (int8/int4) or fp8 scale fp8_max/N_b
    shape: torch.Size
    kind: str
    block_size: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()


def _check(x: torch.Tensor, block_size: int, kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unsupported quantization kind {kind!r}; use one of {KINDS}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    if not x.is_floating_point():
        raise ValueError(f"quantize a floating-point tensor, got {x.dtype}")


def payload_bytes(n: int, kind: str) -> int:
    """Bytes of the codes of n elements (int4 packs two per byte)."""
    return (n + 1) // 2 if kind == "int4" else n


def block_lengths(n: int, block_size: int) -> list[int]:
    """Lengths of the blocks of n elements: full blocks, then a shorter last one if block_size does not divide n."""
    full, tail = divmod(n, block_size)
    return [block_size] * full + ([tail] if tail else [])


def _encode(flat: torch.Tensor, lengths: torch.Tensor, kind: str, scale_dtype=torch.float32,
            allow_nonfinite: bool = False):
    """flat (n,) fp32, cut into consecutive blocks of `lengths` (nb,) → (codes (n,), scales (nb,)).

    Blocks may differ in length (a short last block; the blocks of several tensors laid end to end), so the
    per-block absmax is a segment reduction and each element finds its block's scale by repeat_interleave.
    A block holding a NaN or inf (allowed only inside the ring) gets codes of 0 and a NaN scale: it decodes to NaN.
    """
    if flat.numel() == 0:
        return torch.zeros(0, dtype=torch.uint8 if kind.startswith("dynamic") else torch.int8), \
            torch.zeros(0, dtype=scale_dtype)
    absmax = torch.segment_reduce(flat.abs(), "max", lengths=lengths)      # (nb,) N_b (NaN/inf propagate)
    bad = ~torch.isfinite(absmax)
    if bad.any():
        if not allow_nonfinite:
            raise ValueError(f"cannot quantize a tensor with {int((~torch.isfinite(flat)).sum())} NaN/inf value(s): "
                             "it would become its block's absmax and turn the whole block into NaN or zeros. Skip or "
                             "repair the step first (a loss scaler's inf/NaN check does that for gradients)")
        codes, scales = _encode(torch.where(torch.isfinite(flat), flat, 0.0), lengths, kind, scale_dtype)
        return codes, torch.where(bad, torch.nan, scales.float()).to(scales.dtype)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))        # an all-zero block: codes of 0
    if kind in ("int8", "int4"):
        qmax = 127 if kind == "int8" else 7
        step = (safe / qmax).to(scale_dtype).clamp(min=torch.finfo(scale_dtype).tiny)   # Δ_b, as stored
        codes = torch.round(flat / step.float().repeat_interleave(lengths)).clamp_(-qmax, qmax)
        return codes.to(torch.int8), step
    if kind in ("dynamic", "dynamic_unsigned"):
        code, mids = _map(kind), _mids(kind)
        v = flat / safe.repeat_interleave(lengths)                          # (n,) in [−1, 1]
        codes = torch.bucketize(v, mids)                                    # the nearest map value's index
        if kind == "dynamic_unsigned":      # a positive value never becomes 0 (Adam's √v + eps would collapse)
            codes = torch.where((v > 0) & (codes == 0), _smallest_positive(code), codes)
        return codes.to(torch.uint8), absmax.to(scale_dtype)
    f = get_format(kind)                                                    # fp8: scale so N_b lands on fp8_max
    scale = (f.max / safe.double()).to(scale_dtype)
    return saturating_cast(flat * scale.float().repeat_interleave(lengths), f), scale


def _decode(codes: torch.Tensor, scales: torch.Tensor, lengths: torch.Tensor, kind: str) -> torch.Tensor:
    """(n,) codes and (nb,) scales → (n,) fp32."""
    s = scales.float().repeat_interleave(lengths)
    if kind in ("int8", "int4"):
        return codes.float() * s
    if kind in ("dynamic", "dynamic_unsigned"):
        return _map(kind)[codes.long()] * s
    return codes.float() / s


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [−7, 7] → uint8, two per byte (low nibble first); an odd count gets a zero nibble."""
    u = (codes.reshape(-1).to(torch.int16) + 8).to(torch.uint8)            # [1, 15]
    if u.numel() % 2:
        u = torch.cat([u, torch.full((1,), 8, dtype=torch.uint8)])
    pairs = u.view(-1, 2)                                                   # (n/2, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _unpack_int4(packed: torch.Tensor, n: int) -> torch.Tensor:
    lo, hi = packed & 0x0F, packed >> 4
    return (torch.stack([lo, hi], dim=1).reshape(-1)[:n].to(torch.int16) - 8).to(torch.int8)


def quantize_blockwise(x: torch.Tensor, block_size: int = PAPER_BLOCK_SIZE, kind: str = "int8", *,
                       scale_dtype=torch.float32, allow_nonfinite: bool = False) -> QTensor:
    """Quantize `x` flattened in blocks of `block_size` (see the module docstring). When block_size does not divide
    the length, the last block is simply shorter (nothing is padded or stored for the missing elements): exactly
    numel codes and ⌈numel / block_size⌉ scales. A NaN or inf is an error, unless allow_nonfinite=True: then its
    whole block decodes to NaN (what the quantized all-reduce uses to make every rank see an overflow)."""
    _check(x, block_size, kind)
    flat = x.detach().reshape(-1).float()
    codes, scales = _encode(flat, torch.tensor(block_lengths(flat.numel(), block_size)), kind, scale_dtype,
                            allow_nonfinite)
    return QTensor(_pack_int4(codes) if kind == "int4" else codes, scales, x.shape, kind, block_size)


def dequantize_blockwise(q: QTensor) -> torch.Tensor:
    """The fp32 tensor a QTensor stands for (its original shape)."""
    n = q.numel
    codes = _unpack_int4(q.codes, n) if q.kind == "int4" else q.codes.reshape(-1)
    return _decode(codes, q.scales, torch.tensor(block_lengths(n, q.block_size)), q.kind).reshape(q.shape)


def error_bound(x: torch.Tensor, q: QTensor) -> torch.Tensor:
    """Per element, the most quantization can err: half the gap between the two grid values around x (nearest
    rounding), plus one fp32 rounding of the dequantized product (N_b·2^−24, N_b the block's absmax).

    int8/int4: Δ_b/2 = N_b/254 or N_b/14 (formulas §7.5). dynamic: N_b·(c_{i+1} − c_i)/2 for x/N_b in [c_i, c_{i+1}]
    (beyond the map's ends, the distance to the end: the signed map's lowest value is −0.993, not −1; unsigned: a
    positive value below the smallest positive code is stored as that code, never as 0). fp8: half the fp8 spacing
    at x·scale, ÷ scale (after scaling |x| ≤ fp8_max, so nothing saturates)."""
    flat = x.detach().reshape(-1).double()
    n, B = flat.numel(), q.block_size
    per_elem = q.scales.double().repeat_interleave(B)[:n]                  # each element's block scale
    if q.kind in ("int8", "int4"):
        absmax = per_elem * (127 if q.kind == "int8" else 7)
        bound = per_elem / 2
    elif q.kind in ("dynamic", "dynamic_unsigned"):
        absmax = per_elem
        code = _map(q.kind).double()
        v = torch.where(per_elem > 0, flat / torch.where(per_elem > 0, per_elem, 1.0), 0.0)
        i = (torch.searchsorted(code, v, right=True) - 1).clamp(0, code.numel() - 2)
        half = torch.maximum((code[i + 1] - code[i]) / 2, torch.maximum(code[0] - v, v - code[-1]))
        if q.kind == "dynamic_unsigned":
            floor = code[_smallest_positive(code)]
            half = torch.where((v > 0) & (v < floor), floor - v, half)
        bound = per_elem * half
    else:
        absmax = get_format(q.kind).max / per_elem
        bound = spacing(flat * per_elem, q.kind) / 2 / per_elem
    return (bound + absmax * 2.0 ** -24).reshape(x.shape)


__all__ = ["KINDS", "PAPER_BLOCK_SIZE", "dynamic_map", "QTensor", "quantize_blockwise", "dequantize_blockwise",
           "error_bound", "payload_bytes", "block_lengths"]
