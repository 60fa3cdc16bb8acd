"""Fewer bits for what training stores and sends: block-wise quantization, 8-bit Adam, a quantized ring all-reduce
with error feedback, and weight-only post-training quantization.

    quantize_blockwise   a tensor, flattened, cut into blocks of `block_size` (the last one may be shorter: it is
                         quantized as a shorter block, nothing is padded on the wire); each block b is normalized by
                         its own absmax N_b, so one outlier spoils only its block. Codes: 'int8' / 'int4' (symmetric
                         round-to-nearest, Δ_b = N_b / 127 or / 7), 'dynamic' / 'dynamic_unsigned' (the nearest of
                         256 values of Dettmers' dynamic map), 'fp8_e4m3' / 'fp8_e5m2' (x·fp8_max/N_b cast to fp8).
                         Nearest rounding errs by at most half the gap of the grid around a value: ≤ N_b/254 for
                         int8, N_b/14 for int4 (docs/formulas.md §7.5), N_b·gap/2 for the dynamic map
                         (`error_bound` gives the bound element by element)
    Adam8bit             Dettmers, Lewis, Shleifer & Zettlemoyer, "8-bit Optimizers via Block-wise Quantization",
                         ICLR 2022 (arXiv 2110.02861) §2: Adam's m (signed map) and v (unsigned map) kept as one byte
                         per element plus one fp32 absmax per block of 2048: 8Ψ → 2Ψ + 8·Σ⌈n/2048⌉ bytes (§7.4)
    quantized_all_reduce the course's ring (course_lib.dist.collectives: chunks as torch.tensor_split, the same
                         send/receive order): every message is quantized before it is sent and dequantized into an
                         fp32 accumulator when it arrives; the all-gather forwards the owner's encoding unchanged, so
                         every rank ends with identical values. Bytes per rank: the fp32 ring's at one byte per
                         element — exactly ¼ — plus 4 bytes per block of every chunk sent. With error feedback
                         (Seide et al., Interspeech 2014; 1-bit Adam, Tang et al. ICML 2021; ZeRO++'s qgZ, Wang et al.
                         ICLR 2024) each rank adds to its next gradient what its own quantizations lost, so the sum
                         over steps of what the ring delivered equals the sum of the true gradients minus one residual
    QuantizedLinear      weight-only post-training quantization by round-to-nearest: int8 per output channel, int4
                         per group of `group_size` input weights (fp16 scales); dequantized on the fly in forward
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..dist.collectives import chunk_sizes, ring_all_reduce_bytes
from ..memory import alloc_category
from .precision import get_format, saturating_cast, spacing

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


# ============================================================================================ 8-bit Adam
class Adam8bit(torch.optim.Optimizer):
    """AdamW with 8-bit block-wise state (Dettmers et al. 2022): the update itself is AdamW's, in fp32; only what is
    KEPT between steps is 8-bit. Each step:

        m, v = dequantize(state)                  fp32 temporaries
        p ← p·(1 − lr·wd);  m ← β₁m + (1−β₁)g;  v ← β₂v + (1−β₂)g²
        p ← p − lr · (m / (1 − β₁ᵗ)) / (√v / √(1 − β₂ᵗ) + eps)
        state = quantize(m: signed dynamic map, v: unsigned dynamic map), blocks of `block_size` per tensor

    State per tensor of n elements: two uint8 code tensors (n bytes each) and two fp32 absmax tensors (⌈n/B⌉ each);
    the step count is a Python int. Blocks never straddle two tensors, but the arithmetic runs on all the tensors
    of a step at once (laid end to end, with per-tensor block lengths), so the per-step cost does not grow with the
    number of tensors. Every tensor is quantized, however small (bitsandbytes keeps tensors under
    `min_8bit_size` = 4096 elements in fp32 by default).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 block_size: int = PAPER_BLOCK_SIZE):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.block_size = block_size

    def _init_state(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        if not st:                                            # zeros, quantized: the code of 0, absmax 0
            nb = len(block_lengths(p.numel(), self.block_size))
            st["step"] = 0
            for name, kind in (("exp_avg", "dynamic"), ("exp_avg_sq", "dynamic_unsigned")):
                st[f"{name}_codes"] = torch.full((p.numel(),), int((_map(kind) == 0).nonzero()[0]), dtype=torch.uint8)
                st[f"{name}_absmax"] = torch.zeros(nb)
        return st

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                self._init_state(p)["step"] += 1
            for t in sorted({self.state[p]["step"] for p in params}):   # one batch per step count (normally one)
                self._update([p for p in params if self.state[p]["step"] == t], t, group)
        return None

    def _update(self, params: list, t: int, group: dict) -> None:
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        sts = [self.state[p] for p in params]
        lengths = torch.tensor([b for p in params for b in block_lengths(p.numel(), self.block_size)])
        m = _decode(torch.cat([st["exp_avg_codes"] for st in sts]), torch.cat([st["exp_avg_absmax"] for st in sts]),
                    lengths, "dynamic")                                        # (Ψ,) fp32
        v = _decode(torch.cat([st["exp_avg_sq_codes"] for st in sts]),
                    torch.cat([st["exp_avg_sq_absmax"] for st in sts]), lengths, "dynamic_unsigned")
        g = torch.cat([p.grad.reshape(-1).float() for p in params])
        p32 = torch.cat([p.detach().reshape(-1).float() for p in params])
        p32.mul_(1 - lr * wd)
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / math.sqrt(1 - beta2 ** t)).add_(eps)
        p32.addcdiv_(m, denom, value=-lr / (1 - beta1 ** t))
        numels = [p.numel() for p in params]
        blocks = [len(block_lengths(n, self.block_size)) for n in numels]
        for p, new in zip(params, p32.split(numels)):
            p.copy_(new.view_as(p))
        for name, kind, value in (("exp_avg", "dynamic", m), ("exp_avg_sq", "dynamic_unsigned", v)):
            codes, absmax = _encode(value, lengths, kind)                      # in place: the state keeps its storage
            for st, c, a in zip(sts, codes.split(numels), absmax.split(blocks)):
                st[f"{name}_codes"].copy_(c)
                st[f"{name}_absmax"].copy_(a)

    def dequantized_state(self, p: torch.Tensor) -> dict:
        """{'exp_avg': m, 'exp_avg_sq': v} of parameter p, in fp32."""
        st = self.state[p]
        return {name: dequantize_blockwise(QTensor(st[f"{name}_codes"], st[f"{name}_absmax"], p.shape, kind,
                                                   self.block_size))
                for name, kind in (("exp_avg", "dynamic"), ("exp_avg_sq", "dynamic_unsigned"))}


