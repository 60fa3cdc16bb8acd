"""Checks for Lab 03 (DDP: gradient accumulation with no_sync, and token-weighted averaging for uneven shards).

Each check runs the learner's code on real gloo ranks around `course_lib.parallel.dp`'s wrappers and compares it with the
single-process reference on the same global batch:

  * the gradient handed to the optimizer at step 0 == the single-process gradient (within 1e-6, fp32);
  * losses and every parameter after `steps` optimizer steps == `train.train_reference` (within 1e-5);
  * the gradient traffic per optimizer step, from the ledger, == ONE ring all-reduce of every bucket — exactly
    Σ_buckets ring_all_reduce_bytes(n, N, r, 4) bytes and 2(N−1) messages per bucket, i.e. 2(N−1)/N·Ψ·4 per rank
    on average (FACTS §2) — however many micro-steps were accumulated.
"""
from __future__ import annotations

from ..parallel import dp as D
from ..data import ShardedBatches
from ..model import GPT, get_config
from ..train import TrainConfig, make_optimizer, train_reference
from . import NOT_IMPLEMENTED, check, run_ranks

TIMEOUT = 120               # seconds per launch: a correct run takes a few; a hang is a bug
GRAD_TOL = 1e-6             # fp32 gradients of the toy model are ~1e-2; summation order moves them ~1e-9
TOL = 1e-5                  # losses and parameters after several AdamW steps
# The checks train with AdamW at lr 1e-3 rather than the course's 3e-3: Adam turns a rounding difference δ in a
# gradient element near its ε (1e-8) into a parameter difference of up to lr·δ/ε, and over 20 steps at 3e-3 some
# world sizes' shards cross 1e-5 that way (measured: up to 2.9e-5) while at 1e-3 all stay below 3e-6.
LR = 1e-3


# ----------------------------------------------------------------------------------------- running learner code
def _run(c, worker, world_size: int, *args):
    return run_ranks(c, worker, world_size, *args, timeout=TIMEOUT,
                     hang_hint="every rank must run the same collectives in the same order; a "
                               "rank that skips finish_gradient_synchronization() leaves the others waiting")


def _capture_first_grads(optimizer, model, store: dict):
    """Keep a copy of every gradient the optimizer sees at its first step."""
    def hook(opt, args, kwargs):
        if not store:
            store.update({k: (p.grad.detach().clone() if p.grad is not None else None)
                          for k, p in model.named_parameters()})
    return optimizer.register_step_pre_hook(hook)


def _reference_grads(cfg, tc: TrainConfig, x, y) -> dict:
    model = GPT(cfg, seed=tc.seed)
    model(x, y)[1].backward()
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() if a[k] is not None else float("inf") for k in b)


def _traffic(ledger, start: int):
    """(bytes, messages) with the gradient tag in ledger events[start:]."""
    ev = ledger.events[start:]
    return sum(e.sent for e in ev if e.tag == D.GRAD_TAG), sum(1 for e in ev if e.tag == D.GRAD_TAG and e.sent)


# ----------------------------------------------------------------------------------------- exercise 1
def _accumulation_worker(ctx, accumulation_step, cfg, tc, micro_batch_size, accum_steps, bucket_cap_bytes):
    model = GPT(cfg, seed=tc.seed)
    ddp = D.DataParallelOverlap(model, ctx.comm, bucket_cap_bytes=bucket_cap_bytes)   # hooks talk during backward
    optimizer = make_optimizer(model.parameters(), tc)
    grads: dict = {}
    _capture_first_grads(optimizer, model, grads)
    data = ShardedBatches(cfg.seq_len, micro_batch_size, ctx.world_size, ctx.rank, accum_steps, seed=tc.data_seed)
    losses, traffic = [], []
    for step in range(tc.steps):
        start = len(ctx.comm.ledger.events)
        try:
            loss = accumulation_step(ddp, optimizer, [data.get(step, m) for m in range(accum_steps)])
        except NotImplementedError:
            return NOT_IMPLEMENTED
        losses.append(float(loss))
        traffic.append(_traffic(ctx.comm.ledger, start))
    ddp.close()
    run = D.DDPRun(losses, {k: v.detach().clone() for k, v in model.named_parameters()}, ctx.comm.ledger, [],
                   ddp.bucket_numels(), ddp.algorithm)
    return {"losses": losses, "params": run.params, "grads": grads, "traffic": traffic,
            "expect": (run.expected_bytes_sent(), run.expected_messages()), "n_buckets": run.n_buckets}


