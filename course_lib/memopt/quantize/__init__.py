"""Fewer bits for what training stores and sends (notebook 09).

    blockwise   block-wise quantization (int8, int4, Dettmers' dynamic map, fp8) and its element-wise error bound:
                ≤ N_b/254 for int8, N_b/14 for int4 (docs/formulas.md §7.5)
    allreduce   a quantized ring all-reduce with error feedback, and data parallelism over it: ¼ of the fp32
                ring's bytes plus 4 per block, every rank bit-identical
    weights     weight-only post-training quantization (int8 per channel, int4 per group, fp16 scales)

8-bit Adam (Dettmers et al., ICLR 2022: m and v as block-wise quantized bytes, 8Ψ → 2Ψ + 8·Σ⌈n/B⌉) is an optimizer,
so it lives with the others in course_lib.optim (`Adam8bit`, `adam8bit_state_bytes`); re-exported here.
"""
from __future__ import annotations

from .allreduce import (COMM_KINDS, QGRAD_TAG, quantized_all_reduce, quantized_all_reduce_error_bound,
                        quantized_data_parallel, quantized_ring_all_reduce_bytes, relative_half_step, wire_bytes)
from .blockwise import (KINDS, PAPER_BLOCK_SIZE, QTensor, _pack_int4, _unpack_int4, block_lengths,  # noqa: F401
                        dequantize_blockwise, dynamic_map, error_bound, payload_bytes, quantize_blockwise)
from .weights import QuantizedLinear, model_bytes, ptq_bytes, quantize_weights

_FROM_OPTIM = ("Adam8bit", "adam8bit_state_bytes")


def __getattr__(name):
    # course_lib.optim's 8-bit Adam imports this package's block-wise codes: re-exported on first use, so that
    # importing either package first works.
    if name in _FROM_OPTIM:
        from ...optim import eightbit
        return getattr(eightbit, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["KINDS", "PAPER_BLOCK_SIZE", "dynamic_map", "QTensor", "quantize_blockwise", "dequantize_blockwise",
           "error_bound", "payload_bytes", "block_lengths", "Adam8bit", "adam8bit_state_bytes", "COMM_KINDS", "QGRAD_TAG",
           "wire_bytes", "quantized_ring_all_reduce_bytes", "relative_half_step", "quantized_all_reduce_error_bound",
           "quantized_all_reduce", "quantized_data_parallel",
           "QuantizedLinear", "quantize_weights", "model_bytes", "ptq_bytes"]
