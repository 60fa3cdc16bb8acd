"""Redundant computation in a pipeline (Bamboo): every stage also holds its successor's layers and runs their
forward for each micro-batch, so that when a stage dies its predecessor takes those layers over — from memory, in
the running processes, without reading a checkpoint and without restarting anyone.

Thorpe et al., "Bamboo: Making Preemptible Instances Resilient for Affordable Training of Large DNNs", NSDI'23; their
implementation is DeepSpeed's pipeline engine with `redundancy_level=1` (uclasystem/bamboo, runtime/pipe/).

    rank        0               1               2               3
    own         stage 0         stage 1         stage 2         stage 3
    replica     stage 1         stage 2         stage 3         —          its layers and their AdamW state
    each F      F0, send, R1    F1, send, R2    F2, send, R3    F3         R: the redundant forward (no grad)

    rank 2 SIGKILLed ──► ranks 1 and 3, waiting for its gradient / activation, see the connection close ──► each
    marks rank 2 dead in the job's store and leaves the process group, which closes its own connections, so every
    rank waiting on it notices in turn ──► the survivors form a new group of 3 ──► rank 1 runs stages 1 + 2 (its
    replica *is* stage 2, AdamW state included) ──► each rank sends its state to its new predecessor (the new
    replicas) ──► the interrupted step runs again, on 3 stages

What this module chooses, each said once:
  * **successor only, no wrap-around.** Bamboo arranges the stages in a ring — the last stage keeps a replica of
    stage 0 (`get_redundant_stage_ids`: (i + 1) mod S). Here rank 0 also serves the job's rendezvous store, whose
    loss ends the job whatever was replicated (`distributed.launch`), so the last stage has no successor and runs no
    redundant forward, and rank 0's death is not survived.
  * **the replica follows by the same update, not by copies.** After its schedule each stage sends its gradients
    (4·ψ_k bytes) to its predecessor, which applies the same AdamW update to its replica — the same arithmetic on
    the same numbers, so the replica stays bit for bit the stage. Bamboo's engine copies the successor's parameters
    and optimizer state instead (`_exec_send_weights`): 12·ψ_k bytes with AdamW.
  * **a step commits everywhere or nowhere.** Before its optimizer step every rank reports in to rank 0, which
    commits the step once all have. A rank lost before it reported in fails the step everywhere: rank 0's receive
    from it fails, rank 0 leaves the group, and the ranks waiting for its word see that. The survivors then all hold
    the state from before the failed step and run it again on the new layout. A rank lost after it reported in
    leaves a committed step, which its replica took too. (Bamboo's engine instead goes on with the interrupted
    iteration on a failover schedule, `NextStageFailoverSchedule`; here the redundant forward's outputs are dropped
    and at most one step is redone.)

Checked against (docs/formulas.md §8.4): the replica's gradients are 4·ψ_{k+1} bytes per step on the ledger, its
state 8 + |packed state| bytes per (re)formation; the final parameters equal an uninterrupted plain pipeline's
(torch.equal: the pipeline computes each micro-batch's gradient the same way on any number of stages); the
redundant forward adds t_f / (t_f + t_b) ≈ 1/3 of a stage's compute (equal stages, t_b ≈ 2·t_f).
"""
from __future__ import annotations

import hashlib
import itertools
import sys

import torch
import torch.distributed as dist

from .. import optim
from ..core.model import GPT, get_config
from ..distributed.comm import Communicator, Ledger
from ..memory import now
from ..parallel.pipeline.executor import Pipeline, plan_pipeline
from ..parallel.pipeline.stage import PipelineStage, split_layers
from ..train import optimizer_kwargs, run
from .membership import Membership, PeerLost, Watched, takeover  # noqa: F401  (re-exported)
from .peer import load_packed, pack
from .state import ResumedBatches, training_state

GRAD_TAG = "bamboo_grads"          # ledger tags: the replica's gradients every step …
COMMIT_TAG = "bamboo_commit"       # … reporting in to rank 0, and its word …
REPLICA_TAG = "bamboo_replica"     # … and the whole state, whenever the pipeline is (re)formed


