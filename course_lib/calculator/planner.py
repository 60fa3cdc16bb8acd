"""The planner: every valid way to run a model on a cluster with a global batch, the ones that do not fit dropped
(with the reason), the rest ranked by modeled step time, and the choice explained in the survey's decision-flow
terms (formulas §15.7). All of it is *modeled*: `memory.memory_per_device` and `step_time.step_time`.

    p = search(model, cluster, batch=1536, world=1024)
    p.best, p.ranked[:5], p.rejected[:5], p.explain()
    decision_flow(p)      # the survey's questions, each answered from p's options (capstone_plots draws it)
    p.place(job)          # where a given (e.g. published) configuration ranks, and its time ÷ the best's

Enumerated: tp a power of two dividing the heads (up to twice a node, so that crossing the node is on the table),
any pp up to the layers (an even split where pp divides them, else the first and last stages lighter, as Llama 3
and DeepSeek-V3 ran), cp for sequences of 16K tokens or more, ep dividing the experts for MoE, dp the rest;
micro-batch 1–8; ZeRO 1 (and 3 without a pipeline); recomputation none / selective / full; 1F1B, or interleaved
with v chunks for every divisor v ≥ 2 of ⌈layers per stage⌉ up to MAX_CHUNKS (Korthikanti's 530B runs 3); SP
whenever tp > 1; optimizer offload only when nothing fits without it. Every option goes through
`config.validate` (in `evaluate`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .config import CalculatorError, Cluster, Decoder, Job, validate
from .memory import memory_per_device
from .step_time import IDEAL, Efficiency, step_time

GB = 1e9
MAX_CHUNKS = 8          # interleaved virtual stages per rank the planner tries (each costs pp·v boundary transfers)


@dataclass
class Option:
    job: Job
    seconds: float = float("inf")
    memory: dict | None = None
    reason: str = ""                 # why it was rejected ("" if it fits)
    step: dict | None = None

    @property
    def fits(self) -> bool:
        return not self.reason


@dataclass
class Search:
    model: Decoder
    cluster: Cluster
    batch: int
    world: int
    ranked: list = field(default_factory=list)        # Options that fit, fastest first
    rejected: list = field(default_factory=list)      # Options that do not, fastest (if they had fit) first

    @property
    def best(self) -> Option:
        if not self.ranked:
            raise CalculatorError(f"{self.model.name} fits nowhere on {self.world} × {self.cluster.name} with batch "
                                  f"{self.batch}: {self.rejected[0].reason if self.rejected else 'no valid mesh'}; "
                                  f"use more devices, devices with more memory, or a smaller model or sequence")
        return self.ranked[0]

    def place(self, job: Job) -> dict:
        """Rank of `job` by modeled time among the options that fit (1 = the planner's best) and its time ÷ the
        best's; a job the planner did not enumerate is evaluated and placed by its time. A job the memory model
        rejects is still placed by its time (`fits` False, with the `reason`); one `validate` refuses has no time
        (rank None)."""
        opt = evaluate(self.model, self.cluster, job, self._eff, self.world)
        if opt.memory is None:
            return {"rank": None, "of": len(self.ranked), "ratio": None, "fits": False, "reason": opt.reason,
                    "option": opt}
        rank = 1 + sum(o.seconds < opt.seconds * (1 - 1e-12) for o in self.ranked)
        return {"rank": rank, "of": len(self.ranked), "ratio": opt.seconds / self.best.seconds, "fits": opt.fits,
                "reason": opt.reason, "option": opt}

    def explain(self) -> list[str]:
        return explain(self)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _splits(n_layer: int, stages: int) -> bool:
    """Whether `n_layer` layers fill `stages` stages evenly or with the ends lighter (`config.ends_split`)."""
    return stages <= n_layer and (n_layer % stages == 0 or -(-n_layer // stages) >= 2)


def candidates(m: Decoder, cluster: Cluster, batch: int, world: int, *, offload: bool = False,
               recompute=(None, "selective", "full"), sequence_parallel: bool = True, zeros=(1, 3),
               schedules=("1f1b", "interleaved"), max_chunks: int = MAX_CHUNKS, micro_batch_sizes=(1, 2, 4, 8),
               overlap_dp: bool = True, precision: str = "bf16", flash_attention: bool = False,
               overlap_ep: bool = False):
    """Every Job the planner considers; the keywords restrict it to a technique set (e.g. a 2021 paper's:
    recompute=('full',), sequence_parallel=False, zeros=(0, 3), overlap_dp=False; or a recipe and flash attention,
    the same for every option). 'interleaved' is tried with
    every number of chunks v in 2..max_chunks that divides the layers per stage."""
    tps = [t for t in (1, 2, 4, 8, 16, 32) if t <= 2 * cluster.devices_per_node and m.n_head % t == 0 and t <= world]
    cps = [1] + ([c for c in (2, 4, 8, 16) if m.seq_len % (2 * c) == 0] if m.seq_len >= 16384 else [])
    for tp in tps:
        for cp in cps:
            for pp in range(1, min(m.n_layer, world) + 1):
                if world % (tp * pp * cp):
                    continue
                dp = world // (tp * pp * cp)
                per_stage = -(-m.n_layer // pp)               # ⌈L/pp⌉: the even split's, or the ends-lighter one's
                eps = [e for e in _divisors(dp) if m.n_expert and m.n_expert % e == 0] or [1]
                for mb in micro_batch_sizes:
                    if batch % (dp * mb):
                        continue
                    for zero in (z for z in zeros if z < 3 or pp == 1):
                        for rc in recompute:
                            scheds = [(sc, 1) for sc in schedules if sc != "interleaved"]
                            if "interleaved" in schedules:
                                scheds += [("interleaved", v) for v in _divisors(per_stage)
                                           if 2 <= v <= max_chunks and _splits(m.n_layer, pp * v)]
                            for sched, v in (scheds if pp > 1 else [("1f1b", 1)]):
                                split = None if m.n_layer % (pp * v) == 0 else "ends"
                                if split and not _splits(m.n_layer, pp * v):
                                    continue
                                for ep in eps:
                                    yield Job(batch=batch, micro_batch=mb, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep,
                                              zero=zero, schedule=sched, chunks=v, stage_layers=split,
                                              sequence_parallel=sequence_parallel and tp > 1, recompute=rc,
                                              offload="optimizer" if offload else None, overlap_dp=overlap_dp,
                                              precision=precision, flash_attention=flash_attention,
                                              overlap_ep=overlap_ep)


def evaluate(m: Decoder, cluster: Cluster, job: Job, eff: Efficiency = IDEAL, world: int | None = None) -> Option:
    opt = Option(job)
    try:
        validate(m, cluster, job, world)
    except CalculatorError as e:
        opt.reason = str(e)
        return opt
    opt.memory = memory_per_device(m, job, cluster)
    opt.step = step_time(m, job, cluster, eff)
    opt.seconds = opt.step["total"]
    if not opt.memory["fits"]:
        dev = opt.memory["device"]
        worst = max(dev, key=dev.get)
        opt.reason = (f"needs {opt.memory['total'] / GB:.1f} GB per device > {cluster.device_memory / GB:.0f} GB "
                      f"(largest: {worst} {dev[worst] / GB:.1f} GB)")
    return opt


def search(m: Decoder, cluster: Cluster, batch: int, world: int | None = None, eff: Efficiency = IDEAL,
         **restrict) -> Search:
    """Enumerate, check, fit and rank (module docstring). `world` defaults to the cluster's device count;
    `restrict` goes to `candidates` (a technique set)."""
    world = cluster.num_devices if world is None else world
    for obj, cls in ((m, Decoder), (cluster, Cluster), (eff, Efficiency)):
        if not isinstance(obj, cls):
            raise CalculatorError(f"plan: expected a {cls.__name__}, got {type(obj).__name__}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise CalculatorError(f"world must be a positive number of devices, got {world!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise CalculatorError(f"batch must be a positive number of sequences, got {batch!r}")
    if world > cluster.num_devices:
        raise CalculatorError(f"world={world} devices but {cluster.name} has {cluster.num_devices}; use fewer, or a "
                              f"larger cluster")
    p = Search(m, cluster, batch, world)
    p._eff = eff
    for offload in (False, True):
        jobs = candidates(m, cluster, batch, world, offload=offload, **restrict)
        opts = [evaluate(m, cluster, j, eff, world) for j in jobs]
        p.ranked = sorted((o for o in opts if o.fits), key=lambda o: o.seconds)
        p.rejected += sorted((o for o in opts if not o.fits), key=lambda o: o.seconds)
        if p.ranked:
            break
    if not p.rejected and not p.ranked:
        raise CalculatorError(f"no mesh divides world={world} for {m.name}: dp × tp × pp must equal it with tp "
                              f"dividing {m.n_head} heads, pp ≤ {m.n_layer} layers and dp dividing the batch "
                              f"{batch}; change the world size or the batch")
    return p


# ============================================================================================ the decision flow
@dataclass(frozen=True)
class Decision:
    """One question of the survey's decision flow, answered by this plan's own options.

    `outcome`: where the answer leads (a technique, or none); `taken`: whether the planner's best option adds a
    technique at this step; `evidence`: the one line that backs the answer with two options of this plan (or the
    reason none fits)."""
    question: str
    answer: str
    outcome: str
    taken: bool
    evidence: str


def _best(p: Search, pred) -> Option | None:
    return next((o for o in p.ranked if pred(o.job)), None)


def _leanest_rejected(p: Search, pred) -> Option | None:
    """The rejected option (of those `pred` selects) that comes closest to fitting."""
    return min((o for o in p.rejected if pred(o.job) and o.memory), key=lambda o: o.memory["total"], default=None)


def decision_flow(p: Search) -> list[Decision]:
    """The survey's decision flow (formulas §15.7) in its order — data parallelism first, then ZeRO-3 or a
    pipeline, tensor parallelism inside a node, CP for long sequences, EP for experts, recomputation, offload —
    each question answered from the options this plan fitted and ranked. `explain` prints it;
    `capstone_plots.plot_decision_flow` draws it."""
    best, dpn, j = p.best, p.cluster.devices_per_node, p.best.job
    flow = []

    def only_dp(q):
        return q.tp == 1 and q.pp == 1 and q.cp == 1 and q.zero < 3
    dp = _best(p, only_dp)
    if dp:
        ev = (f"data parallelism alone fits: {dp.job.describe()} at {dp.seconds:.3g} s "
              f"({dp.seconds / best.seconds:.2f}× the best)")
    else:
        r = _leanest_rejected(p, only_dp)
        ev = ("data parallelism alone does not fit" + (f": even {r.job.describe()} {r.reason}" if r else
                                                       " (no such mesh)"))
    flow.append(Decision("Do the model states fit with data parallelism (ZeRO-1) alone?", "yes" if dp else "no",
                         "DP + ZeRO-1 is enough" if only_dp(j) else
                         f"fits, but {dp.seconds / best.seconds:.2f}× the best: go on" if dp else
                         "shard or split the model (below)", only_dp(j), ev))

    z3 = _best(p, lambda q: q.zero == 3)
    pipe = _best(p, lambda q: q.pp > 1)
    if z3 and pipe:
        win, lose = (z3, pipe) if z3.seconds < pipe.seconds else (pipe, z3)
        why = ("ZeRO-3's three parameter collectives per micro-batch hide behind enough compute per device"
               if win is z3 else "ZeRO-3 would gather every parameter over dp each micro-batch, more than the "
                                 "compute per device can hide; the pipeline pays a bubble and boundary sends instead")
        ev = (f"ZeRO-3 vs pipelining: {'ZeRO-3' if win is z3 else 'pipelining'} wins "
              f"({win.seconds:.3g} s vs {lose.seconds:.3g} s): {why}")
        answer = "ZeRO-3" if win is z3 else "pipeline"
    elif pipe:
        ev = ("ZeRO-3 vs pipelining: no ZeRO-3 option fits (a whole layer's gathered weights and the "
              "unsplit activations per device), so the model is cut into pipeline stages")
        answer = "pipeline"
    elif z3:
        ev = "ZeRO-3 vs pipelining: no pipelined option fits or the layers do not divide; ZeRO-3 shards the states"
        answer = "ZeRO-3"
    else:
        ev, answer = "", "neither"
    flow.append(Decision("Shard the states with ZeRO-3, or cut the layers into a pipeline?", answer,
                         {"ZeRO-3": "ZeRO-3 (FSDP)", "pipeline": "pipeline parallelism"}.get(answer, "neither"),
                         (j.zero == 3) if answer == "ZeRO-3" else (j.pp > 1) if answer == "pipeline" else False, ev))

    inside = _best(p, lambda q: q.tp <= dpn)
    across = _best(p, lambda q: q.tp > dpn)
    if inside and across:
        ev = (f"TP stays inside a node: its 4 all-reduces per layer and micro-batch go over {p.cluster.intra.name}; "
              f"the best tp > {dpn} crosses to {p.cluster.inter.name} and takes "
              f"{across.seconds / inside.seconds:.2f}× as long")
    else:
        ev = ""
    flow.append(Decision(f"Tensor parallelism, and only inside a node (tp ≤ {dpn})?",
                         f"tp = {j.tp}" if j.tp > 1 else "no", "TP + SP" if j.tp > 1 else "no TP", j.tp > 1, ev))

    if p.model.seq_len >= 16384:
        alone = _best(p, lambda q: q.cp == 1)
        if j.cp > 1:
            ev = (f"CP is necessary: at {p.model.seq_len} tokens one sequence's activations per layer are too "
                  f"large for one device" if alone is None else
                  f"CP is faster here ({best.seconds:.3g} s vs {alone.seconds:.3g} s without)")
        else:
            ev = f"CP is not needed: at {p.model.seq_len} tokens the best option splits no sequence"
        flow.append(Decision("Long sequences (≥ 16K tokens): split each over a CP group?",
                             f"cp = {j.cp}" if j.cp > 1 else "no",
                             "context parallelism" if j.cp > 1 else "no CP", j.cp > 1, ev))
    if p.model.n_expert:
        flow.append(Decision("Mixture of experts: spread the experts over an EP group?",
                             f"ep = {j.ep}" if j.ep > 1 else "no",
                             "expert parallelism" if j.ep > 1 else "experts replicated", j.ep > 1,
                             f"EP: ep={j.ep} spreads the {p.model.n_expert} experts; experts are "
                             f"{'split' if j.ep > 1 else 'replicated'} over the dp ranks"))

    plain = _best(p, lambda q: q.recompute is None)
    if j.recompute is None:
        ev = "no recomputation: the activations fit, so nothing is computed twice"
    elif plain is None:
        ev = f"recomputation is necessary: no option without it fits; {j.recompute} is the cheapest that does"
    else:
        ev = (f"{j.recompute} recomputation is faster here ({best.seconds:.3g} s vs {plain.seconds:.3g} s "
              f"without): the memory it frees buys a larger micro-batch or a smaller model-parallel group")
    flow.append(Decision("Do the activations fit without recomputation?", "yes" if plain else "no",
                         f"{j.recompute} recomputation" if j.recompute else "no recomputation",
                         j.recompute is not None, ev))

    flow.append(Decision("Does the optimizer state fit on the device?", "no" if j.offload else "yes",
                         "optimizer offload" if j.offload else "optimizer on the device", bool(j.offload),
                         "offload is necessary: nothing fits with the optimizer state on the device"
                         if j.offload else ""))
    return flow


def explain(p: Search) -> list[str]:
    """The choice in the survey's decision-flow terms: the best option, then the evidence of each decision of
    `decision_flow` (each line backed by two options of this plan), then the fastest rejected option."""
    best = p.best
    lines = [f"best: {best.job.describe()} — {best.seconds:.3g} s/step (modeled), MFU {best.step['mfu']:.0%}, "
             f"{best.memory['total'] / GB:.1f} of {p.cluster.device_memory / GB:.0f} GB"]
    lines += [d.evidence for d in decision_flow(p) if d.evidence]
    if p.rejected:
        r = p.rejected[0]
        lines.append(f"fastest rejected: {r.job.describe()} — {r.reason}")
    return lines


__all__ = ["Option", "Search", "Decision", "candidates", "evaluate", "search", "decision_flow", "explain"]
