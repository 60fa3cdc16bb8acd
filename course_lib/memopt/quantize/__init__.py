"""Fewer bits for what training stores and sends (notebook 09).

    blockwise   block-wise quantization (int8, int4, Dettmers' dynamic map, fp8) and its element-wise error bound:
                ≤ N_b/254 for int8, N_b/14 for int4 (docs/formulas.md §7.5)
    allreduce   a quantized ring all-reduce with error feedback, and data parallelism over it: ¼ of the fp32
                ring's bytes plus 4 per block, every rank bit-identical
    weights     weight-only post-training quantization (int8 per channel, int4 per group, fp16 scales)

    adam8bit    8-bit Adam (Dettmers et al., ICLR 2022): AdamW's m and v kept as block-wise quantized bytes,
                8Ψ → 2Ψ + 8·Σ⌈n/B⌉ (docs/formulas.md §7.4); it steps with the course's one `optim.adamw_`
"""
from __future__ import annotations

from .adam8bit import Adam8bit, adam8bit_state_bytes
from .allreduce import (
                        COMM_KINDS,
                        QGRAD_TAG,
                        quantized_all_reduce,
                        quantized_all_reduce_error_bound,
                        quantized_data_parallel,
                        quantized_ring_all_reduce_bytes,
                        relative_half_step,
                        wire_bytes,
)
from .blockwise import (  # noqa: F401
                        KINDS,
                        PAPER_BLOCK_SIZE,
                        QTensor,
                        _pack_int4,
                        _unpack_int4,
                        block_lengths,
                        dequantize_blockwise,
                        dynamic_map,
                        error_bound,
                        payload_bytes,
                        quantize_blockwise,
)
from .weights import QuantizedLinear, model_bytes, ptq_bytes, quantize_weights

__all__ = ["KINDS", "PAPER_BLOCK_SIZE", "dynamic_map", "QTensor", "quantize_blockwise", "dequantize_blockwise",
           "error_bound", "payload_bytes", "block_lengths", "Adam8bit", "adam8bit_state_bytes", "COMM_KINDS",
           "QGRAD_TAG", "wire_bytes", "quantized_ring_all_reduce_bytes", "relative_half_step",
           "quantized_all_reduce_error_bound", "quantized_all_reduce", "quantized_data_parallel",
           "QuantizedLinear", "quantize_weights", "model_bytes", "ptq_bytes"]
