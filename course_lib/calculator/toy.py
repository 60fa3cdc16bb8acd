"""The calculator on the course's own toy runs: for a `GPTConfig`, a `ParallelPlan` and a `TrainConfig`, what each
rank of `parallelize` sends per step on each mesh axis and holds in model states by category — exactly, because
every number comes from the techniques' own layout and formulas, never from a second copy of them (formulas §15.9).

    expected(cfg, plan, tc)   [{'coords', 'bytes': {axis: bytes per step}, 'memory': {category: bytes}}] per rank

The layout facts a count needs are the ones the techniques compute themselves: the stage split
(`pipeline.plan_pipeline`), TP's shards with the padded vocabulary (`apply_tp` on the single-process model),
the recomputation plan of the rank's blocks (`recompute.make_plan`), and the reducer's buckets (DDP's
`make_buckets`, ZeRO-1/2's padded `FlatBuffer`s, FSDP's groups). They are built here on *layout communicators*:
a rank number and a group size, no process group — any attempt to communicate raises. The bytes are then the one
sum `parallel.expected.bytes_per_step` that a composed run's ledger is checked against.

Model states per rank, as the memory accountant books them after an optimizer step (fp32 AdamW, e bytes per
element; P the padded elements of K ZeRO buckets; Ψ_r the elements this rank holds in n tensors):

    zero 0    parameters e·Ψ_r    gradients e·Ψ_r      optimizer 2e·Ψ_r + 4n      (m, v; a 4-byte step per tensor)
    zero 1    e·P                 e·P                  2e·P/N + 4K                (`zero.model_state_bytes` + steps)
    zero 2    e·P                 e·P/N                2e·P/N + 4K
    zero 3    e·P/N               e·P/N                2e·Ψ_r + 4n               (FSDP's shards, Ψ_r = local_numel)

Step time on the toy is *modeled* from op costs (`modeled_step`), measured here by `measure_op_costs`: one
block's and the embedding + head's forward + backward seconds for one micro-batch, in one process. A rank's compute
per micro-batch is its blocks' and ends' share ÷ tp (× 4/3 when full recomputation reruns the forward), times M,
times notebook 05's pipeline factor (`step_time.pipeline_factor`); each axis's communication is a cost per message +
bytes / bandwidth on a link fitted on this machine (`costmodel.fit_alpha_beta`), not overlapped — the per-message
cost is what a message costs inside the course's ring collectives after compute, as a step sends it (the mean of
`distributed.collectives.ring_message_seconds` with a block's forward + backward before each call: the ring's own work,
the waits for the slower rank and, with as many ranks as cores, the wait for gloo's I/O thread to be scheduled),
not the ping-pong's fastest one-way α, which an idle pair of ranks sees; and every step pays one overhead beyond its
forward and backward (AdamW, the batch, the loop), fitted once on the one-process run of the same loop
(`step_overhead`) and never on the runs it predicts. The stated
tolerance is a factor of 2 either way (TOLERANCE, formulas §15.9): the toy's ops last tens of microseconds, where
Python dispatch and a scheduler tick (a few ms) are of the order of the op itself, and TP's split of a 32-wide
matmul does not divide its time by t. `measured_vs_modeled` gives the notebook the comparison; no test asserts on
a measured time.
"""
from __future__ import annotations

from collections import deque

import torch

from ..distributed.comm import Communicator, Ledger
from ..distributed.mesh import AXES

TOLERANCE = 2.0          # measured / modeled step time within [1/2, 2] (module docstring)


class LayoutComm(Communicator):
    """A group's coordinates (`rank` of `world_size`, ledger `name`) without a process group: what the techniques
    read while they cut their layout. Every communication raises."""

    def __init__(self, rank: int, world_size: int, name: str):
        self.group, self.name, self.rank, self.world_size = None, name, rank, world_size
        self.global_ranks = list(range(world_size))
        self.ledger = Ledger(rank, world_size)
        self._retired = deque(maxlen=8)

    def _refuse(self, *args, **kwargs):
        raise RuntimeError(f"LayoutComm '{self.name}' only describes a layout; it cannot communicate")

    send = recv = isend = irecv = sendrecv = broadcast = all_reduce = all_gather = reduce_scatter = barrier = _refuse
    new_group = renamed = _refuse


class _LayoutOptimizer:
    """The inner optimizer of a layout-only ZeRO-1/2: the buckets and shards do not depend on it, so nothing is
    built (a torch optimizer would import the compiler stack for nothing)."""

    def __init__(self, params, **hyper):
        self.param_groups = [{"params": list(params)}]


def coords_of(plan, rank: int) -> dict:
    """The mesh coordinates of world rank `rank` (pp outermost, tp innermost: `distributed.mesh`)."""
    out = {}
    for axis in reversed(AXES):
        rank, out[axis] = divmod(rank, getattr(plan, axis))
    return {a: out[a] for a in AXES}


