"""The pipeline executor: one rank of the `pp` axis runs its list of ops from any schedule, sending activations
forward and their gradients backward through the traffic ledger, so every byte between stages is counted.

    stage = apply_pipeline(GPT(cfg), mesh, schedule="1f1b", num_microbatches=M)
    train.run(stage, optim.build(stage, lr=…), mesh.batches(T, b, num_microbatches=M),
              steps=…, step_fn=handle_of(stage, "pipeline"))   # THE training loop; the optimizer steps this stage

(`parallelize(model, mesh, ParallelPlan(pp=S, num_microbatches=M, …))` is that setup, with whatever else composes.)

Every forward goes through the model `train.run` hands the step function — the outermost wrapper around the stage
(data parallelism, precision, offload …), called as `model(x, targets, stage=k)` — so whatever wraps the stage runs
in every micro-batch's forward. Gradients are reduced over dp once per step: the schedule runs under the reducer's
`no_sync()` and ends with one `finish_gradient_synchronization()` — the DDP wrapper `model` is, or the ZeRO-1/2
`ShardedOptimizer` given as `pipeline.data_parallel`.

On rank r, for each op of `schedule.ops[r]` in order:

    F(k, mb)   input: token ids (stage 0) or a receive from stage k−1; run stage k; the last stage computes the
               loss of micro-batch mb (scaled by 1/M, so the M gradients add up to the mean's), the others send
               their output to stage k+1 (isend: a rank never waits for a send, only for what it receives)
    B(k, mb)   receive ∂L/∂output from stage k+1 (the last stage starts from its loss), backward, send ∂L/∂input to
               stage k−1; in a B/W-split schedule the linear layers' weight gradients are deferred …
    W(k, mb)   … to here (`stage.run_weight_grads`)

Receives are posted in the order the *sender* sends (computed from the sender's op list), so two messages between
the same pair of ranks can never be swapped, whatever order the receiver needs them in; all sends are waited for at
the end of the step. With these rules a schedule runs exactly when `schedules.validate` accepts it.

Checked against (docs/formulas.md §3.5): per step, each boundary between consecutive stages carries
2·M·b·T·d·e bytes (activations forward, gradients backward), v times as many boundaries with v chunks per rank —
read from the ledger per rank, under the 'pp' axis; under sequence parallelism each tp rank sends only its slice
of the sequence, T/t. Gradients equal the single-process model's on the same micro-batches (float64: the pipeline
only regroups the same additions).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from ...core.handles import attach, inherit
from ...core.model import GPTConfig, get_config
from ...distributed.mesh import axis_comm
from ...memory import now
from .schedules import Op, Schedule, make_schedule
from .stage import PipelineStage, check_splittable, defer_weight_grads, run_weight_grads, split_layers

ACTIVATION_TAG = "pp_activation"     # ledger tags of what crosses a stage boundary
GRADIENT_TAG = "pp_gradient"


# ============================================================================================ the layout (no ranks)
@dataclass(frozen=True)
class PipelineLayout:
    """What every rank agrees on before it starts: the schedule and the blocks of each (virtual) stage."""
    schedule: Schedule
    bounds: tuple                      # [start, end) blocks of each virtual stage

    @property
    def num_stages(self) -> int:
        return self.schedule.num_stages

    @property
    def num_microbatches(self) -> int:
        return self.schedule.num_microbatches

    def parts(self, pp_rank: int) -> dict:
        """What pp rank `pp_rank` holds: its number of blocks, and whether the embedding (stage 0) and the head and
        loss (the last virtual stage) are on it — the keywords `tensor.tp_bytes_per_microbatch` takes."""
        stages = self.schedule.stages_of(pp_rank)
        return {"layers": sum(self.bounds[k][1] - self.bounds[k][0] for k in stages), "embed": 0 in stages,
                "head": self.schedule.num_virtual_stages - 1 in stages}




def plan_pipeline(cfg: GPTConfig | str, pp_size: int, num_microbatches: int, schedule="1f1b", *, chunks: int = 1,
                  layers=None, world_size: int | None = None) -> PipelineLayout:
    """Check the pipeline's shape and build its plan; every bad input raises ONE ValueError that names the fix —
    call it before `launch` (apply_pipeline calls it again on every rank, before any rank talks to another)."""
    cfg = get_config(cfg)
    L = cfg.n_layer
    for name, value in (("pp_size", pp_size), ("num_microbatches", num_microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}; use {name} ≥ 1"
                             + (f" (≥ pp_size={pp_size} keeps every stage busy)" if name == "num_microbatches" else ""))
    if world_size is not None and world_size % pp_size:
        fits = [p for p in range(1, world_size + 1) if world_size % p == 0]
        raise ValueError(f"world size {world_size} is not a multiple of pp_size={pp_size}: the ranks form a pp × dp "
                         f"grid; use pp_size in {fits}, or a world size that is a multiple of {pp_size}")
    if chunks > 1:
        if pp_size < 2:
            raise ValueError("interleaving (chunks > 1) needs pp_size ≥ 2, its chunks take turns across ranks; use "
                             "pp_size ≥ 2, or chunks=1")
        if L % pp_size or (L // pp_size) % chunks:
            per_rank = f"{L / pp_size:g}"
            ok = [v for v in range(1, L // pp_size + 1) if L % pp_size == 0 and (L // pp_size) % v == 0]
            raise ValueError(f"chunks={chunks} does not divide the layers per rank (n_layer/pp_size = {L}/{pp_size} = "
                             f"{per_rank}): each rank's blocks split into v equal chunks; use chunks in {ok or [1]}, "
                             f"or a pp_size that divides n_layer={L}")
    if pp_size * chunks > L:
        raise ValueError(f"cannot split n_layer={L} blocks into {pp_size} stage(s) × {chunks} chunk(s): every stage "
                         f"needs at least one block; use pp_size·chunks ≤ {L}, or a preset with more layers")
    bounds = tuple(split_layers(L, pp_size * chunks, layers))
    return PipelineLayout(make_schedule(schedule, pp_size, num_microbatches, chunks), bounds)


# ============================================================================================ one rank's executor
class Pipeline:
    """This rank's executor; called as `step_fn(model, batches, step, phase)` by `train.run`. `model` is the stage
    or any wrapper around it that forwards `(x, targets, stage=k)` to it; every forward runs through it.

    Gradients are reduced over dp once per step, after the schedule (`no_sync` while the micro-batches run, one
    `finish_gradient_synchronization()` at the end), by `data_parallel` if set — a ZeRO-1/2 `ShardedOptimizer`,
    which the model does not wrap — else by `model` if it is a data-parallel wrapper.

    `records` lists every op this rank ran: (step, op, t0, t1) on the ledger's clock, for timelines.
    """

    def __init__(self, stage: PipelineStage, comm, plan: PipelineLayout):
        self.stage, self.comm, self.plan, self.schedule = stage, comm, plan, plan.schedule
        if comm.world_size != plan.num_stages:
            raise ValueError(f"the plan has {plan.num_stages} stages but the pp axis has {comm.world_size} ranks")
        self.rank = comm.rank
        self.ops = self.schedule.ops[self.rank]
        self.last = self.schedule.num_virtual_stages - 1
        self.split = self.schedule.split_backward
        self.records: list = []
        self.data_parallel = None             # what reduces the gradients over dp (see the class docstring)
        self._model = stage                   # what each forward runs through (the step's outermost model)
        self.loss_scale = 1.0 / self.schedule.num_microbatches
        # per sending rank, the messages it sends to this rank, in its send order (see the module docstring)
        self._order = {src: [key for op in self.schedule.ops[src] for key, dst in self._sends(op) if dst == self.rank]
                       for src in range(plan.num_stages) if src != self.rank}

    def _sends(self, op: Op):
        """What `op` sends, as ((kind, receiving stage, mb), destination rank)."""
        if op.kind == "F" and op.stage < self.last:
            yield ("act", op.stage + 1, op.mb), self.schedule.rank_of(op.stage + 1)
        if op.kind == "B" and op.stage > 0:
            yield ("grad", op.stage - 1, op.mb), self.schedule.rank_of(op.stage - 1)

    # ------------------------------------------------------------------ point to point
    def receive(self, key) -> None:
        """Wait until message `key` has arrived (into `_arrived`): the op that needs it starts after this, so the
        wait shows as idle time, not as compute."""
        kind, stage, _ = key
        src = self.schedule.rank_of(stage - 1 if kind == "act" else stage + 1)
        order = self._order[src]
        while key not in self._inbox:         # post the sender's earlier messages first (they match in order)
            k = order[self._posted[src]]
            buf = torch.empty(self._shape, dtype=self._dtype)      # (b, T, d); (b, T/t, d) under SP
            self._inbox[k] = (self.comm.irecv(buf, src, tag=ACTIVATION_TAG if k[0] == "act" else GRADIENT_TAG), buf)
            self._posted[src] += 1
        handle, buf = self._inbox.pop(key)
        handle.wait()
        self._arrived[key] = buf

    def _send(self, tensor: torch.Tensor, op: Op) -> None:
        for (kind, _, _), dst in self._sends(op):
            self._outbox.append(self.comm.isend(tensor, dst, tag=ACTIVATION_TAG if kind == "act" else GRADIENT_TAG))

    # ------------------------------------------------------------------ ops
    def forward_op(self, op: Op, batches, step: int) -> None:
        if op.stage == 0:
            x = batches.get(step, op.mb)[0]                                  # (b, T) token ids
        else:
            x = self._arrived.pop(("act", op.stage, op.mb)).requires_grad_()  # (b, T, d)
        targets = batches.get(step, op.mb)[1] if op.stage == self.last else None
        pending = [] if self.split else None
        with defer_weight_grads(pending) if self.split else contextlib.nullcontext():
            out = self.stage_forward(op, x, targets)
        if op.stage == self.last:
            self._losses.append(out.detach())
            out = out * self.loss_scale      # 1/M: M micro-batch means → the gradient of the mean over all
        else:
            self._send(out.detach(), op)
        self._live[(op.stage, op.mb)] = (x, out)
        if self.split:
            self._pending[(op.stage, op.mb)] = pending

    def stage_forward(self, op: Op, x, targets):
        return self._model(x, targets, stage=op.stage)

    def backward_op(self, op: Op, batches, step: int) -> None:
        x, out = self._live.pop((op.stage, op.mb))
        grad = None if op.stage == self.last else self._arrived.pop(("grad", op.stage, op.mb))
        torch.autograd.backward(out, grad)
        if op.stage > 0:
            self._send(x.grad, op)
        self.after_backward(op, x, grad)

    def after_backward(self, op: Op, x, grad) -> None:
        """Nothing in a synchronous pipeline: the optimizer steps once all micro-batches are done (the flush)."""

    def weight_op(self, op: Op, batches, step: int) -> None:
        run_weight_grads(self._pending.pop((op.stage, op.mb)))

    # ------------------------------------------------------------------ a step
    def run(self, batches, step: int, phase=None, model=None) -> float:
        """Run this rank's ops for `step`, each forward through `model` (default: the stage); return the mean loss
        over the M micro-batches on the rank that holds the last stage, NaN elsewhere (the loss lives there;
        sending it would add traffic to the boundary count)."""
        M = self.schedule.num_microbatches
        if getattr(batches, "num_microbatches", M) != M:
            raise ValueError(f"the pipeline runs M={M} micro-batches per step but the batches have num_microbatches="
                             f"{batches.num_microbatches}; use mesh.batches(seq_len, micro_batch_size, "
                             f"num_microbatches={M})")
        self._model = self.stage if model is None else model
        self._shape = self.stage.hidden_shape(batches.micro_batch_size, batches.seq_len)
        self._dtype = next(self.stage.parameters()).dtype
        self._inbox, self._arrived, self._posted, self._outbox = {}, {}, dict.fromkeys(self._order, 0), []
        self._live, self._pending, self._losses = {}, {}, []
        phase = phase or (lambda name: contextlib.nullcontext())
        run_op = {"F": (self.forward_op, "forward"), "B": (self.backward_op, "backward"),
                  "W": (self.weight_op, "weight")}
        for op in self.ops:
            if op.kind == "F" and op.stage > 0:
                self.receive(("act", op.stage, op.mb))
            elif op.kind == "B" and op.stage < self.last:
                self.receive(("grad", op.stage, op.mb))
            fn, name = run_op[op.kind]
            t0 = now()
            with phase(name):
                fn(op, batches, step)
            self.records.append((step, str(op), t0, now()))
        for h in self._outbox:
            h.wait()
        self.comm.release()                 # finished transfers no longer pin their tensors
        self._outbox = []
        if self.last not in self.stage.stages:
            return math.nan
        return torch.stack(self._losses).mean().item()

    def __call__(self, model, batches, step: int, phase) -> float:
        dp = self.data_parallel if self.data_parallel is not None else model
        sync = getattr(dp, "finish_gradient_synchronization", None)
        with dp.no_sync() if sync is not None else contextlib.nullcontext():
            loss = self.run(batches, step, phase, model=model)
        if sync is not None:
            with phase("sync"):
                sync()
        return loss

    def timeline(self, step: int) -> list[tuple[str, float, float]]:
        """[(op, t0, t1)] of one step on this rank (picklable: ranks return it)."""
        return [(op, t0, t1) for s, op, t0, t1 in self.records if s == step]


def apply_pipeline(model, mesh_or_comm, *, num_microbatches: int, schedule="1f1b", chunks: int = 1,
                   layers=None) -> PipelineStage:
    """Cut `model` — the course GPT, or its tensor-parallel form (`tensor.apply_tp`; it can also come after, on the
    stage) — into pipeline stages over the mesh's pp axis; return this rank's `PipelineStage`, a model like the
    others every `apply_*` returns; `handle_of(stage, "pipeline")` is its executor (the step_fn for `train.run`).
    Apply data parallelism or ZeRO to the stage afterwards (`apply_zero(stage, mesh, zero_stage)`) and hand its reducer
    to the executor (`pipeline.data_parallel = handle_of(model, "data_parallel")`): it reduces the stage's gradients
    over dp once per step. `parallelize` does all of it."""
    check_splittable(model)
    comm = axis_comm(mesh_or_comm, "pp")
    plan = plan_pipeline(model.config, comm.world_size, num_microbatches, schedule, chunks=chunks, layers=layers)
    stage = PipelineStage(model, plan.schedule.stages_of(comm.rank), plan.bounds, plan.schedule.num_virtual_stages)
    inherit(stage, model)
    attach(stage, "pipeline", Pipeline(stage, comm, plan))
    return stage


def boundary_bytes(plan: PipelineLayout, micro_batch_size: int, seq_len: int, d_model: int, elem_bytes: int, *,
                   tp_size: int = 1, sequence_parallel: bool = False) -> list:
    """Bytes each pp rank sends per step (docs/formulas.md §3.5): M·b·s·d·e for every activation it sends forward
    (each of its stages but the last virtual stage) and every gradient it sends back (each but stage 0); a
    boundary between two stages therefore carries 2·M·b·s·d·e. s = T, or T/t under sequence parallelism, where each
    tp rank sends only its slice of the sequence (without it every tp rank sends the whole, replicated, tensor)."""
    if sequence_parallel and seq_len % tp_size:
        raise ValueError(f"sequence parallelism splits seq_len={seq_len} over tp_size={tp_size}: use a multiple")
    s = plan.schedule
    per = s.num_microbatches * micro_batch_size * (seq_len // tp_size if sequence_parallel else seq_len) \
        * d_model * elem_bytes
    out = []
    for r in range(s.num_stages):
        stages = s.stages_of(r)
        out.append(per * (sum(k < s.num_virtual_stages - 1 for k in stages) + sum(k > 0 for k in stages)))
    return out


__all__ = ["PipelineLayout", "plan_pipeline", "Pipeline", "apply_pipeline", "boundary_bytes",
           "ACTIVATION_TAG", "GRADIENT_TAG"]
