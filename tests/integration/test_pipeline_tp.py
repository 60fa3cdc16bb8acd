"""Pipeline × tensor × data parallelism with ZeRO on real gloo ranks (issue 21): the public `apply_*` functions in
either order — TP then the pipeline split, or the split then TP on the stage — with or without sequence
parallelism, GPipe / 1F1B / interleaved / ZB-H1, DDP and ZeRO-1/2 over dp, train 2 AdamW steps equal to the
single-process reference (float64: loss and every parameter within 1e-12), and each axis's ledger bytes per step
equal its formula:

    pp   `pipeline.boundary_bytes`             (under SP each tp rank sends its slice: T/t)
    tp   `tensor.tp_bytes_per_step`            over this stage's blocks, embedding / head + loss only where held
    dp   `expected_bytes_sent()` of the reducer: DDP's buckets, or ZeRO's reduce-scatter + all-gather ONCE per step

Meshes (pp, dp, tp): (2, 2, 2) and (4, 1, 2) on 8 ranks; (3, 2, 1), (3, 1, 2) and (1, 3, 2) on 6 (axes of size
3; an uneven split 2 + 1 + 1; the last is TP + ZeRO-2 under gradient accumulation, no pipeline, which must reduce
once per step too). One combination also wraps the stage in a forward wrapper after the split: every
micro-batch's forward must run through it. Exact by construction: every parallel form regroups the same float64
sums, so the differences are a few ulps; 1e-12 leaves room for 1e4.
"""
from __future__ import annotations

import functools

import pytest
import torch.nn as nn

from course_lib import optim
from course_lib.core.handles import handle_of
from course_lib.core.model import GPT, get_config
from course_lib.distributed.launch import launch
from course_lib.distributed.mesh import Mesh
from course_lib.parallel.dp import apply_dp
from course_lib.parallel.pipeline import PipelineStage, apply_pipeline, boundary_bytes, split_layers
from course_lib.parallel.tensor import apply_tp, tp_bytes_per_step
from course_lib.parallel.zero import apply_zero
from course_lib.train import LedgerProbe, TrainConfig, closing, forward_backward, optimizer_kwargs, run, train_reference

pytestmark = pytest.mark.integration

CFG = get_config("nano", n_layer=4, n_head=4, seq_len=8)       # tp = 2 divides heads and T; 4 blocks: pp ≤ 4
B, E, TOL, STEPS = 1, 8, 1e-12, 2                               # sequences per micro-batch, float64

# (pp, dp, tp) → [(schedule, chunks, M, sequence_parallel, zero stage, order, wrapped)]
COMBOS = {
    8: {(2, 2, 2): [("1f1b", 1, 3, False, 0, "tp_pp", False),
                    ("zb_h1", 1, 3, True, 2, "pp_tp", False),
                    ("interleaved", 2, 2, True, 1, "tp_pp", False),
                    ("gpipe", 1, 2, False, 2, "pp_tp", True)],
        (4, 1, 2): [("zb_h1", 1, 4, True, 0, "tp_pp", False),
                    ("1f1b", 1, 5, False, 0, "pp_tp", False)]},
    6: {(3, 2, 1): [("zb_h1", 1, 3, False, 2, "pp_tp", False)],
        (3, 1, 2): [("1f1b", 1, 4, True, 0, "tp_pp", False)],
        (1, 3, 2): [(None, 1, 3, True, 2, "tp", False)]},        # no pipeline: K = 3 accumulation micro-steps
}


class _Counting(nn.Module):
    """A forward wrapper applied after the split (as precision or offload would be): counts its forwards."""

    def __init__(self, module):
        super().__init__()
        self.module, self.calls = module, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.module(*args, **kwargs)


def _tc(dp: int, M: int) -> TrainConfig:
    return TrainConfig(steps=STEPS, batch_size=dp * M * B)


@functools.cache
def _reference(global_batch: int):
    ref = train_reference(CFG, _tc(1, global_batch), model=GPT(CFG).double(), progress=False)
    return ref.losses, {k: p.detach().clone() for k, p in ref.model.named_parameters()}


