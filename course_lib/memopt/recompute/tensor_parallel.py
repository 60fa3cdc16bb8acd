"""Recomputation of tensor-parallel blocks: the rerun re-issues the forward's collectives, so it sends bytes again
(`rerun_tp_bytes`, added to `tp_bytes_per_microbatch` in `composer.expected`; Korthikanti et al., MLSys 2023).
"""
from __future__ import annotations

from ...core.model import get_config
from ...distributed.collectives import ring_all_gather_bytes, ring_all_reduce_bytes, ring_reduce_scatter_bytes
from . import RecomputePlan


def rerun_tp_bytes(plan: RecomputePlan, cfg, micro_batch_size: int, tp_size: int, rank: int, elem: int, *,
                   sequence_parallel: bool = False, seq_len: int | None = None) -> int:
    """Bytes tp rank `rank` sends again per micro-batch when `plan` recomputes tensor-parallel blocks (`apply_tp`,
    then `apply_recompute`): the rerun re-issues every forward collective before the last op a saved tensor needs,
    and no block's output is needed (the next unit keeps it), so each segment skips its last collective.

        1D   a block's forward sends g (all-reduce of b·s·h) after attention and after the MLP
             full segment of n blocks: 2n − 1 all-reduces      selective: 0 (the core precedes any collective)
        SP   g_sp (all-gather), ḡ (reduce-scatter) after attention, the same around the MLP
             full segment: 2n all-gathers + 2n − 1 reduce-scatters      selective: 1 all-gather (attention's g_sp)
        MoE  (1D; experts whole on every tp rank) only attention's g, which the block's MoE reads:
             full segment: n all-reduces

    `tp_bytes_per_microbatch` + this = what the ledger shows on the tp axis (tests/integration/test_recompute_tp.py).
    """
    n = micro_batch_size * (seq_len or get_config(cfg).seq_len) * get_config(cfg).d_model
    ar, ag, rs = (f(n, tp_size, rank, elem) for f in (ring_all_reduce_bytes, ring_all_gather_bytes,
                                                      ring_reduce_scatter_bytes))
    total = 0
    for u in plan.units:
        blocks = u.end - u.start
        if u.kind == "full" and get_config(cfg).n_expert:     # MoE blocks: only attention's g, each one needed
            total += blocks * ar
        elif u.kind == "full":
            total += (2 * blocks * ag + (2 * blocks - 1) * rs) if sequence_parallel else (2 * blocks - 1) * ar
        elif u.kind == "selective" and sequence_parallel:
            total += ag
    return total