def _unsupported(plan) -> str | None:
    if plan.ep > 1:
        return "ep > 1 (expert parallelism's layout is not modelled here)"
    if plan.precision is not None:
        return f"precision={plan.precision!r} (the toy layout is counted in the model's own dtype)"
    if plan.offload_optimizer is not None or plan.offload_activations:
        return "offload (what lives on the host is not a device category)"
    return None


def rank_layout(cfg, plan, tc, rank: int, dtype=torch.float32) -> dict:
    """What rank `rank` of `parallelize(GPT(cfg), Mesh(…), plan, train_config=tc)` holds, built by the techniques on
    layout communicators: its model (TP shards, its pipeline stage), the pipeline layout, the recomputation plan of
    its blocks and the reducer over dp × cp."""
    from ..composer.parallelize import _fsdp_options
    from ..core.model import GPT
    from ..memopt.recompute import make_plan
    from ..parallel.dp import apply_dp
    from ..parallel.fsdp import apply_fsdp
    from ..parallel.pipeline.executor import plan_pipeline
    from ..parallel.pipeline.stage import PipelineStage
    from ..parallel.tensor import apply_tp
    from ..parallel.zero import ShardedOptimizer
    why = _unsupported(plan)
    if why:
        raise ValueError(f"calculator.toy counts fp32 plans without ep or offload; this plan has {why}")
    plan.check(cfg, plan.pp * plan.dp * plan.cp * plan.tp, batch_size=tc.batch_size)
    c = coords_of(plan, rank)
    model = GPT(cfg, seed=tc.seed).to(dtype)
    if plan.tp > 1:
        model = apply_tp(model, LayoutComm(c["tp"], plan.tp, "tp"), sequence_parallel=plan.sequence_parallel)
    layout = None
    if plan.pp > 1:
        layout = plan_pipeline(cfg, plan.pp, plan.microbatches, plan.schedule, chunks=plan.chunks)
        s = layout.schedule
        model = PipelineStage(model, s.stages_of(c["pp"]), layout.bounds, s.num_virtual_stages)
    n_blocks = len(model.blocks)
    recompute = make_plan(plan.recompute, n_blocks) if plan.recompute is not None else None
    N = plan.dp * plan.cp
    name = "dp×cp" if plan.cp > 1 else "dp"          # the ledger name of mesh.group("dp", "cp")
    group = LayoutComm(c["dp"] * plan.cp + c["cp"], N, name)
    reducer = None                                    # what parallelize reduces the gradients over dp × cp with
    if plan.zero == 3:
        reducer = apply_fsdp(model, group, sync_module_states=False, **_fsdp_options(plan, "fp32"))
    elif plan.zero in (1, 2):                         # ZeRO-1/2 shard even over a group of one
        reducer = ShardedOptimizer(model.parameters(), _LayoutOptimizer, group, stage=plan.zero, sync=False)
    elif N > 1:
        reducer = apply_dp(model, group, kind="bucket", broadcast=False)
    return {"coords": c, "model": model, "pipeline": layout, "recompute_plan": recompute, "reducer": reducer,
            "dp_group": name, "micro_batch_size": tc.batch_size // (plan.dp * plan.microbatches),
            "elem": torch.finfo(dtype).bits // 8}


def model_state_memory(lay: dict, plan) -> dict:
    """Parameters, gradients and optimizer state (bytes) the memory accountant books on this rank after a step
    (module docstring's table)."""
    from ..parallel.fsdp import FSDP
    from ..parallel.zero import ShardedOptimizer, model_state_bytes
    e, red = lay["elem"], lay["reducer"]
    if isinstance(red, ShardedOptimizer):
        N = red.comm.world_size
        out = model_state_bytes(red.padded_numel, N, plan.zero, param=e, grad=e, optim=2 * e)
        out["optimizer"] += 4 * red.num_shards
        return out
    if isinstance(red, FSDP):
        N = red.comm.world_size
        n = len(list(red.parameters()))
        return {"parameters": e * red.padded_numel // N, "gradients": e * red.padded_numel // N,
                "optimizer": 2 * e * red.local_numel + 4 * n}
    params = list(dict.fromkeys(p for p in lay["model"].parameters() if p.requires_grad))
    psi = sum(p.numel() for p in params)
    out = model_state_bytes(psi, 1, 0, param=e, grad=e, optim=2 * e)
    out["optimizer"] += 4 * len(params)
    return out


def expected(cfg, plan, tc, dtype=torch.float32) -> list[dict]:
    """Per world rank: its coordinates, the bytes it sends per step on each axis (the ledger's group names) and its
    model states by category — what `parallelize` will measure (tests/integration/test_calculator_toy.py)."""
    from ..composer.expected import bytes_per_step
    out = []
    for rank in range(plan.pp * plan.dp * plan.cp * plan.tp):
        lay = rank_layout(cfg, plan, tc, rank, dtype)
        sent = bytes_per_step(cfg, plan, lay["coords"], micro_batch_size=lay["micro_batch_size"], elem=lay["elem"],
                              pipeline=lay["pipeline"], recompute_plan=lay["recompute_plan"],
                              reducer=lay["reducer"], dp_group=lay["dp_group"])
        out.append({"coords": lay["coords"], "bytes": {a: n for a, n in sent.items() if n},
                    "memory": model_state_memory(lay, plan)})
    return out


# ============================================================================================ step time (modeled)
def measure_op_costs(cfg, micro_batch_size: int, repeats: int = 5, dtype=torch.float32) -> dict:
    """Measured here: the best of `repeats` forward + backward seconds of one micro-batch through the single-process
    GPT with n_layer blocks and with one block; their difference ÷ (n_layer − 1) is one block, the rest the ends
    (embedding, head and loss)."""
    import time

    from ..core.data import ShardedBatches
    from ..core.model import GPT

    def best(c):
        model = GPT(c).to(dtype)
        x, y = ShardedBatches(c.seq_len, micro_batch_size).global_batch(0)
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(x, y)[1].backward()
            out.append(time.perf_counter() - t0)
        return min(out)
    whole, one = best(cfg), best(cfg.replace(n_layer=1))
    block = max(whole - one, 0.0) / max(cfg.n_layer - 1, 1)
    return {"block": block, "ends": max(one - block, 0.0), "measured": "here (single process)"}


def modeled_step(cfg, plan, tc, op_costs: dict, link, messages: dict | None = None,
                 alpha: float | None = None) -> list[dict]:
    """Per rank, the *modeled* step in seconds by part (module docstring): 'compute', 'bubble', 'step overhead'
    (`op_costs['step']`, 0 if absent: what a step costs beyond its forward and backward — the optimizer, the
    batch, the loop; `step_overhead` fits it on one process) and one entry per axis. `messages` ({axis: count per
    step}, e.g. a ledger's) adds a cost per message: `alpha` seconds (e.g. the mean of `distributed.collectives.
    ring_message_seconds`, what a message costs inside a collective), or the link's α; without it only bytes count."""
    from ..parallel.pipeline.executor import plan_pipeline
    from .step_time import pipeline_factor
    out = []
    M = plan.microbatches
    pipe = plan_pipeline(cfg, plan.pp, M, plan.schedule, chunks=plan.chunks) if plan.pp > 1 else None
    for r in expected(cfg, plan, tc):
        parts = pipe.parts(r["coords"]["pp"]) if pipe is not None else {"layers": cfg.n_layer, "embed": True,
                                                                          "head": True}
        ends = op_costs["ends"] * (parts["embed"] + parts["head"]) / 2
        per_mb = (parts["layers"] * op_costs["block"] * (4 / 3 if plan.recompute == "full" else 1) + ends) / plan.tp
        compute = M * per_mb
        factor = pipeline_factor(plan.schedule, plan.pp, M, plan.chunks) if plan.pp > 1 else 1.0
        t = {"compute": compute, "bubble": compute * (factor - 1), "step overhead": op_costs.get("step", 0.0)}
        for axis, nbytes in r["bytes"].items():
            t[axis] = nbytes / link.bandwidth + (link.alpha if alpha is None else alpha) * (messages or {}).get(axis, 0)
        out.append({"coords": r["coords"], "parts": t, "total": sum(t.values())})
    return out


def step_overhead(cfg, tc, op_costs: dict, measured_one_process_s: float) -> float:
    """The one fitted constant of the toy's step model: the measured step of one process (the same loop, no
    parallelism) minus the forward + backward its op costs predict — everything else a step does once (AdamW,
    zero_grad, the batch, Python). Fitted on the one-process run, never on the runs it then predicts."""
    from ..composer.plan import ParallelPlan
    one = modeled_step(cfg, ParallelPlan(), tc, {**op_costs, "step": 0.0}, None)[0]["total"]
    return max(measured_one_process_s - one, 0.0)


def measured_vs_modeled(measured_s: float, modeled: list[dict]) -> dict:
    """The measured step (seconds, the slowest rank's) beside the modeled one (the slowest rank's), their ratio and
    whether it is within TOLERANCE either way. For a notebook to print; never a test's assert."""
    worst = max(m["total"] for m in modeled)
    ratio = measured_s / worst
    return {"measured_s": measured_s, "modeled_s": worst, "ratio": ratio,
            "within": 1 / TOLERANCE <= ratio <= TOLERANCE}


__all__ = ["expected", "measure_op_costs", "modeled_step", "step_overhead", "measured_vs_modeled", "rank_layout",
           "model_state_memory", "coords_of", "LayoutComm", "TOLERANCE"]
