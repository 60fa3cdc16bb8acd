"""Checks for Lab 03 (DDP: gradient accumulation with no_sync, and token-weighted averaging for uneven shards).

Each check runs the learner's code on real gloo ranks with the course's one training loop (`train.run`), around
`course_lib.parallel.dp`'s wrappers, and compares it with the single-process reference on the same global batch.

Exact by construction: every run is in float64. Data parallelism only changes the order in which the same numbers
are added, so in float64 the trajectories agree to ~1e-12 whatever the seed and the world size; in float32, AdamW
turns a rounding difference δ in a gradient element near its ε into a parameter difference of up to lr·δ/ε, which
reaches 1e-4 for unlucky seeds (notebook 03, "Why float64"). A real mistake — a factor K or N, a missing weight —
is off by far more than any tolerance below, and each check measures the quantity that names it:

  accumulation   synchronizations per optimizer step (exactly one) and where it starts (the hooks of the last
                 micro-step's backward hand every bucket to communication); the gradient bytes and messages per
                 optimizer step from the ledger (one ring all-reduce of every bucket, docs/formulas.md §2.3); the
                 gradient handed to the optimizer at step 0 against one process's (and the ratio of the two when
                 it is off by a factor); losses and every parameter after `steps` steps
  token-weighted the synchronized gradient against one process's on all the tokens, against plain averaging, and
                 the ratio to it; the gradient traffic against DataParallelBucket's; losses and parameters
"""
from __future__ import annotations

import torch

from .. import optim
from ..core.data import ShardedBatches
from ..core.model import GPT, get_config
from ..distributed.mesh import data_parallel_batches
from ..parallel import dp as D
from ..train import GradProbe, Probe, TrainConfig, optimizer_kwargs, run, train_reference
from . import NOT_IMPLEMENTED, check, run_ranks

TIMEOUT = 120               # seconds per launch: a correct run takes a few; a hang is a bug
DTYPE = torch.float64       # see the module docstring
GRAD_TOL = 1e-12            # step-0 gradients (elements up to ~1): float64 summation order moves them ~1e-17
TOL = 1e-9                  # losses and parameters after a few AdamW steps in float64


# ----------------------------------------------------------------------------------------- shared pieces
def _run(c, worker, world_size: int, *args):
    return run_ranks(c, worker, world_size, *args, timeout=TIMEOUT,
                     hang_hint="every rank must run the same collectives in the same order; a rank that skips "
                               "finish_gradient_synchronization() leaves the others waiting")


class _GradTraffic(Probe):
    """Per optimizer step: (bytes, messages) this rank sent under the gradient tag D.GRAD_TAG."""
    name = "grad_traffic"

    def __init__(self, comm):
        self.comm, self.per_step, self._last = comm, [], (0, 0)

    def _now(self):
        L = self.comm.ledger
        return L.bytes_sent(tag=D.GRAD_TAG), L.messages(tag=D.GRAD_TAG)

    def start(self, model, optimizer):
        self._last = self._now()

    def after_step(self, step):
        now = self._now()
        self.per_step.append((now[0] - self._last[0], now[1] - self._last[1]))
        self._last = now

    def finish(self):
        return self.per_step


def _reference(cfg, tc: TrainConfig):
    """The single-process reference in float64: losses, final parameters, and the gradient of step 0."""
    ref = train_reference(cfg, tc, model=GPT(cfg, seed=tc.seed).to(DTYPE), progress=False)
    model = GPT(cfg, seed=tc.seed).to(DTYPE)
    x, y = ShardedBatches(cfg.seq_len, tc.batch_size, seed=tc.data_seed).global_batch(0)
    model(x, y)[1].backward()
    return (ref.losses, {k: v.detach().clone() for k, v in ref.model.named_parameters()},
            {k: p.grad.detach().clone() for k, p in model.named_parameters()})


def _unprefixed(grads: dict) -> dict:
    """GradProbe names a wrapper's parameters 'module.…': the wrapped model's names, as the reference has them."""
    return {k.removeprefix("module."): v for k, v in grads.items()}


def _max_diff(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).abs().max().item() if a.get(k) is not None else float("inf")) for k in b)


