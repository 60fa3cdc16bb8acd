"""Bytes one rank sends per optimizer step on each mesh axis, summed from each technique's own formula — the one
sum `parallelize` checks a composed run against and the capstone's calculator predicts a toy run with.

    pp     `pipeline.boundary_bytes` of the rank's stages (activations forward, gradients backward)
    tp     `tensor.tp_bytes_per_step` of the blocks, embedding and head the rank holds (`PipelineLayout.parts`),
           + M × `recompute.tensor_parallel.rerun_tp_bytes` when recomputation replays tensor-parallel blocks
    cp     the rank's blocks × M × `context.ring_bytes_per_layer` (ring attention's K/V rotation, forward and
           backward) at width d/tp (the heads this tp rank holds), + M × the ring's forward again in every
           block recomputation replays (full or selective: the attention core reruns); a pipeline boundary then
           carries T/cp tokens, and tp's collectives act on T/cp tokens
    dp     the reducer's own `expected_bytes_sent()` (DDP's buckets, ZeRO-1/2's padded buckets, FSDP's groups:
           once per step, or once per micro-batch where it `reduces_per_microbatch`), under the ledger name of
           the dp × cp group ('dp', or 'dp×cp' when context parallelism shares the reduction); with experts
           `expert.gradient_bytes`: replicated parameters over dp, expert parameters over edp
    ep     not here: the all-to-all's bytes follow the routing, so `Parallelized.expected_bytes_per_step` adds
           `expert.ep_bytes_per_step` from the counts each step's routers produced

Nothing here builds or runs a model: the caller hands over the layout facts — the pipeline layout, the
recomputation plan of the blocks on the rank, the reducer — as built by the techniques themselves.
"""
from __future__ import annotations


def bytes_per_step(cfg, plan, coords: dict, *, micro_batch_size: int, elem: int, pipeline=None,
                   recompute_plan=None, reducer=None, dp_group: str = "dp", loss_elem: int | None = None) -> dict:
    """{axis: bytes} this rank sends per step. `plan` reads like `ParallelPlan` (pp, tp, cp, microbatches,
    sequence_parallel, recompute); `coords` are the rank's mesh coordinates ({'pp': …, 'tp': …}); `pipeline` the
    `PipelineLayout` (pp > 1), `recompute_plan` the `RecomputePlan` of this rank's blocks (recompute set),
    `reducer` whatever reduces the gradients over dp × cp (or None); `loss_elem` the element size of the logits the
    vocab-parallel loss reduces (None: `elem`; 4 under mixed precision, which upcasts the logits)."""
    from ..memopt.recompute.tensor_parallel import rerun_tp_bytes
    from ..parallel.context import ring_bytes_per_layer
    from ..parallel.pipeline.executor import boundary_bytes
    from ..parallel.tensor import tp_bytes_per_step
    M, T, d, b, e = plan.microbatches, cfg.seq_len, cfg.d_model, micro_batch_size, elem
    out = {}
    if plan.pp > 1:
        out["pp"] = boundary_bytes(pipeline, b, T // plan.cp, d, e, tp_size=plan.tp,     # T/cp: CP's tokens
                                   sequence_parallel=plan.sequence_parallel)[coords["pp"]]
    if plan.tp > 1:
        parts = pipeline.parts(coords["pp"]) if pipeline is not None else {}
        out["tp"] = tp_bytes_per_step(cfg, b, plan.tp, coords["tp"], e, num_microbatches=M,    # on T/cp tokens
                                      sequence_parallel=plan.sequence_parallel, loss_elem=loss_elem,
                                      seq_len=T // plan.cp, experts_held=(cfg.n_expert // plan.ep) or None,
                                      **parts)
        if plan.recompute is not None:          # the replay re-issues the forward collectives it reruns
            out["tp"] += M * rerun_tp_bytes(recompute_plan, cfg, b, plan.tp, coords["tp"], e,
                                            sequence_parallel=plan.sequence_parallel, seq_len=T // plan.cp)
    if plan.cp > 1:
        layers = pipeline.parts(coords["pp"])["layers"] if pipeline is not None else cfg.n_layer   # blocks here
        # the ring moves the K/V of the heads this tp rank holds: d/tp wide
        ring = ring_bytes_per_layer(b, T, d // plan.tp, plan.cp, e)
        out["cp"] = layers * M * sum(ring.values())
        if plan.recompute is not None:          # the replay reruns the ring's forward in every block it recomputes
            replayed = sum(u.end - u.start for u in recompute_plan.units if u.kind != "store")
            out["cp"] += M * replayed * ring["forward"]
    if reducer is not None and hasattr(reducer, "expected_bytes_by_group"):      # experts: dp and edp
        out.update(reducer.expected_bytes_by_group(e))
    elif reducer is not None and hasattr(reducer, "expected_bytes_sent"):
        per = M if getattr(reducer, "reduces_per_microbatch", False) else 1      # FSDP: every micro-batch
        out[dp_group] = per * reducer.expected_bytes_sent()
    return out


__all__ = ["bytes_per_step"]