# ============================================================================================ the executor
class RedundantPipeline(Pipeline):
    """The pipeline executor, plus Bamboo's redundancy: after each forward of its stage (and its send) this rank
    runs the forward of the successor's stage on the same output — the redundant forward, 'kR<mb>' in `records` —
    and after the schedule it trades gradients with its neighbours and reports in to rank 0, which commits the step
    (see the module docstring).
    `optimizer` (for train.run) steps the stage and the replica together."""

    def __init__(self, stage: PipelineStage, comm, plan, membership: Membership, replica: PipelineStage | None,
                 own_opt, replica_opt, *, start: int = 0, hashes: dict | None = None):
        super().__init__(stage, Watched(comm), plan)
        self.membership, self.replica, self.start, self.hashes = membership, replica, start, hashes
        self.optimizer = _Together(own_opt, replica_opt)
        self.committed = 0

    def stage_forward(self, op, x, targets):
        out = super().stage_forward(op, x, targets)
        if self.hashes is not None:
            self.hashes[("F", self.start + self._step, op.stage, op.mb)] = _digest(out)
        return out

    def forward_op(self, op, batches, step: int) -> None:
        super().forward_op(op, batches, step)
        if self.replica is None:
            return
        t0 = now()
        _, out = self._live[(op.stage, op.mb)]
        targets = batches.get(step, op.mb)[1] if op.stage + 1 == self.last else None
        with torch.no_grad():
            rc = self.replica(out.detach(), targets, stage=op.stage + 1)
        if self.hashes is not None:
            self.hashes[("R", self.start + step, op.stage + 1, op.mb)] = _digest(rc)
        self.records.append((step, f"{op.stage + 1}R{op.mb}", t0, now()))

    def sync_replica(self) -> None:
        """Send this stage's gradients to the predecessor; receive the successor's into the replica's .grad."""
        sends = []
        if self.rank > 0:
            flat = torch.cat([p.grad.reshape(-1) for p in self.stage.parameters()])
            sends.append(self.comm.isend(flat, self.rank - 1, tag=GRAD_TAG))
        if self.replica is not None:
            params = list(self.replica.parameters())
            buf = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype)
            self.comm.irecv(buf, self.rank + 1, tag=GRAD_TAG).wait()
            offset = 0
            for p in params:
                p.grad = buf[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        for h in sends:
            h.wait()
        self.comm.release()

    def commit(self) -> None:
        """Every rank reports in to rank 0; rank 0 commits the step once all have, and tells them. Any connection
        lost on the way raises PeerLost: the step did not commit (except for a rank lost after rank 0's word left)."""
        word = torch.ones(1)
        if self.rank == 0:
            reports = [self.comm.irecv(torch.empty(1), src, tag=COMMIT_TAG) for src in range(1, self.comm.world_size)]
            for h in reports:
                h.wait()
            for dst in range(1, self.comm.world_size):
                try:
                    self.comm.isend(word, dst, tag=COMMIT_TAG).wait()
                except PeerLost:             # committed all the same: the next step finds the dead rank
                    pass
        else:
            self.comm.isend(word, 0, tag=COMMIT_TAG).wait()
            self.comm.irecv(torch.empty(1), 0, tag=COMMIT_TAG).wait()
        self.comm.release()

    def __call__(self, model, batches, step: int, phase) -> float:
        self._step = step
        try:
            loss = self.run(batches, step, phase)
            t0 = now()
            with phase("sync"):
                self.sync_replica()
                self.commit()
            self.records.append((step, "sync", t0, now()))
        except PeerLost as e:
            self.failure = {"step": self.start + step, "peer": self.membership.members[e.peer], "caught": now(),
                            "how": str(e)}
            self.membership.fail(e.peer)
            raise
        self.committed += 1
        return loss


class _Together:
    """The stage's optimizer and the replica's, stepped as one (train.run calls step() once the step committed)."""

    def __init__(self, own, replica):
        self.own, self.replica = own, replica
        self.param_groups = own.param_groups

    def step(self) -> None:
        self.own.step()
        if self.replica is not None:
            self.replica.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.own.zero_grad(set_to_none=set_to_none)
        if self.replica is not None:
            self.replica.zero_grad(set_to_none=set_to_none)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().contiguous().numpy().tobytes()).hexdigest()