def adam8bit_state_bytes(numels, block_size: int = PAPER_BLOCK_SIZE) -> int:
    """2 bytes per element + 2 fp32 absmax per block of every tensor: 2Ψ + 8·Σ⌈n/B⌉ (vs fp32 Adam's 8Ψ)."""
    return sum(2 * n + 8 * -(-n // block_size) for n in numels)


# ============================================================================================ the quantized ring
COMM_KINDS = ("int8", "int4", "fp8_e4m3", "fp8_e5m2")
QGRAD_TAG = "qgrad"


def wire_bytes(n: int, kind: str, block_size: int) -> int:
    """Bytes of one quantized message of n elements: the codes plus one fp32 scale per block."""
    return payload_bytes(n, kind) + 4 * -(-n // block_size)


def quantized_ring_all_reduce_bytes(n: int, p: int, rank: int, kind: str = "int8",
                                    block_size: int = PAPER_BLOCK_SIZE, *, split: bool = False):
    """Bytes `rank` sends in `quantized_all_reduce` of n elements: reduce-scatter sends every chunk but its own,
    all-gather every chunk but the next rank's (as the fp32 ring, collectives.ring_all_reduce_bytes), each as its
    codes plus 4 bytes per block. split=True: (code bytes, scale bytes)."""
    sizes = chunk_sizes(n, p)
    sent = [] if p == 1 else [sizes[c] for c in range(p) if c != rank] + \
        [sizes[c] for c in range(p) if c != (rank + 1) % p]
    codes = sum(payload_bytes(m, kind) for m in sent)
    scales = sum(4 * -(-m // block_size) for m in sent)
    return (codes, scales) if split else codes + scales


def _wire(x: torch.Tensor, kind: str, block_size: int):
    """fp32 chunk → (uint8 message: fp32 scales then the codes, what the receiver will decode)."""
    q = quantize_blockwise(x, block_size, kind, allow_nonfinite=True)
    msg = torch.cat([q.scales.view(torch.uint8), q.codes.reshape(-1).view(torch.uint8)])   # scales first: aligned
    return msg, dequantize_blockwise(q)


def _unwire(msg: torch.Tensor, n: int, kind: str, block_size: int) -> torch.Tensor:
    k = 4 * -(-n // block_size)
    scales, codes = msg[:k].view(torch.float32), msg[k:]
    if kind == "int8":
        codes = codes.view(torch.int8)
    elif kind.startswith("fp8"):
        codes = codes.view(get_format(kind).dtype)
    return dequantize_blockwise(QTensor(codes, scales, torch.Size([n]), kind, block_size))


def relative_half_step(kind: str) -> float:
    """The most one quantization errs, as a fraction of its block's absmax: 1/254 (int8), 1/14 (int4), and for fp8
    half the spacing just below the block's absmax, 2^−(m+1) (every smaller value has a finer or equal spacing)."""
    if kind in ("int8", "int4"):
        return 1 / (2 * (127 if kind == "int8" else 7))
    return 2.0 ** -(get_format(kind).mantissa_bits + 1)


def quantized_all_reduce_error_bound(absmax_sum: float, world_size: int, kind: str, op: str = "avg") -> float:
    """A bound on |quantized − exact| for every element of `quantized_all_reduce`: an element passes through p − 1
    reduce-scatter messages and one all-gather encoding, p quantizations in all, each of a partial sum whose block
    absmax is at most Σ_r max|x_r| (`absmax_sum`); so |error| ≤ p · Σ_r max|x_r| · relative_half_step (÷ p for avg),
    plus fp32 rounding of the dequantized values and the sums (2^−23 of the same)."""
    bound = world_size * absmax_sum * (relative_half_step(kind) + 2.0 ** -23)
    return bound / world_size if op == "avg" else bound


def quantized_all_reduce(comm, tensor: torch.Tensor, op: str = "avg", *, kind: str = "int8",
                         block_size: int = PAPER_BLOCK_SIZE, residual: torch.Tensor | None = None,
                         tag: str = QGRAD_TAG) -> torch.Tensor:
    """Ring all-reduce of `tensor` (in place) with every message block-quantized.

    reduce-scatter, step s:  send Q(my partial sum of chunk (r−s−1) mod p) → right; from the left receive Q(chunk
                             (r−s−2) mod p) and add its dequantized value to mine, in fp32
    all-gather:              chunk r is complete here: encode it once, forward encodings around the ring unchanged;
                             every rank (the owner too) keeps the DEQUANTIZED values, so all ranks agree exactly
    error feedback:          `residual` (fp32, like tensor) is first added to my contribution; then it collects what
                             each of my quantizations lost (value − dequantized), to be added next time
    NaN/inf on any rank:     no rank raises (the others would wait forever): the block holding it travels as NaN,
                             so every rank ends with NaN there and a loss scaler's check skips the step on all of
                             them; the residuals are left as they were before this step
    """
    if kind not in COMM_KINDS:
        raise ValueError(f"unsupported wire format {kind!r}; use one of {COMM_KINDS}")
    if op not in ("sum", "avg"):
        raise ValueError(f"quantized_all_reduce reduces with 'sum' or 'avg', got {op!r}")
    if not tensor.is_contiguous() or not tensor.is_floating_point():
        raise ValueError("quantized_all_reduce works in place on a contiguous floating-point tensor")
    if residual is not None and (residual.shape != tensor.shape or residual.dtype != torch.float32):
        raise ValueError(f"residual must be fp32 of shape {tuple(tensor.shape)}, got {residual.dtype} "
                         f"{tuple(residual.shape)}")
    p, r = comm.world_size, comm.rank
    with alloc_category("comm"):
        acc = tensor.detach().reshape(-1).float().clone()              # (n,) fp32 accumulator
        kept = residual.clone() if residual is not None else None      # restored if this step overflows
    if residual is not None:
        acc.add_(residual.view(-1))
        residual.zero_()
    res = residual.view(-1) if residual is not None else None
    chunks = acc.tensor_split(p)
    sizes = [c.numel() for c in chunks]
    lost = (lambda c, x, d: res.tensor_split(p)[c].add_(x - d)) if res is not None else (lambda c, x, d: None)
    right, left = (r + 1) % p, (r - 1) % p
    try:
        for s in range(p - 1):                                         # reduce-scatter
            send_c, recv_c = (r - s - 1) % p, (r - s - 2) % p
            msg, sent = _wire(chunks[send_c], kind, block_size)
            lost(send_c, chunks[send_c], sent)
            incoming = torch.empty(wire_bytes(sizes[recv_c], kind, block_size), dtype=torch.uint8)
            comm.sendrecv(msg, right, incoming, left, tag=tag)
            chunks[recv_c].add_(_unwire(incoming, sizes[recv_c], kind, block_size))
        msgs = {}
        msgs[r], mine = _wire(chunks[r], kind, block_size)              # the owner's encoding of the reduced chunk
        lost(r, chunks[r], mine)
        chunks[r].copy_(mine)
        for s in range(p - 1):                                         # all-gather
            send_c, recv_c = (r - s) % p, (r - s - 1) % p
            msgs[recv_c] = torch.empty(wire_bytes(sizes[recv_c], kind, block_size), dtype=torch.uint8)
            comm.sendrecv(msgs[send_c], right, msgs[recv_c], left, tag=tag)
            chunks[recv_c].copy_(_unwire(msgs[recv_c], sizes[recv_c], kind, block_size))
    finally:
        comm.release()
    if residual is not None and not bool(torch.isfinite(acc).all()):
        residual.copy_(kept)                # an overflowed step is skipped: it must not poison later ones
    if op == "avg":
        acc.div_(p)
    tensor.view(-1).copy_(acc)
    return tensor


def quantized_data_parallel(module: nn.Module, comm, *, kind: str = "int8", block_size: int = PAPER_BLOCK_SIZE,
                            error_feedback: bool = False, **bucket_options):
    """Bucketed data parallelism (course_lib.parallel.dp.DataParallelBucket) whose buckets are reduced by
    `quantized_all_reduce`; with error feedback each bucket keeps an fp32 residual (4 bytes per parameter)."""
    from ..parallel.dp import DataParallelBucket

    class QuantizedDataParallel(DataParallelBucket):
        def __init__(self):
            super().__init__(module, comm, **bucket_options)
            self.kind, self.block_size = kind, block_size
            with alloc_category("comm"):
                self.residuals = [torch.zeros(b.numel) for b in self.buckets] if error_feedback else None

        def _reduce_bucket(self, bucket):
            quantized_all_reduce(self.comm, bucket.buffer, "avg", kind=self.kind, block_size=self.block_size,
                                 residual=None if self.residuals is None else self.residuals[bucket.index])

        def expected_bytes_sent(self, rank=None) -> int:
            rank = self.comm.rank if rank is None else rank
            return sum(quantized_ring_all_reduce_bytes(n, self.world_size, rank, self.kind, self.block_size)
                       for n in self.bucket_numels())

        def fp32_bytes_sent(self, rank=None) -> int:
            """What the fp32 ring would send for the same buckets (collectives.ring_all_reduce_bytes)."""
            rank = self.comm.rank if rank is None else rank
            return sum(ring_all_reduce_bytes(n, self.world_size, rank, 4) for n in self.bucket_numels())

    if kind not in COMM_KINDS:
        raise ValueError(f"unsupported wire format {kind!r}; use one of {COMM_KINDS}")
    return QuantizedDataParallel()


# ============================================================================================ weight-only PTQ
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


__all__ = ["KINDS", "PAPER_BLOCK_SIZE", "dynamic_map", "QTensor", "quantize_blockwise", "dequantize_blockwise",
           "error_bound", "payload_bytes", "block_lengths", "Adam8bit", "adam8bit_state_bytes", "COMM_KINDS", "QGRAD_TAG",
           "wire_bytes", "quantized_ring_all_reduce_bytes", "relative_half_step", "quantized_all_reduce_error_bound",
           "quantized_all_reduce", "quantized_data_parallel",
           "QuantizedLinear", "quantize_weights", "model_bytes", "ptq_bytes"]