def _ratio(a: dict, b: dict) -> float:
    """The scale s that best maps b onto a (least squares over every element): ~1 when a equals b, K when a = K·b."""
    num = sum((a[k] * b[k]).sum().item() for k in b if a.get(k) is not None)
    den = sum((b[k] * b[k]).sum().item() for k in b)
    return num / den if den else float("nan")


def _near(x: float, target: float, rel: float = 1e-3) -> bool:
    return abs(x - target) <= rel * abs(target)


# ----------------------------------------------------------------------------------------- exercise 1
class _CountingOverlap(D.DataParallelOverlap):
    """DataParallelOverlap that counts, per optimizer step, how often it synchronized and who launched each bucket:
    a gradient hook during backward (overlapped) or finish_gradient_synchronization() after it."""

    def __init__(self, module, comm, **kw):
        super().__init__(module, comm, **kw)
        self.syncs = self.from_hooks = self.from_finish = 0
        self._in_hook = False

    def _on_grad_ready(self, p):
        self._in_hook = True
        try:
            super()._on_grad_ready(p)
        finally:
            self._in_hook = False

    def _launch(self, bucket):
        if self._in_hook:
            self.from_hooks += 1
        else:
            self.from_finish += 1
        super()._launch(bucket)

    def finish_gradient_synchronization(self):
        if self.require_backward_grad_sync:
            self.syncs += 1
        super().finish_gradient_synchronization()


class _SyncProbe(Probe):
    """Per optimizer step: (synchronizations, buckets launched by hooks, buckets launched by finish)."""
    name = "syncs"

    def __init__(self, ddp):
        self.ddp, self.per_step = ddp, []

    def after_step(self, step):
        d = self.ddp
        self.per_step.append((d.syncs, d.from_hooks, d.from_finish))
        d.syncs = d.from_hooks = d.from_finish = 0

    def finish(self):
        return self.per_step


def _accumulation_worker(ctx, accumulation_step, cfg, tc, num_microbatches, bucket_cap_bytes):
    model = GPT(cfg, seed=tc.seed).to(DTYPE)
    ddp = _CountingOverlap(model, ctx.comm, bucket_cap_bytes=bucket_cap_bytes)   # hooks talk during backward
    optimizer = optim.build(model, **optimizer_kwargs(tc))
    batches = data_parallel_batches(ctx.comm, cfg.seq_len, tc.batch_size, num_microbatches=num_microbatches,
                                    seed=tc.data_seed)
    probes = [_SyncProbe(ddp), _GradTraffic(ctx.comm), GradProbe(at_step=0)]
    out = {"n_buckets": len(ddp.buckets), "expect": (ddp.expected_bytes_sent(), ddp.expected_messages()),
           "error": None}
    try:
        r = run(ddp, optimizer, batches, steps=tc.steps, probes=probes, step_fn=accumulation_step, keep_params=True)
        out.update(losses=r.losses, params=r.params, grads=_unprefixed(r["grads"]), syncs=r["syncs"],
                   traffic=r["grad_traffic"])
    except NotImplementedError:
        return NOT_IMPLEMENTED
    except Exception as e:          # keep what the probes saw: it usually names the cause better than the error
        out.update(error=f"{type(e).__name__}: {e}", syncs=probes[0].per_step, traffic=probes[1].per_step)
    finally:
        ddp.close()
    return out