def check_accumulation(accumulation_step, *, world_size: int = 2, preset: str = "nano", micro_batch_size: int = 4,
                       accum_steps: int = 2, steps: int = 6,
                       bucket_cap_bytes: int = D.DEFAULT_BUCKET_CAP_BYTES) -> None:
    """accumulation_step(ddp, optimizer, micro_batches) on DataParallelOverlap == one process on the global batch of
    world_size × micro_batch_size × accum_steps sequences, with one all-reduce per optimizer step."""
    cfg = get_config(preset)
    tc = TrainConfig(steps=steps, batch_size=world_size * micro_batch_size * accum_steps, lr=LR)
    with check("accumulation_gradient") as c:
        c.expect(accum_steps >= 2, f"accum_steps={accum_steps}: accumulation needs at least 2 micro-steps")
        ref = train_reference(cfg, tc, progress=False)
        x, y = ShardedBatches(cfg.seq_len, tc.batch_size, seed=tc.data_seed).global_batch(0)
        ref_grads = _reference_grads(cfg, tc, x, y)
        results = _run(c, _accumulation_worker, world_size, accumulation_step, cfg, tc, micro_batch_size,
                       accum_steps, bucket_cap_bytes)
        for r, res in enumerate(results):
            c.expect(all(g is not None for g in res["grads"].values()),
                     f"rank {r}: some parameters had no gradient at the first optimizer.step()",
                     hint="call backward() on every micro-batch's loss before optimizer.step()")
            d = _max_diff(res["grads"], ref_grads)
            ratio = max(res["grads"][k].norm().item() / max(ref_grads[k].norm().item(), 1e-30) for k in ref_grads)
            c.expect(d < GRAD_TOL,
                     f"rank {r}: the gradient at the first optimizer.step() differs from the single-process gradient "
                     f"of the {tc.batch_size}-sequence global batch by up to {d:.2e} (largest norm ratio {ratio:.3f})",
                     hint=f"a norm ratio near {accum_steps} means the micro-step losses were not divided by "
                          f"accum_steps; 1/{world_size} of it means the gradients were never averaged "
                          f"(finish_gradient_synchronization() after the last backward)")
        c.passed(f"the gradient at step 0 equals one process's gradient on {tc.batch_size} sequences "
                 f"({world_size} ranks × {micro_batch_size} × {accum_steps} micro-steps) within {GRAD_TOL:g}")
    with check("accumulation_traffic") as c:
        for r, res in enumerate(results):
            want_b, want_m = res["expect"]
            for step, (sent, msgs) in enumerate(res["traffic"]):
                c.expect((sent, msgs) == (want_b, want_m),
                         f"rank {r}, step {step}: {sent:,} gradient bytes in {msgs} messages; one all-reduce of "
                         f"every bucket is {want_b:,} B in {want_m} messages"
                         + (f" ({sent / want_b:.0f}× that)" if want_b and sent else ""),
                         hint="run the first accum_steps−1 micro-steps inside `with ddp.no_sync():` (forward AND "
                              "backward), and the last one outside it")
        c.passed(f"{results[0]['expect'][0]:,} B in {results[0]['expect'][1]} messages per optimizer step on rank 0 "
                 f"= one all-reduce of Ψ, not {accum_steps}")
    with check("accumulation_training") as c:
        losses = [sum(res["losses"][s] for res in results) / world_size for s in range(steps)]
        dl = max(abs(a - b) for a, b in zip(losses, ref.losses))
        c.expect(dl < TOL, f"the mean of the ranks' returned losses differs from the reference by up to {dl:.2e}",
                 hint="return the mean of the micro-batches' (unscaled) losses, as a float")
        ref_params = {k: v.detach() for k, v in ref.model.named_parameters()}
        dp = max(_max_diff(res["params"], ref_params) for res in results)
        c.expect(dp < TOL, f"after {steps} steps a parameter differs from the reference by {dp:.2e}",
                 hint="one optimizer.step() and one zero_grad() per call, after the synchronization")
        c.passed(f"losses within {dl:.1e} and parameters within {dp:.1e} of the reference over {steps} steps")


# ----------------------------------------------------------------------------------------- exercise 2
def shard_sizes(world_size: int, base: int = 3) -> list[int]:
    """Uneven shards for the check: rank r holds base + r sequences."""
    return [base + r for r in range(world_size)]


def _weighted_worker(ctx, cls, cfg, tc, sizes, bucket_cap_bytes):
    out = {}
    start_row = sum(sizes[:ctx.rank])
    data = ShardedBatches(cfg.seq_len, sum(sizes), seed=tc.data_seed)
    for name, make in (("yours", cls), ("plain", D.DataParallelBucket)):
        model = GPT(cfg, seed=tc.seed)
        try:
            ddp = make(model, ctx.comm, bucket_cap_bytes=bucket_cap_bytes)
        except NotImplementedError:
            return NOT_IMPLEMENTED
        optimizer = make_optimizer(model.parameters(), tc)
        grads: dict = {}
        _capture_first_grads(optimizer, model, grads)
        losses, traffic = [], []
        for step in range(tc.steps):
            x, y = data.global_batch(step)
            x, y = x[start_row:start_row + sizes[ctx.rank]], y[start_row:start_row + sizes[ctx.rank]]
            start = len(ctx.comm.ledger.events)
            _, loss = ddp(x, y)
            loss.backward()
            if name == "yours":
                ddp.set_local_tokens(x.numel())
            try:
                ddp.finish_gradient_synchronization()
            except NotImplementedError:
                return NOT_IMPLEMENTED
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            traffic.append(_traffic(ctx.comm.ledger, start))
        run = D.DDPRun(losses, {k: v.detach().clone() for k, v in model.named_parameters()}, ctx.comm.ledger, [],
                       ddp.bucket_numels(), ddp.algorithm)
        out[name] = {"losses": losses, "params": run.params, "grads": grads, "traffic": traffic,
                     "expect": (run.expected_bytes_sent(), run.expected_messages())}
    return out