def _build(mesh, tc, schedule, chunks, M, sp, zero, order):
    """This rank's model the way a composer builds it: TP and the pipeline split (either order), then ZeRO/DDP.
    Returns (the TP model or stage, the model train.run gets, optimizer, step_fn, the dp reducer, the layout)."""
    model = GPT(CFG, seed=tc.seed).double()
    tp = mesh.size("tp") > 1
    if order in ("tp_pp", "tp") and tp:
        model = apply_tp(model, mesh, sequence_parallel=sp)
    pipe = None
    if schedule is not None:
        model = apply_pipeline(model, mesh, num_microbatches=M, schedule=schedule, chunks=chunks)
        pipe = handle_of(model, "pipeline")
        if order == "pp_tp" and tp:
            assert apply_tp(model, mesh, sequence_parallel=sp) is model      # in place: the same kind of model
    if zero == 0:
        wrapped = reducer = apply_dp(model, mesh)
        optimizer = optim.build(model, **optimizer_kwargs(tc))
    else:
        wrapped = apply_zero(model, mesh, zero)
        optimizer = optim.build(wrapped, **optimizer_kwargs(tc))
        reducer = optimizer                             # ZeRO-1/2 reduce in the optimizer, once per step
    if pipe is None:
        return model, wrapped, optimizer, functools.partial(forward_backward, sync=reducer), reducer, None
    pipe.data_parallel = reducer
    return model, wrapped, optimizer, pipe, reducer, pipe.plan


def _composed(ctx, combos, references):
    out = []
    for (pp, dp, tp), runs in combos.items():
        mesh = Mesh(ctx.comm, pp=pp, dp=dp, tp=tp)
        for schedule, chunks, M, sp, zero, order, wrapped_fwd in runs:
            tc = _tc(dp, M)
            inner, model, optimizer, step_fn, reducer, layout = _build(mesh, tc, schedule, chunks, M, sp, zero, order)
            if wrapped_fwd:
                model = _Counting(model)
            ctx.comm.ledger.reset()
            r = run(model, optimizer, mesh.batches(CFG.seq_len, B, accum_steps=M, seed=tc.data_seed), steps=STEPS,
                    step_fn=step_fn, probes=[LedgerProbe(ctx.comm, spans=False, groups=("pp", "dp", "tp"))],
                    keep_params=True)
            tp_model = getattr(inner, "model", inner)          # a stage runs its model's pieces
            shard = getattr(tp_model, "local_shard", lambda name, full: full)
            ref = references[dp * M * B][1]
            out.append({"combo": (pp, dp, tp, schedule, chunks, M, sp, zero, order), "coords": mesh.coords,
                        "last": layout is None or step_fn.last in inner.stages, "losses": r.losses,
                        "d_param": max((p - shard(k, ref[k])).abs().max().item() for k, p in r.params.items()),
                        "names": sorted(r.params), "bytes": r["ledger"]["group_bytes"],
                        "dp_want": reducer.expected_bytes_sent(),
                        "dp_numel": getattr(reducer, "padded_numel", None) or reducer.psi,
                        "forwards": (model.calls, sum(op.kind == "F" for op in step_fn.ops) * STEPS)
                        if wrapped_fwd else None, "layout": layout})
            closing(model).__exit__(None, None, None)
    return out


@functools.cache
def _runs(world_size: int):
    combos = COMBOS[world_size]
    batches = {dp * M * B for (_, dp, _), runs in combos.items() for _, _, M, *_ in runs}
    return launch(_composed, world_size, combos, {n: _reference(n) for n in batches}, timeout=300)


def _by_combo(world_size):
    out = {}
    for r in _runs(world_size):
        for c in r:
            out.setdefault(c["combo"], []).append(c)
    return out