def check_accumulation(accumulation_step, *, world_size: int = 2, preset: str = "nano", micro_batch_size: int = 4,
                       num_microbatches: int = 2, steps: int = 6, seed: int = 0,
                       bucket_cap_bytes: int = D.DEFAULT_BUCKET_CAP_BYTES) -> None:
    """`accumulation_step(model, batches, step, phase)` as the step function of `train.run`, around an overlapped
    DDP wrapper, == one process on the global batch of world_size × micro_batch_size × num_microbatches sequences, with
    exactly one synchronization per optimizer step, started by the last micro-step's backward."""
    cfg = get_config(preset)
    tc = TrainConfig(steps=steps, batch_size=world_size * micro_batch_size * num_microbatches, seed=seed,
                     data_seed=seed)
    K = num_microbatches
    with check("accumulation_sync") as c:
        c.expect(K >= 2, f"num_microbatches={K}: accumulation needs at least 2 micro-steps",
                 hint="pass num_microbatches >= 2 (ACCUM_STEPS in the parameters cell)")
        results = _run(c, _accumulation_worker, world_size, accumulation_step, cfg, tc, K, bucket_cap_bytes)
        for r, res in enumerate(results):
            n = res["n_buckets"]
            want_b, want_m = res["expect"]
            for step, ((syncs, hooks, finish), (sent, msgs)) in enumerate(zip(res["syncs"], res["traffic"])):
                where = f"rank {r}, optimizer step {step}"
                c.expect(syncs > 0, f"{where}: the gradients were never synchronized "
                                    f"(finish_gradient_synchronization() was not called outside no_sync())",
                         hint="after the last micro-step's backward, call model.finish_gradient_synchronization() "
                              "— outside no_sync(), or it returns without doing anything")
                c.expect(syncs == 1, f"{where}: {syncs} gradient synchronizations in one optimizer step of {K} "
                                     f"micro-steps ({sent:,} B in {msgs} messages; one all-reduce is {want_b:,} B in "
                                     f"{want_m})",
                         hint="run micro-steps 0..K−2 — forward AND backward — inside `with model.no_sync():` and "
                              "synchronize once, after the last one")
                c.expect(hooks == n, f"{where}: {finish} of the {n} buckets were launched by "
                                     f"finish_gradient_synchronization() after backward, {hooks} by the gradient "
                                     f"hooks during backward" + (": the last micro-step ran inside no_sync()"
                                                                 if hooks == 0 else ""),
                         hint="only micro-steps 0..K−2 go inside no_sync(); the last micro-step's backward must run "
                              "outside it, so that each bucket's all-reduce starts while backward is still "
                              "computing earlier layers (the overlap this wrapper exists for)")
                c.expect((sent, msgs) == (want_b, want_m),
                         f"{where}: {sent:,} gradient bytes in {msgs} messages; one all-reduce of every bucket is "
                         f"{want_b:,} B in {want_m} messages",
                         hint="synchronize through the wrapper only (no extra all-reduce of the gradients)")
        first_error = next((res["error"] for res in results if res["error"]), None)
        c.expect(first_error is None, f"your step function raised {first_error}",
                 hint="micro-steps 0..K−2 inside `with model.no_sync():`; the overlapped wrapper refuses a second "
                      "synchronized backward before finish_gradient_synchronization()"
                 if first_error and "ready twice" in first_error else "")
        c.expect(all(len(res["syncs"]) == steps for res in results),
                 f"the run stopped after {min(len(res['syncs']) for res in results)} of {steps} optimizer steps")
        c.passed(f"one synchronization per optimizer step of {K} micro-steps, every one of the "
                 f"{results[0]['n_buckets']} buckets launched during the last backward; "
                 f"{results[0]['expect'][0]:,} B in {results[0]['expect'][1]} messages on rank 0 = one all-reduce "
                 f"of Ψ, not {K}")
    with check("accumulation_gradient") as c:
        ref_losses, ref_params, ref_grads = _reference(cfg, tc)
        for r, res in enumerate(results):
            missing = [k for k in ref_grads if res["grads"].get(k) is None]
            c.expect(not missing, f"rank {r}: {len(missing)} parameters (e.g. {missing[:1]}) had no gradient at the "
                                  f"first optimizer.step()",
                     hint="backward() every micro-batch's loss and synchronize before the step function returns")
            d, s = _max_diff(res["grads"], ref_grads), _ratio(res["grads"], ref_grads)
            hint = (f"your gradient is {s:.3f}× the reference's, i.e. K = {K} times too large: backpropagate "
                    f"loss / num_microbatches, so the K accumulated gradients sum to the mean" if _near(s, K) else
                    f"your gradient is {s:.3f}× the reference's, i.e. divided by K = {K} twice" if _near(s, 1 / K) else
                    f"your gradient is {s:.3f}× the reference's (closest scale): every micro-batch must be "
                    f"backpropagated once, scaled by 1/num_microbatches, between the same zero_grad() and step()")
            c.expect(d < GRAD_TOL, f"rank {r}: the gradient at the first optimizer.step() differs from one "
                                   f"process's gradient on the {tc.batch_size}-sequence global batch by up to {d:.2e}",
                     hint=hint)
        c.passed(f"the gradient at step 0 equals one process's on {tc.batch_size} sequences ({world_size} ranks × "
                 f"{micro_batch_size} × {K} micro-steps) within {GRAD_TOL:g} (float64)")
    with check("accumulation_training") as c:
        losses = [sum(res["losses"][s] for res in results) / world_size for s in range(steps)]
        dl = max(abs(a - b) for a, b in zip(losses, ref_losses))
        worst = max(range(steps), key=lambda s: abs(losses[s] - ref_losses[s]))
        c.expect(dl < TOL, f"at step {worst} the mean of the ranks' returned losses is {losses[worst]:.6f}, the "
                           f"reference's {ref_losses[worst]:.6f}",
                 hint=f"return the mean of the {K} unscaled micro-batch losses, as a float"
                 if _near(losses[worst], K * ref_losses[worst], 1e-2) else
                 "return the mean of the K unscaled micro-batch losses (loss.item(), before dividing by K), as a float")
        dp = max(_max_diff(res["params"], ref_params) for res in results)
        c.expect(dp < TOL, f"after {steps} steps a parameter differs from the reference by {dp:.2e}",
                 hint="the step function runs forward/backward and the synchronization only: train.run takes the "
                      "optimizer step and zeroes the gradients")
        c.passed(f"losses within {dl:.1e} and parameters within {dp:.1e} of the reference over {steps} steps")


