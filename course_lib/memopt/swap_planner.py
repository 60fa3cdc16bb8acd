"""A swap planner in the style of SwapAdvisor (Huang, Jin & Li, ASPLOS 2020): trace one real training step, then
choose which activations to swap out to the host and when to prefetch each one, so that the step fits a device
memory budget and the transfers the compute cannot hide cost as little modeled time as possible.

    trace_step      one forward + backward under `TracingTracker` (the memory accountant with an op clock): every
                    storage's size, the op that allocated it and the op after which it was freed, every op's
                    measured time; every tensor autograd saves is swapped out once in this run, which shows when
                    the forward drops it (`drop`), when backward first needs it (`need`) and when autograd lets go
                    (`release`)
    simulate        a plan's modeled step time (ops ÷ speedup, the α–β link for d2h and h2d, one transfer at a
                    time per direction; a prefetch late for its op stalls everything after it) and its exact device
                    memory at every op
    greedy          budget-driven baseline (vDNN/Capuchin-like): while the peak is over the budget, swap the largest
                    tensor alive at the peak, prefetched just early enough to hide its own transfer
    genetic         the search: a genetic algorithm over (keep | swap with one of several prefetch leads) per
                    tensor, seeded with the baselines, minimizing modeled time subject to the budget
    execute         runs a plan for real on the simulated accelerator at the budget (no OOM allowed) and returns the
                    gradients, which must be the reference's bit for bit

Device memory of a saved storage c (ops are numbered; "alive during op k" is what the accountant counts):
    kept      [birth, max(drop, released)]
    swapped   [birth, max(drop, release)] ∪ [prefetch, released]        drop ≤ release < prefetch < need
A prefetch is issued at an op boundary, before op `prefetch`: backward asks for a tensor between two ops, and a
copy made right then could meet frees that have not happened yet, so the plan brings it in at the boundary before
(prefetch ≤ need − 1) and the model stays exact. The least any plan can use is max over ops of (everything else +
each swappable tensor on [birth, drop] ∪ [need − 1, released]): a budget below that is refused.
docs/formulas.md §6.5.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils._pytree import tree_flatten

from ..costmodel import Link, get_link
from ..memory import MemoryTracker, fmt_bytes, now, saved_tensors_hooks_over, untracked
from .offload import DEFAULT_LINK, StorageSwap, _Packed, transfer_log


# ============================================================================================ the trace
@dataclass
class Storage:
    """One storage of the traced step. Op indices: -1 = before the step, n_ops = still alive after it."""
    id: str                 # "op:k" — the op that allocated it and which of its new storages it is
    nbytes: int
    birth: int
    free: int
    placement: str
    category: str           # its label when it was born (parameters, gradients, other…)
    op: str
    last_use: int = -1      # the last op that read it
    saved: bool = False     # autograd saved it for backward
    pack: int = -1          # the op during which it was first saved
    drop: int = -1          # the op after which the forward no longer holds it (it was swapped out in the trace)
    need: int = -1          # the first op in backward that needs it back (asked for just before this op)
    release: int = -1       # the op after which autograd let go of it
    swappable: bool = False


class TracingTracker(MemoryTracker):
    """The memory accountant with an op clock: the op index is the clock every record is kept in. Ops run while
    `quiet()` (the swap machinery's own copies) are counted as memory but are not ops of the step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.clock = -1
        self.ops: list = []                         # (op name, measured seconds)
        self.at_op: list = []                       # device bytes right after each op's outputs appeared
        self.records: list[Storage] = []
        self._record_of: dict = {}                  # storage key -> its live record
        self._counters: dict = {}
        self._local = threading.local()
        self.boundary = None                        # callback(op index) before each op runs (the executor's)

    @contextlib.contextmanager
    def quiet(self):
        before = getattr(self._local, "quiet", False)
        self._local.quiet = True
        try:
            yield
        finally:
            self._local.quiet = before

    def _pack(self, t: torch.Tensor):
        with self.quiet():                          # the accountant's own detached alias is bookkeeping, not an op
            return super()._pack(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(self._local, "quiet", False):
            return super().__torch_dispatch__(func, types, args, kwargs)
        if self.boundary is not None:
            with self.quiet():
                self.boundary(self.clock + 1)
        self.clock += 1
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                rec = self._record_of.get(t.untyped_storage()._cdata)
                if rec is not None:
                    rec.last_use = self.clock
        t0 = now()
        out = func(*args, **(kwargs or {}))
        self.ops.append((str(func.overloadpacket.__name__), now() - t0))
        self._outputs(out)
        self.at_op.append(self.total)
        return out

    def _add(self, storage, category, placement):
        key = storage._cdata
        new = storage.nbytes() > 0 and key not in self._live
        if new:
            k = self._counters.get(self.clock, 0)
            self._counters[self.clock] = k + 1
            rec = Storage(f"{self.clock}:{k}", storage.nbytes(), self.clock, -2, placement, category,
                          self.ops[-1][0] if self.ops and self.clock >= 0 else "(before the step)")
            self.records.append(rec)
            self._record_of[key] = rec
        super()._add(storage, category, placement)

    def _free(self, key):
        rec = self._record_of.pop(key, None)
        if rec is not None:
            rec.free = self.clock
        super()._free(key)

    def record_of(self, t: torch.Tensor) -> "Storage | None":
        return self._record_of.get(t.untyped_storage()._cdata)


@dataclass
class Trace:
    """A traced forward + backward: ops with measured seconds, and every device storage with its lifetime."""
    ops: list                   # [(name, seconds)]
    storages: list              # [Storage] on the device (the offload's own copies excluded)
    candidates: list            # [Storage] that can be swapped: saved, not parameters, idle between drop and need
    base: np.ndarray            # device bytes alive during each op of everything but the candidates (a saved
                                # storage that cannot be swapped counted as kept); a plan adds the candidates
    peak: int                   # device peak without swapping (the accountant's, reconstructed)
    measured_peak: int          # the accountant's peak in the trace run itself (every saved tensor swapped)
    psi_bytes: int              # parameter bytes (always on the device)

    @property
    def n_ops(self) -> int:
        return len(self.ops)

    def starts(self, speedup: float = 1.0) -> np.ndarray:
        """When op k starts if nothing stalls (k = n_ops: when the step ends), ops at measured time ÷ speedup."""
        return np.concatenate([[0.0], np.cumsum([sec for _, sec in self.ops])]) / speedup

    @property
    def compute_seconds(self) -> float:
        return sum(s for _, s in self.ops)

    def ids(self) -> set:
        return {c.id for c in self.candidates}


class _Executor:
    """The saved-tensor hook pair of the trace run and of a plan's execution.

    trace (plan=None): every saved storage (but parameters and buffers) is copied to the host at its first save and
        autograd keeps a note, so the forward's own references decide when the device original dies (`drop`); in
        backward it is brought back when first asked for (before op `need`) and dies when autograd lets go.
    plan: only the plan's storages are swapped; the device original is held through its `release` op, its copy
        comes back before its `prefetch` op (at its first use, if that is the prefetch op itself), and everything
        else stays as it is. Ops that run at an op boundary are the tracker's own: they count as memory, not ops.
    """

    def __init__(self, tracker: TracingTracker, keep: set, plan: "Plan | None" = None):
        self.tracker, self.keep, self.plan = tracker, keep, plan
        self.swap = StorageSwap(transfer_log())
        self.packs: dict = {}           # record id -> stash
        self.first_need: dict = {}
        self.first_pack: dict = {}
        self.copies: dict = {}          # record id -> the record of its device copy
        if plan is not None:
            self._out = plan.release
            self._due: dict = {}
            for cid, p in plan.prefetch.items():
                self._due.setdefault(p, []).append(cid)
            tracker.boundary = self._boundary

    def _boundary(self, k: int) -> None:
        for cid, s in self.packs.items():
            if s.hold is not None and self._out[cid] < k:    # past its release op: the original may go
                s.hold = None
        for cid in self._due.get(k, ()):
            s = self.packs.get(cid)
            if s is not None and s.device is None and s.host is not None:
                self._fetch(s)

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        if storage._cdata in self.keep or not storage.nbytes() or t.layout != torch.strided:
            return t
        rec = self.tracker.record_of(t)
        if rec is None or rec.placement != "device" or (self.plan is not None and rec.id not in self.plan.prefetch):
            return t
        with self.tracker.quiet():
            s, new = self.swap.stash(t, rec.id, rec.id)
        if new:
            self.packs[rec.id] = s
            self.first_pack[rec.id] = self.tracker.clock
            if self.plan is not None:
                s.hold = t                       # the original stays until its modeled d2h is done
        return self.swap.packed(s, t)

    def unpack(self, x):
        if not isinstance(x, _Packed):
            return x
        s = x.stash
        self.first_need.setdefault(s.group, self.tracker.clock + 1)
        with self.tracker.quiet():
            if s.device is None:
                self._fetch(s)
            return self.swap.view(x)

    def _fetch(self, s) -> None:
        buffers = self.swap.allocate([s])
        # at an op boundary we run inside the tracker's own dispatch, where a mode does not see itself: count the
        # buffer explicitly (a no-op when the tracker saw it allocated)
        self.tracker.track(buffers, "activations", "device")
        self.copies[s.group] = self.tracker.record_of(buffers[0])
        self.swap.copy_in([s], buffers, s.group, now())


def _step(model, batch, tracker: TracingTracker, executor: _Executor) -> dict:
    """One forward + backward of `model` on `batch` under the tracker and the executor's hooks; the gradients."""
    x, y = batch
    model.zero_grad(set_to_none=True)
    tracker.watch(model)
    with saved_tensors_hooks_over(executor.pack, executor.unpack):
        _, loss = model(x, y)
    loss.backward()
    del loss
    with untracked():
        return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _keep_set(model) -> set:
    return {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}


def trace_step(model: torch.nn.Module, batch) -> Trace:
    """Trace one forward + backward of `model` (a GPT: `model(x, y) -> (logits, loss)`) on `batch` = (x, y)."""
    tracker = TracingTracker()
    executor = _Executor(tracker, _keep_set(model))
    with tracker:
        _step(model, batch, tracker, executor)
        tracker.boundary = None
    n = tracker.clock + 1
    by_id = {r.id: r for r in tracker.records}
    for r in tracker.records:
        if r.free == -2:
            r.free = n                                           # still alive when the step ended
    for cid in executor.packs:
        rec = by_id[cid]
        rec.saved, rec.pack, rec.drop = True, executor.first_pack[cid], rec.free
        rec.need = executor.first_need.get(cid, n)
        copy = executor.copies.get(cid)
        rec.release = copy.free if copy is not None else rec.drop    # autograd let go of its device copy then
    copy_ids = {id(c) for c in executor.copies.values()}
    storages = [r for r in tracker.records if r.placement == "device" and id(r) not in copy_ids]
    for r in storages:
        r.swappable = r.saved and r.category not in ("parameters",) and r.drop < r.need - 1
    candidates = [r for r in storages if r.swappable]
    base = np.zeros(n, dtype=np.int64)
    for r in storages:
        if not r.swappable:                                      # as traced; a saved one as if autograd kept it
            end = max(r.free, r.release) if r.saved else r.free
            base[max(r.birth, 0):min(end, n - 1) + 1] += r.nbytes
    keep = base.copy()
    for c in candidates:
        keep[max(c.birth, 0):min(max(c.drop, c.release), n - 1) + 1] += c.nbytes
    psi = sum(p.numel() * p.element_size() for p in model.parameters())
    return Trace(tracker.ops, storages, candidates, base, int(keep.max()), tracker.peak, psi)


# ============================================================================================ plans
@dataclass
class Plan:
    """For each swapped candidate (by trace id): the op after which its device original is let go (`release`: the
    compute waits there for its d2h if that has not finished) and the op before which its prefetch is issued
    (`prefetch`: the compute waits at its first use if the h2d has not finished). drop ≤ release < prefetch < need."""
    release: dict = field(default_factory=dict)       # candidate id -> op index
    prefetch: dict = field(default_factory=dict)      # candidate id -> op index
    name: str = ""

    def swapped(self) -> list:
        return list(self.prefetch)

    def validate(self, trace: Trace) -> None:
        ids = trace.ids()
        named = set(self.prefetch) | set(self.release)
        unknown = sorted(named - ids)
        if unknown:
            known = {s.id for s in trace.storages}
            why = "are not storages of this trace" if any(u not in known for u in unknown) else \
                "are in the trace but cannot be swapped (parameters, or needed again before the forward lets go)"
            more = " …" if len(unknown) > 5 else ""
            raise ValueError(f"swap plan {self.name!r} refers to tensors {unknown[:5]}{more} that {why}; plan only "
                             f"ids from trace.candidates ({len(ids)} of them)")
        if set(self.prefetch) != set(self.release):
            raise ValueError(f"swap plan {self.name!r}: every swapped tensor needs both a release and a prefetch op")
        by_id = {c.id: c for c in trace.candidates}
        for cid, p in self.prefetch.items():
            c, w = by_id[cid], self.release[cid]
            if not c.drop <= w < p < c.need:
                raise ValueError(f"swap plan {self.name!r}: tensor {cid} needs drop ≤ release < prefetch < need, i.e. "
                                 f"{c.drop} ≤ {w} < {p} < {c.need}")


@dataclass
class Outcome:
    """A plan's modeled step: seconds (compute ÷ speedup + stalls), device peak and bytes each way."""
    seconds: float
    stall: float
    peak: int
    memory: np.ndarray = field(repr=False)
    moved: int = 0                  # bytes each way (d2h = h2d)

    def fits(self, budget: int) -> bool:
        return self.peak <= budget


def simulate(trace: Trace, plan: Plan, link: "Link | str" = DEFAULT_LINK, *, speedup: float = 1.0) -> Outcome:
    """Replay the traced ops with `plan` on the modeled link; exact device bytes at every op (see the module).

    Op k runs for its measured time ÷ speedup. A swap-out goes on the d2h lane when the op that saved the tensor
    ends; a prefetch goes on the h2d lane before its op (not before its swap-out is done); each lane carries one
    transfer at a time, α + S·β each. Before op `release + 1` the compute waits for that swap-out, before op `need`
    for that prefetch."""
    link = get_link(link)
    by_id = {c.id: c for c in trace.candidates}
    n = trace.n_ops
    start = trace.starts(speedup)                 # start of op k (k = n: the end) without stalls
    events = []                                   # (op boundary, order there, kind, candidate)
    for cid, p in plan.prefetch.items():
        c = by_id[cid]
        events += [(c.pack + 1, 0, "out", c), (plan.release[cid] + 1, 1, "wait", c), (p, 2, "in", c),
                   (c.need, 3, "need", c)]
    events.sort(key=lambda e: (e[0], e[1]))
    stall, d2h_free, h2d_free = 0.0, 0.0, 0.0
    out_done, in_done = {}, {}
    for k, _, kind, c in events:                  # only the boundaries where something happens
        t = start[min(k, n)] + stall
        if kind == "out":                         # the op that saved it has ended: its d2h joins the lane
            d2h_free = out_done[c.id] = max(t, d2h_free) + link.time(c.nbytes)
        elif kind == "in":                        # not before its d2h is done, one h2d at a time
            h2d_free = in_done[c.id] = max(t, h2d_free, out_done[c.id]) + link.time(c.nbytes)
        else:                                     # wait: its original must be gone; need: its copy must be here
            done = out_done[c.id] if kind == "wait" else in_done[c.id]
            if done > t:
                stall += done - t
    t = start[n] + stall
    diff = np.zeros(n + 1, dtype=np.int64)
    for c in trace.candidates:
        if c.id in plan.prefetch:
            spans = ((c.birth, max(c.drop, plan.release[c.id])), (plan.prefetch[c.id], c.release))
        else:
            spans = ((c.birth, max(c.drop, c.release)),)
        for a, b in spans:
            a, b = max(a, 0), min(b, n - 1)
            if a <= b:
                diff[a] += c.nbytes
                diff[b + 1] -= c.nbytes
    memory = trace.base + np.cumsum(diff[:n])
    return Outcome(float(t), stall, int(memory.max()), memory, sum(by_id[cid].nbytes for cid in plan.prefetch))


def least_memory(trace: Trace) -> Plan:
    """Every candidate swapped, let go as soon as the forward drops it and brought back at the last boundary before
    it is needed: the least memory any plan uses, whatever it costs in stalls."""
    return Plan({c.id: c.drop for c in trace.candidates}, {c.id: c.need - 1 for c in trace.candidates},
                "least memory")


def minimum_budget(trace: Trace) -> int:
    """The least device memory any plan needs: each candidate on the device only while the forward holds it and
    from its first use in backward until autograd lets go, everything else as traced."""
    return simulate(trace, least_memory(trace), _instant_link()).peak


def _instant_link() -> Link:
    """A link that takes no time (for bounds that do not depend on the link)."""
    return Link("instant", 0.0, float("inf"), "a bound, not a link", kind="modeled")


def check_budget(trace: Trace, budget: int) -> None:
    low = minimum_budget(trace)
    if budget < low:
        raise ValueError(f"a device budget of {fmt_bytes(budget)} ({budget:,} B) is below the least this step can "
                         f"run in, {fmt_bytes(low)} ({low:,} B): the parameters ({fmt_bytes(trace.psi_bytes)}), the "
                         f"gradients, the working set of the busiest op and the activations it uses must stay on the "
                         f"device. Give at least {low:,} bytes, or recompute activations / shrink the batch.")


def _after(trace: Trace, k0: int, seconds: float, speedup: float, limit: int) -> int:
    """The first op k ≥ k0 such that ops k0..k take at least `seconds` (÷ speedup), or `limit`."""
    k, acc = k0, 0.0
    while k < limit and acc + trace.ops[k][1] / speedup < seconds:
        acc += trace.ops[k][1] / speedup
        k += 1
    return min(k, limit)


def _before(trace: Trace, k0: int, seconds: float, speedup: float, limit: int) -> int:
    """The last op k ≤ k0 such that ops k..k0−1 take at least `seconds` (÷ speedup), or `limit`."""
    k, acc = k0, 0.0
    while k > limit and acc < seconds:
        k -= 1
        acc += trace.ops[k][1] / speedup
    return max(k, limit)


def _timed(trace: Trace, c: Storage, lag: float, lead: float, speedup: float) -> tuple:
    """(release, prefetch) for c: let the original go once `lag` seconds of compute have run after its save, issue
    the prefetch `lead` seconds of compute before its use — both clamped to its idle window."""
    w = c.drop if lag == 0 else max(c.drop, _after(trace, c.pack + 1, lag, speedup, c.need - 2))
    return w, max(w + 1, min(_before(trace, c.need, lead, speedup, w + 1), c.need - 1))


def no_swap() -> Plan:
    return Plan({}, {}, "no offload")


def swap_all(trace: Trace, link: "Link | str" = DEFAULT_LINK, *, speedup: float = 1.0) -> Plan:
    """Every candidate swapped, each let go and prefetched just late and early enough to hide its own transfer
    (vDNN's 'offload all')."""
    link = get_link(link)
    plan = Plan(name="swap everything")
    for c in trace.candidates:
        plan.release[c.id], plan.prefetch[c.id] = _timed(trace, c, link.time(c.nbytes), link.time(c.nbytes), speedup)
    return plan


def greedy(trace: Trace, budget: int, link: "Link | str" = DEFAULT_LINK, *, speedup: float = 1.0) -> "Plan | None":
    """While the modeled peak is over the budget, swap the largest candidate resident at the peak op that is idle
    there (tie: the longest idle window), timed to hide its own transfer but off the device at that op. None: this
    baseline cannot reach the budget."""
    check_budget(trace, budget)
    link = get_link(link)
    plan = Plan(name="greedy")
    while True:
        o = simulate(trace, plan, link, speedup=speedup)
        if o.peak <= budget:
            return plan
        k = int(np.argmax(o.memory))
        options = [c for c in trace.candidates if c.id not in plan.prefetch and c.drop < k < c.need - 1]
        if not options:
            return None
        c = max(options, key=lambda c: (c.nbytes, c.need - c.drop))
        w, p = _timed(trace, c, link.time(c.nbytes), link.time(c.nbytes), speedup)
        plan.release[c.id], plan.prefetch[c.id] = min(w, k - 1), max(p, k + 1)


def genetic(trace: Trace, budget: int, link: "Link | str" = DEFAULT_LINK, *, speedup: float = 1.0,
            population: int = 32, generations: int = 30, seed: int = 0) -> "Plan | None":
    """A genetic search over plans (SwapAdvisor's method, here on what to swap and when, not on the op order).

    Genome: two genes per candidate c. out ∈ {0 = keep it, 1…6}: let the original go after f·t_c of compute,
    in ∈ {1…6}: prefetch f·t_c of compute ahead, f = 0, ¼, ½, 1, 2, 4 (t_c: its modeled transfer; f = 0: at once
    and at the last moment). Fitness: the modeled step time; plans over the budget rank after every plan within it,
    by how far over. Tournament of 3, uniform crossover, one mutation per genome on average, the two best kept. The
    population starts from the greedy plan, swap-everything, the least-memory plan and no offload, and the result is
    the best of the search and those (exactly), so it is never worse than the baselines and always fits a budget
    ≥ `minimum_budget`.
    """
    check_budget(trace, budget)
    link = get_link(link)
    rng = np.random.default_rng(seed)
    C = trace.candidates
    if not C:
        return no_swap()
    factors = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
    K = len(factors)
    lag = [[_timed(trace, c, f * link.time(c.nbytes), 0.0, speedup)[0] for f in factors] for c in C]
    lead = [[min(_before(trace, c.need, f * link.time(c.nbytes), speedup, c.drop + 1), c.need - 1) for f in factors]
            for c in C]

    def plan_of(genome) -> Plan:
        plan = Plan(name="genetic")
        for i, c in enumerate(C):
            if genome[i]:
                w = lag[i][genome[i] - 1]
                plan.release[c.id], plan.prefetch[c.id] = w, max(lead[i][genome[len(C) + i] - 1], w + 1)
        return plan

    cache: dict = {}

    def fitness(genome) -> tuple:
        key = genome.tobytes()
        if key not in cache:
            o = simulate(trace, plan_of(genome), link, speedup=speedup)
            cache[key] = (o.peak > budget, max(0, o.peak - budget), o.seconds)
        return cache[key]

    def genome_of(plan: "Plan | None"):
        g = np.zeros(2 * len(C), dtype=np.int64)
        g[len(C):] = 1
        if plan is not None:
            for i, c in enumerate(C):
                if c.id in plan.prefetch:
                    g[i] = 1 + min(range(K), key=lambda j: abs(lag[i][j] - plan.release[c.id]))
                    g[len(C) + i] = 1 + min(range(K), key=lambda j: abs(lead[i][j] - plan.prefetch[c.id]))
        return g

    seeds = [p for p in (greedy(trace, budget, link, speedup=speedup), swap_all(trace, link, speedup=speedup),
                         least_memory(trace), no_swap()) if p is not None]
    pop = [genome_of(p) for p in seeds]
    while len(pop) < population:
        keep = rng.random(len(C)) < rng.random()
        pop.append(np.concatenate([rng.integers(1, K + 1, len(C)) * keep, rng.integers(1, K + 1, len(C))]))
    for _ in range(generations):
        ranked = sorted(pop, key=fitness)
        nxt = ranked[:2]
        while len(nxt) < population:
            a, b = (min(rng.choice(len(pop), 3, replace=False), key=lambda i: fitness(pop[i])) for _ in range(2))
            child = np.where(rng.random(2 * len(C)) < 0.5, pop[a], pop[b])
            flip = rng.random(2 * len(C)) < 1.0 / (2 * len(C))
            fresh = np.concatenate([rng.integers(0, K + 1, len(C)), rng.integers(1, K + 1, len(C))])
            nxt.append(np.where(flip, fresh, child))
        pop = nxt
    rank = lambda plan: (lambda o: (o.peak > budget, max(0, o.peak - budget), o.seconds))(  # noqa: E731
        simulate(trace, plan, link, speedup=speedup))
    best = min([plan_of(min(pop, key=fitness))] + seeds, key=rank)      # the seeds exactly, not their nearest genes
    best.name = "genetic"
    return None if rank(best)[0] else best


# ============================================================================================ running a plan
def execute(model: torch.nn.Module, batch, trace: Trace, plan: Plan, budget: "int | None" = None,
            link: "Link | str" = DEFAULT_LINK, *, speedup: float = 1.0) -> dict:
    """Run one forward + backward with `plan` on a simulated accelerator of `budget` bytes (None: unlimited):
    a plan the model says fits must not run out. Returns the gradients, the accountant's device peak and the
    bytes moved each way."""
    plan.validate(trace)
    tracker = TracingTracker(capacity=budget, name="simulated accelerator")
    executor = _Executor(tracker, _keep_set(model), plan)
    with tracker:
        grads = _step(model, batch, tracker, executor)
        tracker.boundary = None
    if [name for name, _ in tracker.ops] != [name for name, _ in trace.ops]:
        raise RuntimeError("the executed step ran other ops than its trace: trace and execute the same model on "
                           "the same batch")
    log = executor.swap.log
    return {"grads": grads, "peak": tracker.peak, "d2h": log.bytes_sent(op="d2h"), "h2d": log.bytes_recv(op="h2d"),
            "report": tracker.report(), "at_op": np.array(tracker.at_op)}


__all__ = ["Storage", "TracingTracker", "Trace", "Plan", "Outcome", "trace_step", "simulate", "minimum_budget",
           "check_budget", "least_memory", "no_swap", "swap_all", "greedy", "genetic", "execute"]
