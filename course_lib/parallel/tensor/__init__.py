"""Tensor parallelism from scratch (notebook 06): the weights of each layer split over the ranks of the mesh's tp
axis, and the activations moved between them by collectives written on send/recv.

    megatron   Megatron 1D (Shoeybi et al. 2019): f and g, ColumnParallelLinear, RowParallelLinear, the
               vocab-parallel embedding and cross-entropy; SP's g / ḡ; per-layer byte counts
    sequence   sequence parallelism (Korthikanti et al., MLSys 2023): LayerNorm on a slice of the sequence, the
               region input kept as a slice and gathered again in backward, activation bytes per layer
    gpt        apply_tp(model, mesh): the course GPT (or a pipeline stage of it) from a table of (module, style);
               the bytes per micro-batch and per step; PyTorch's parallelize_module plan for the same model
    grid       2D (SUMMA/Optimus), 2.5D (Tesseract) and 3D matrix multiplication on rank grids, a linear layer on
               each, and their exact bytes and memory per rank
    workers    what notebook 06's launches run on each rank (imported from there, not re-exported here)
    plots      notebook 06's pictures: the slice of each weight a rank holds, the blocks of X, W, Y on the grids
"""
from .gpt import (
                  STYLES,
                  TensorParallelGPT,
                  apply_tp,
                  check_tp,
                  layer_traffic,
                  torch_parallelize_blocks,
                  torch_tp_plan,
                  tp_bytes_per_microbatch,
                  tp_bytes_per_step,
                  tp_plan,
)
from .grid import (
                  COLOSSAL_BANDWIDTH,
                  KINDS,
                  Grid,
                  GridLinear,
                  colossal_bandwidth,
                  grid_bytes,
                  grid_memory,
                  grid_of,
                  grid_shape,
                  make_grid,
                  summa,
                  summa_abt,
                  summa_atb,
)
from .megatron import (
                  Call,
                  CollectiveLog,
                  ColumnParallelLinear,
                  RowParallelLinear,
                  VocabParallelEmbedding,
                  f,
                  g,
                  g_sp,
                  gbar_sp,
                  layer_bytes,
                  padded_vocab,
                  sp_layer_bytes,
                  vocab_parallel_cross_entropy,
)
from .sequence import (
                  LayerActivationProbe,
                  SequenceParallelLayerNorm,
                  SequenceParallelRegion,
                  layer_activation_bytes,
                  paper_activation_bytes,
                  saving_slice_only,
                  tp_activation_bytes,
)

__all__ = ["apply_tp", "tp_plan", "check_tp", "TensorParallelGPT", "STYLES", "layer_traffic",
           "tp_bytes_per_microbatch", "tp_bytes_per_step", "torch_tp_plan",
           "torch_parallelize_blocks", "f", "g", "g_sp", "gbar_sp", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "vocab_parallel_cross_entropy", "padded_vocab", "CollectiveLog", "Call",
           "layer_bytes", "sp_layer_bytes", "SequenceParallelLayerNorm", "SequenceParallelRegion",
           "saving_slice_only", "layer_activation_bytes", "tp_activation_bytes", "paper_activation_bytes",
           "LayerActivationProbe", "Grid", "make_grid", "grid_of", "grid_shape", "GridLinear", "summa", "summa_abt",
           "summa_atb", "grid_bytes", "grid_memory", "colossal_bandwidth", "COLOSSAL_BANDWIDTH", "KINDS"]