# ----------------------------------------------------------------------------------------- exercise 2
def shard_sizes(world_size: int, base: int = 2) -> list[int]:
    """Uneven shards for the check: rank r holds base + r sequences."""
    return [base + r for r in range(world_size)]


class UnevenBatches:
    """Rank `rank`'s rows of each global batch when rank r holds sizes[r] sequences (for `train.run`)."""

    def __init__(self, seq_len: int, sizes, rank: int, seed: int = 0):
        self.sizes, self.rank, self.seq_len = list(sizes), rank, seq_len
        self.num_microbatches, self.micro_batch_size = 1, self.sizes[rank]
        self.start = sum(self.sizes[:rank])
        self.data = ShardedBatches(seq_len, sum(self.sizes), seed=seed)

    def get(self, step: int, micro: int = 0):
        x, y = self.data.global_batch(step)
        rows = slice(self.start, self.start + self.sizes[self.rank])
        return x[rows], y[rows]                                   # (sizes[rank], seq_len) each


def _weighted_worker(ctx, cls, cfg, tc, sizes, bucket_cap_bytes):
    out = {}
    batches = UnevenBatches(cfg.seq_len, sizes, ctx.rank, seed=tc.data_seed)
    for name, make in (("yours", cls), ("plain", D.DataParallelBucket)):
        model = GPT(cfg, seed=tc.seed).to(DTYPE)
        try:
            ddp = make(model, ctx.comm, bucket_cap_bytes=bucket_cap_bytes)
            r = run(ddp, optim.build(model, **optimizer_kwargs(tc)), batches, steps=tc.steps,
                    probes=[_GradTraffic(ctx.comm), GradProbe(at_step=0)], keep_params=True)
        except NotImplementedError:
            return NOT_IMPLEMENTED
        out[name] = {"losses": r.losses, "params": r.params, "grads": _unprefixed(r["grads"]),
                     "traffic": r["grad_traffic"],
                     "expect": (ddp.expected_bytes_sent(), ddp.expected_messages())}
    return out