def check_token_weighted(cls, *, world_size: int = 3, preset: str = "nano", steps: int = 6,
                         bucket_cap_bytes: int = D.DEFAULT_BUCKET_CAP_BYTES) -> None:
    """cls(module, comm, bucket_cap_bytes=…) with set_local_tokens(n): ranks holding 3, 4, 5, … sequences train
    exactly like one process on all of them, with the same gradient traffic as DataParallelBucket."""
    cfg = get_config(preset)
    sizes = shard_sizes(world_size)
    tc = TrainConfig(steps=steps, batch_size=sum(sizes), lr=LR)
    with check("token_weighted_gradient") as c:
        c.expect(world_size >= 2, "uneven shards need at least 2 ranks")
        c.expect(isinstance(cls, type) and issubclass(cls, D.DataParallelBucket),
                 f"{cls!r} is not a subclass of course_lib.parallel.dp.DataParallelBucket",
                 hint="class DataParallelTokenWeighted(D.DataParallelBucket): …")
        ref = train_reference(cfg, tc, progress=False)
        x, y = ShardedBatches(cfg.seq_len, tc.batch_size, seed=tc.data_seed).global_batch(0)
        ref_grads = _reference_grads(cfg, tc, x, y)
        results = _run(c, _weighted_worker, world_size, cls, cfg, tc, sizes, bucket_cap_bytes)
        plain = max(_max_diff(res["plain"]["grads"], ref_grads) for res in results)
        for r, res in enumerate(results):
            d = _max_diff(res["yours"]["grads"], ref_grads)
            c.expect(d < GRAD_TOL,
                     f"rank {r} (holding {sizes[r]} of {sum(sizes)} sequences): the synchronized gradient differs "
                     f"from the single-process gradient by up to {d:.2e} (plain averaging: {plain:.2e})",
                     hint="rank r's gradient is the mean over its own tokens: weight it by n_r / Σn (Σn from an "
                          "all-reduce of the token counts) and SUM over ranks instead of averaging")
        c.expect(plain > 100 * GRAD_TOL, f"plain averaging is off by only {plain:.1e}: the shards are not uneven "
                                         f"enough to tell (a bug in the check)")
        c.passed(f"shards of {sizes} sequences: gradient within {GRAD_TOL:g} of one process's "
                 f"(plain averaging is off by {plain:.1e})")
    with check("token_weighted_traffic") as c:
        for r, res in enumerate(results):
            want = res["plain"]["expect"]
            for step, got in enumerate(res["yours"]["traffic"]):
                c.expect(tuple(got) == tuple(want),
                         f"rank {r}, step {step}: {got[0]:,} gradient bytes in {got[1]} messages under the tag "
                         f"{D.GRAD_TAG!r}; the bucketed all-reduce sends {want[0]:,} B in {want[1]} messages",
                         hint=f"reduce each bucket once, with collectives.all_reduce(..., algorithm=self.algorithm, "
                              f"tag=D.GRAD_TAG); the token count may travel under another tag")
        c.passed(f"{results[0]['plain']['expect'][0]:,} B in {results[0]['plain']['expect'][1]} messages per step on "
                 f"rank 0, the same as DataParallelBucket")
    with check("token_weighted_training") as c:
        losses = [sum(res["yours"]["losses"][s] * n for res, n in zip(results, sizes)) / sum(sizes)
                  for s in range(steps)]
        dl = max(abs(a - b) for a, b in zip(losses, ref.losses))
        ref_params = {k: v.detach() for k, v in ref.model.named_parameters()}
        dp = max(_max_diff(res["yours"]["params"], ref_params) for res in results)
        dp_plain = max(_max_diff(res["plain"]["params"], ref_params) for res in results)
        c.expect(dl < TOL and dp < TOL, f"over {steps} steps: losses differ by up to {dl:.2e}, parameters by "
                                        f"{dp:.2e} (tolerance {TOL:g})")
        c.passed(f"losses within {dl:.1e} and parameters within {dp:.1e} of the reference over {steps} steps "
                 f"(plain averaging drifts to {dp_plain:.1e})")


__all__ = ["check_accumulation", "check_token_weighted", "shard_sizes"]