# ============================================================================================ replicas over the network
def replicate(comm, stage: PipelineStage, opt, replica: PipelineStage | None, replica_opt, step: int) -> int:
    """Every stage sends its whole state (parameters and AdamW state, packed) to its predecessor, which loads it
    into its replica: run whenever the pipeline is formed. Returns the bytes this rank sent."""
    r, sends, sent = comm.rank, [], 0
    if r > 0:
        blob = pack(training_state(stage, opt), step)
        sends += [comm.isend(torch.tensor([len(blob)]), r - 1, tag=REPLICA_TAG),
                  comm.isend(torch.frombuffer(bytearray(blob), dtype=torch.uint8), r - 1, tag=REPLICA_TAG)]
        sent = 8 + len(blob)
    if replica is not None:
        size = torch.zeros(1, dtype=torch.int64)
        comm.irecv(size, r + 1, tag=REPLICA_TAG).wait()
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        comm.irecv(buf, r + 1, tag=REPLICA_TAG).wait()
        load_packed(buf.numpy().tobytes(), replica, replica_opt, f"stage {r + 1}'s state")
    for h in sends:
        h.wait()
    comm.release()
    return sent


# ============================================================================================ no disk, checked
_OPENED: list = []
_WATCHING = [False]
_JOBS = itertools.count()          # every rank calls train_redundant equally often: the same job id everywhere


_MODULES = (".py", ".pyc", ".so")    # a module Python imports on first use is code, not state: not counted


def _audit(event, args):
    if _WATCHING[0] and event == "open" and not str(args[0]).endswith(_MODULES):
        _OPENED.append(str(args[0]))


def _watch_files() -> None:
    if not getattr(_audit, "installed", False):      # an audit hook cannot be removed: install it once per process
        sys.addaudithook(_audit)
        _audit.installed = True