def check_token_weighted(cls, *, world_size: int = 3, preset: str = "nano", steps: int = 6, seed: int = 0,
                         bucket_cap_bytes: int = D.DEFAULT_BUCKET_CAP_BYTES) -> None:
    """cls(module, comm, bucket_cap_bytes=…), a DataParallelBucket whose forward records the local token count:
    ranks holding 2, 3, 4, … sequences train exactly like one process on all of them, with the same gradient
    traffic as DataParallelBucket."""
    cfg = get_config(preset)
    sizes = shard_sizes(world_size)
    tc = TrainConfig(steps=steps, batch_size=sum(sizes), seed=seed, data_seed=seed)
    with check("token_weighted_gradient") as c:
        c.expect(world_size >= 2, f"world_size={world_size}: uneven shards need at least 2 ranks",
                 hint="pass world_size >= 2")
        c.expect(isinstance(cls, type) and issubclass(cls, D.DataParallelBucket),
                 f"{cls!r} is not a subclass of course_lib.parallel.dp.DataParallelBucket",
                 hint="class DataParallelTokenWeighted(D.DataParallelBucket): …")
        results = _run(c, _weighted_worker, world_size, cls, cfg, tc, sizes, bucket_cap_bytes)
        ref_losses, ref_params, ref_grads = _reference(cfg, tc)
        plain = max(_max_diff(res["plain"]["grads"], ref_grads) for res in results)
        c.expect(plain > 1e6 * GRAD_TOL, f"plain averaging is off by only {plain:.1e}: the shards are not uneven "
                                         f"enough to tell (a bug in the check)")
        for r, res in enumerate(results):
            mine = res["yours"]["grads"]
            d, s = _max_diff(mine, ref_grads), _ratio(mine, ref_grads)
            same_as_plain = _max_diff(mine, res["plain"]["grads"]) < GRAD_TOL
            hint = ("your gradient is exactly plain averaging's: the weights n_r / n never reached it (scale each "
                    "packed bucket by n_r / n in reduce_bucket)" if same_as_plain else
                    f"your gradient is {s:.3f}× the reference's, i.e. 1/{world_size} of it: after weighting by "
                    f"n_r / n the ranks' shares must be SUMMED (op 'sum'), not averaged" if _near(s, 1 / world_size)
                    else f"your gradient is {s:.3f}× the reference's, i.e. {world_size}× too large: the weight is "
                    f"n_r / n with n the GLOBAL token count (all-reduce the local counts first)"
                    if _near(s, world_size, 0.2) else
                    "rank r's gradient is a mean over its own n_r tokens: weight it by n_r / n (n = Σ n_r from an "
                    "all-reduce of the token counts) and sum over ranks")
            c.expect(d < GRAD_TOL,
                     f"rank {r} (holding {sizes[r]} of {sum(sizes)} sequences): the synchronized gradient differs "
                     f"from the single-process gradient by up to {d:.2e} (plain averaging: {plain:.2e})", hint=hint)
        c.passed(f"shards of {sizes} sequences: gradient within {GRAD_TOL:g} of one process's "
                 f"(plain averaging is off by {plain:.1e})")
    with check("token_weighted_traffic") as c:
        for r, res in enumerate(results):
            want = res["plain"]["expect"]
            for step, got in enumerate(res["yours"]["traffic"]):
                c.expect(tuple(got) == tuple(want),
                         f"rank {r}, step {step}: {got[0]:,} gradient bytes in {got[1]} messages under the tag "
                         f"{D.GRAD_TAG!r}; the bucketed all-reduce sends {want[0]:,} B in {want[1]} messages",
                         hint="reduce each bucket once, with collectives.all_reduce(..., algorithm=self.algorithm, "
                              "tag=D.GRAD_TAG); the token count must travel under another tag")
        c.passed(f"{results[0]['plain']['expect'][0]:,} B in {results[0]['plain']['expect'][1]} messages per step on "
                 f"rank 0, the same as DataParallelBucket")
    with check("token_weighted_training") as c:
        losses = [sum(res["yours"]["losses"][s] * n for res, n in zip(results, sizes)) / sum(sizes)
                  for s in range(steps)]
        dl = max(abs(a - b) for a, b in zip(losses, ref_losses))
        dp = max(_max_diff(res["yours"]["params"], ref_params) for res in results)
        dp_plain = max(_max_diff(res["plain"]["params"], ref_params) for res in results)
        c.expect(dl < TOL and dp < TOL, f"over {steps} steps: losses differ by up to {dl:.2e}, parameters by "
                                        f"{dp:.2e} (tolerance {TOL:g})",
                 hint="every step must weight by that step's token counts (the forward records them each step)")
        c.passed(f"losses within {dl:.1e} and parameters within {dp:.1e} of the reference over {steps} steps "
                 f"(plain averaging drifts to {dp_plain:.1e})")


__all__ = ["check_accumulation", "check_token_weighted", "shard_sizes", "UnevenBatches"]