@pytest.mark.parametrize("world_size", sorted(COMBOS))
def test_tp_pp_dp_zero_train_two_steps_equal_to_the_single_process_reference(world_size):
    for combo, ranks in _by_combo(world_size).items():
        pp, dp, tp, *_ = combo
        M = combo[5]
        ref_losses, ref_params = _reference(dp * M * B)
        assert max(c["d_param"] for c in ranks) < TOL, combo
        for tp_rank in range(tp):             # the loss lives on the last stage; the dp ranks' mean is the global
            last = [c["losses"] for c in ranks if c["last"] and c["coords"]["tp"] == tp_rank]
            assert len(last) == dp, combo
            mean = [sum(step) / dp for step in zip(*last)]
            assert max(abs(a - b) for a, b in zip(mean, ref_losses)) < TOL, (combo, mean, ref_losses)
        for dp_rank in range(dp):             # every parameter lives on exactly one stage of each (dp, tp) column
            for tp_rank in range(tp):
                names = [n for c in ranks if c["coords"]["dp"] == dp_rank and c["coords"]["tp"] == tp_rank
                         for n in c["names"]]
                assert sorted(names) == sorted(ref_params), combo


@pytest.mark.parametrize("world_size", sorted(COMBOS))
def test_per_axis_ledger_bytes_of_every_step_equal_the_formulas(world_size):
    for combo, ranks in _by_combo(world_size).items():
        pp, dp, tp, schedule, chunks, M, sp, zero, order = combo
        for c in ranks:
            layout, (p, t) = c["layout"], (c["coords"]["pp"], c["coords"]["tp"])
            parts = layout.parts(p) if layout is not None else {}             # no pipeline: the whole model
            want = {"pp": boundary_bytes(layout, B, CFG.seq_len, CFG.d_model, E, tp_size=tp, sequence_parallel=sp)[p]
                    if layout is not None else 0,
                    "tp": tp_bytes_per_step(CFG, B, tp, t, E, num_microbatches=M, sequence_parallel=sp, **parts)
                    if tp > 1 else 0,
                    "dp": c["dp_want"]}
            assert c["bytes"] == [want] * STEPS, (combo, c["coords"], c["bytes"], want)
            assert (want["dp"] > 0) == (dp > 1)


def test_over_two_dp_ranks_the_reducer_sends_its_parameters_bytes_once_per_step():
    """N = 2: a ring all-reduce (DDP) or reduce-scatter + all-gather (ZeRO-1/2) of n elements sends
    2(N−1)/N·n·e = n·e, so the dp bytes per step are this rank's parameters (ZeRO: padded) × 8 — ZeRO-2 in a
    pipeline included, which reduce-scattered after every micro-batch before: M times the reduce-scatter bytes."""
    for world_size in sorted(COMBOS):
        for combo, ranks in _by_combo(world_size).items():
            if combo[1] == 2:
                assert all(c["bytes"][s]["dp"] == c["dp_numel"] * E for c in ranks for s in range(STEPS)), combo


def test_every_forward_runs_through_the_wrapper_around_the_stage():
    for c in _by_combo(8)[(2, 2, 2, "gpipe", 1, 2, False, 2, "pp_tp")]:
        calls, forwards = c["forwards"]
        assert calls == forwards > 0


# ---------------------------------------------------------------------------------------------- bad input
def test_apply_tp_apply_pipeline_and_apply_zero_refuse_what_they_cannot_handle_with_the_fix():
    class Wrapper(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module
    with pytest.raises(TypeError, match="apply tensor parallelism before data parallelism"):
        apply_tp(Wrapper(GPT(CFG)), None)
    with pytest.raises(TypeError, match="Split the model before data parallelism"):
        apply_pipeline(Wrapper(GPT(CFG)), None, num_microbatches=2)
    stage = PipelineStage(GPT(CFG), [0], split_layers(CFG.n_layer, 2), 2)
    with pytest.raises(TypeError, match="already a pipeline stage"):
        apply_pipeline(stage, None, num_microbatches=2)
    with pytest.raises(ValueError, match="use zero stage 1 or 2 with pipelines"):
        apply_zero(stage, None, 3)
