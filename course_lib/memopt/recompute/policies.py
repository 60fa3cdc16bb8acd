"""Recomputation policies: per op, is what it makes recomputed in backward (True) or kept (False)?

A policy is `policy(func, *args, **kwargs) -> bool`, asked once per op of a checkpointed segment in forward
(`course_lib.memopt.recompute.hooks.Segment`) — the question
`torch.utils.checkpoint.create_selective_checkpoint_contexts` asks (`torch_policy(policy)` turns one into the other).

    recompute_all      full recomputation (Chen et al. 2016): keep only the segment's inputs
    attention_core     Korthikanti et al., MLSys 2023 (arXiv 2205.05198) §5: recompute only the ops that make or
                       read the (B, n_head, T, T) score maps; a block keeps 34·sbh of its sbh(34 + 5as/h)
    all_but_matmuls    keep what matrix multiplies make, recompute the rest: no extra FLOPs (the example of
                       PyTorch's selective-checkpointing docs)
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def recompute_all(func, *args, **kwargs) -> bool:
    """Full recomputation: everything the segment makes is recomputed; only its inputs are kept."""
    return True


def _square_4d(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[-1] == t.shape[-2]


def attention_core(func, *args, **kwargs) -> bool:
    """Korthikanti et al.'s selective recomputation: recompute only the attention core — the ops that make or read the
    (B, n_head, T, T) score maps: QKᵀ and A·V (a block's only batched matmuls), the scaling, the causal mask, softmax
    and attention dropout. Everything else a block saves (34·sbh of its sbh(34 + 5as/h)) is kept."""
    if func in (aten.bmm.default, aten._softmax.default, aten.masked_fill.Scalar, aten.bitwise_not.default):
        return True
    return func is not aten.clone.default and any(_square_4d(a) for a in args)


MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


def all_but_matmuls(func, *args, **kwargs) -> bool:
    """Recompute every op that does no matrix multiply (LayerNorm, GELU, softmax, copies, adds); keep what matmuls
    make — a policy that adds no FLOPs (the one PyTorch's selective-checkpointing docs use as their example)."""
    return func not in MATMULS


def torch_policy(policy):
    """The same policy for `torch.utils.checkpoint.create_selective_checkpoint_contexts`."""
    from torch.utils.checkpoint import CheckpointPolicy

    def policy_fn(ctx, func, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE if policy(func, *args, **kwargs) else CheckpointPolicy.MUST_SAVE
    return policy_fn


__all__ = ["recompute_all", "attention_core", "all_but_matmuls", "MATMULS", "torch_policy"]