# ============================================================================================ the training worker
def train_redundant(ctx, cfg, tc, *, num_microbatches: int, steps: int, schedule: str = "1f1b", layers=None,
                    kill=None, note=None, timeout: float = 60.0, check: bool = False) -> dict:
    """Train `cfg` as a pipeline over all of launch's ranks with Bamboo's redundancy, for `steps` steps, surviving
    the death of any stage but the first. Run it under `launch(..., allow_deaths=True)`.

    kill: (rank, step) or (rank, step, phase) — that rank SIGKILLs itself when it enters that phase of that step
    ('forward', 'backward' (default), 'sync': the replica's gradients and the commit, 'step': the optimizer step,
    after the commit; `failures.KillAt`). note: a file that receives the time of death. check: hash every stage output
    and every redundant forward's output.
    Returns this rank's parameters (own stage and replica, by name), layouts, records, step times, the recovery
    events with their timings, the files this process opened while it recovered, and its ledger by tag."""
    from .failures import KillAt
    cfg = get_config(cfg)
    if kill is not None and kill[0] == 0:
        raise ValueError("kill rank 0? Its stage has no predecessor holding a replica, and it serves the job's store; "
                         "kill a rank 1 .. world_size − 1")
    _watch_files()
    _OPENED.clear()
    _WATCHING[0] = False
    membership = Membership(dist.distributed_c10d._get_default_store(), ctx.world_size, ctx.rank, timeout,
                            job=next(_JOBS))
    comm, first = ctx.comm, len(ctx.comm.ledger.events)         # this run's traffic: the ledger from here on
    layers = [e - s for s, e in split_layers(cfg.n_layer, ctx.world_size, layers)]
    model = GPT(cfg, seed=tc.seed)               # own and replica blocks live here, in every generation
    batches = None
    done, state = 0, {}
    records, windows, events, layouts, hashes, replicated = [], [], [], [], {} if check else None, []
    event = None
    while True:
        n, r = membership.size, membership.rank
        plan = plan_pipeline(cfg, n, num_microbatches, schedule, layers=layers)
        stage = PipelineStage(model, [r], plan.bounds, n)
        opt = optim.build(stage, **optimizer_kwargs(tc))
        opt.state.update({p: state[p] for p in stage.parameters() if p in state})          # mine, or my replica's
        replica = PipelineStage(model, [r + 1], plan.bounds, n) if r + 1 < n else None
        replica_opt = optim.build(replica, **optimizer_kwargs(tc)) if replica is not None else None
        layouts.append({"members": list(membership.members), "layers": list(layers), "start": done})
        replicated.append(replicate(comm, stage, opt, replica, replica_opt, done))
        if event is not None:
            event["replicated"] = now()
        if batches is None:
            batches = _batches(cfg, tc, num_microbatches)
        pipe = RedundantPipeline(stage, comm, plan, membership, replica, opt, replica_opt, start=done, hashes=hashes)
        probes = [KillAt(*kill[:2], phase=(*kill, "backward")[2], start_step=done, note=note)] \
            if kill is not None and membership.gen == 0 else []
        try:
            result = run(stage, pipe.optimizer, ResumedBatches(batches, done), steps=steps - done, step_fn=pipe,
                         probes=probes)
        except PeerLost:
            _WATCHING[0] = True                  # from here on: which files does this process open?
            result = None
        records += [(membership.gen, done + s, op, t0, t1) for s, op, t0, t1 in pipe.records]
        if result is not None:
            windows += result.windows
            if event is not None:
                event["resumed"] = min(t0 for g, _, _, t0, _ in records if g == membership.gen)
            break
        done += pipe.committed
        event = dict(pipe.failure, gen=membership.gen)
        events.append(event)
        state = {**opt.state, **(replica_opt.state if replica_opt is not None else {})}
        model.zero_grad(set_to_none=True)        # the failed step's partial gradients
        # Leaving the group closes this rank's connections — which is what wakes the ranks waiting on it — only
        # once nothing holds the group any more: out of the except block (its traceback holds the frames that
        # hold the transfers), drop the executor (its posted receives) and the finished transfers. No gc.collect:
        # nothing here is a cycle, and a full collection costs half a second in a process that imported torch.
        pipe = probes = None
        comm.release()
        index = {m: i for i, m in enumerate(membership.members)}
        dead = membership.regroup()
        event["dead"], event["regrouped"] = dead, now()
        layers = takeover(layers, [index[m] for m in dead])
        comm = Communicator(ledger=ctx.comm.ledger)
    own = {k: p.detach().clone() for k, p in stage.named_parameters()}
    rep = {k: p.detach().clone() for k, p in replica.named_parameters()} if replica is not None else {}
    return {"params": own, "replica": rep, "layouts": layouts, "records": records, "windows": windows,
            "events": events, "opened": list(_OPENED), "replicated": replicated, "hashes": hashes,
            "sent": Ledger(ctx.rank, ctx.world_size, ctx.comm.ledger.events[first:]).by("tag"),
            "members": list(membership.members)}


def _batches(cfg, tc, num_microbatches: int):
    """Every stage sees the same micro-batches (one pipeline, no data parallelism)."""
    from ..core.data import ShardedBatches
    if tc.batch_size % num_microbatches:
        raise ValueError(f"global batch {tc.batch_size} does not split into M={num_microbatches} micro-batches")
    return ShardedBatches(cfg.seq_len, tc.batch_size // num_microbatches, num_microbatches=num_microbatches,
                          seed=tc.data_seed)


def predicted_overhead(t_f: float, t_b: float, t_f_next: float | None = None) -> float:
    """The redundant forward's share of a stage's compute: t_f(k+1) / (t_f(k) + t_b(k)) (docs/formulas.md §8.4);
    equal stages with t_b = 2·t_f give 1/3."""
    t_f_next = t_f if t_f_next is None else t_f_next
    if min(t_f, t_b, t_f_next) <= 0:
        raise ValueError("times must be positive")
    return t_f_next / (t_f + t_b)


__all__ = ["RedundantPipeline", "Membership", "Watched", "PeerLost", "takeover", "replicate", "train_redundant",
           "predicted_overhead", "GRAD_TAG", "COMMIT_TAG", "REPLICA_TAG"]
