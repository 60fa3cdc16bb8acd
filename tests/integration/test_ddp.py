"""course_lib.parallel.dp on real gloo ranks: every wrapper (and torch's DistributedDataParallel) against the
single-process reference over 6 steps at world sizes 2, 3 and 4 (cs336's DDP test compares every parameter at every
step; we compare losses every step and every parameter at the end), the ledger's bytes and messages against the
closed forms exactly, models that are not the course GPT (a frozen parameter, tied weights), gradient accumulation
with no_sync, and the errors a learner meets first.

Exact by construction: the runs are in float64. Data parallelism changes only the order in which the same numbers
are added (a mean per rank, then over ranks), so in float64 the trajectories agree to ~1e-12 whatever the seed —
AdamW amplifies a rounding difference δ near its ε by lr·δ/ε, which in float32 can reach 1e-4 for an unlucky seed.

One launch per world size runs every wrapper; the tests read the results, so the file stays fast.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from course_lib import optim
from course_lib.composer.parallelize import train_parallel
from course_lib.core.data import ShardedBatches
from course_lib.core.model import GPT, get_config
from course_lib.distributed.launch import launch
from course_lib.distributed.mesh import data_parallel_batches
from course_lib.parallel import dp as D
from course_lib.train import GradProbe, LedgerProbe, TrainConfig, optimizer_kwargs, run, train_reference

pytestmark = pytest.mark.integration

PRESET = "nano"
STEPS = 6                       # float64 makes every step exact; more steps would only repeat the check
MICRO_BATCH_SIZE = 4
TOL = 1e-9                      # float64: what is left is rounding of ~1e-16 amplified by a few AdamW steps
WORLD_SIZES = (2, 3, 4)
CAP = D.DEFAULT_BUCKET_CAP_BYTES
WRAPPERS = {
    "naive": D.DataParallelNaive,
    "bucket": D.DataParallelBucket,
    "overlap": D.DataParallelOverlap,
    "overlap_backend": functools.partial(D.DataParallelOverlap, algorithm="backend"),
    "torch_ddp": lambda m, comm: DistributedDataParallel(m, bucket_cap_mb=CAP / 2**20),
}


# The seed per world size: SEED = 3 with N = 2 and SEED = 7 with N = 3 are where notebook 03's float32 comparison
# once failed (AdamW near its ε); in float64 every seed must agree, those two included.
SEED_OF = {2: 3, 3: 7}


def _tc(world_size: int, num_microbatches: int = 1, steps: int = STEPS) -> TrainConfig:
    seed = SEED_OF.get(world_size, 0)
    return TrainConfig(steps=steps, batch_size=world_size * MICRO_BATCH_SIZE * num_microbatches, seed=seed,
                       data_seed=seed)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _reference(tc, model=None):
    """The single-process reference in float64 (losses, final parameters)."""
    model = model if model is not None else GPT(PRESET, seed=tc.seed).double()
    ref = train_reference(get_config(PRESET), tc, model=model, progress=False)
    return ref.losses, {k: v.detach().clone() for k, v in ref.model.named_parameters()}


def _train(ctx, wrap, tc, model=None, steps=None):
    """One data-parallel run on this rank with the course's loop: (Run, wrapper)."""
    model = model if model is not None else GPT(PRESET, seed=tc.seed).double()
    tc = TrainConfig(steps=steps or tc.steps, batch_size=tc.batch_size, seed=tc.seed, data_seed=tc.data_seed)
    return train_parallel(ctx.comm, get_config(PRESET), tc, wrap, model=model,
                          probes=[LedgerProbe(ctx.comm), GradProbe()], keep_params=True)


# ---------------------------------------------------------------------------------------- every wrapper, N = 2, 3, 4
def _all_wrappers(ctx):
    out = {}
    for name, wrap in WRAPPERS.items():
        ctx.comm.ledger.reset()
        r, ddp = _train(ctx, wrap, _tc(ctx.world_size))
        L = ctx.comm.ledger
        ours = name != "torch_ddp"
        last = [e for e in L.events if e.t0 >= r.windows[-1][0] and e.t1 <= r.windows[-1][1]]
        out[name] = {"losses": r.losses, "params": r.params, "grads0": r["grads"],
                     "n_buckets": len(ddp.bucket_numels()) if ours else None,
                     "sent": L.bytes_sent(tag=D.GRAD_TAG), "msgs": L.messages(tag=D.GRAD_TAG),
                     "expect_sent": ddp.expected_bytes_sent() if ours else None,
                     "expect_msgs": ddp.expected_messages() if ours else None,
                     "launched": D.packs_before_backward_end(last) if name != "naive" and ours else None}
    return out


@functools.cache
def _runs(world_size: int):
    ref_losses, ref_params = _reference(_tc(world_size))   # also warms AdamW's lazy imports before fork
    return ref_losses, ref_params, launch(_all_wrappers, world_size, timeout=240)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_wrapper_equals_reference_losses_every_step_and_parameters_at_the_end(world_size):
    ref_losses, ref_params, results = _runs(world_size)
    for name in WRAPPERS:
        losses = [sum(r[name]["losses"][s] for r in results) / world_size for s in range(STEPS)]
        worst = max(abs(a - b) for a, b in zip(losses, ref_losses))
        assert worst < TOL, f"{name}: loss differs from the reference by {worst:.2e}"
        for r in results:
            d = _max_diff(r[name]["params"], ref_params)
            assert d < TOL, f"{name}: a parameter differs from the reference by {d:.2e}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_wrapper_hands_the_optimizer_the_single_process_gradient(world_size):
    _, _, results = _runs(world_size)
    tc = _tc(world_size)
    x, y = ShardedBatches(get_config(PRESET).seq_len, tc.batch_size, seed=tc.data_seed).global_batch(0)
    model = GPT(PRESET, seed=tc.seed).double()
    model(x, y)[1].backward()
    ref_grads = {k: p.grad for k, p in model.named_parameters()}
    for name in WRAPPERS:
        for r in results:
            d = _max_diff({k.removeprefix("module."): v for k, v in r[name]["grads0"].items()}, ref_grads)
            assert d < 1e-13, f"{name}: the step-0 gradient differs from one process's by {d:.2e}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_all_reduce_keeps_ranks_bitwise_identical(world_size):
    _, _, results = _runs(world_size)
    for name in ("naive", "bucket", "overlap"):
        for r in results[1:]:
            assert _max_diff(r[name]["params"], results[0][name]["params"]) == 0.0, name


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ledger_gradient_bytes_are_the_ring_closed_form_and_sum_to_2_n_minus_1_psi(world_size):
    """Per rank: Σ over buckets of the ring's exact bytes; summed over ranks: exactly 2(N−1)·Ψ·4 per step."""
    _, _, results = _runs(world_size)
    psi = sum(p.numel() for p in GPT(PRESET).parameters())
    for name in ("naive", "bucket", "overlap"):
        for r in results:
            assert r[name]["sent"] == STEPS * r[name]["expect_sent"], name
        assert sum(r[name]["sent"] for r in results) == STEPS * 2 * (world_size - 1) * psi * 8, name   # float64
    for r in results:   # the backend's entries are nominal: round(2(N−1)/N · S) per bucket
        assert r["overlap_backend"]["sent"] == STEPS * r["overlap_backend"]["expect_sent"]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_messages_per_step_are_2_n_minus_1_per_bucket(world_size):
    _, _, results = _runs(world_size)
    n_tensors = len(list(GPT(PRESET).parameters()))
    for r in results:
        assert r["naive"]["msgs"] == STEPS * 2 * (world_size - 1) * n_tensors
        for name in ("bucket", "overlap"):
            want = STEPS * 2 * (world_size - 1) * r[name]["n_buckets"]
            assert r[name]["msgs"] == want == STEPS * r[name]["expect_msgs"]
        assert r["overlap_backend"]["msgs"] == STEPS * r["overlap_backend"]["n_buckets"]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_overlap_launches_every_bucket_during_backward_and_bucket_launches_none(world_size):
    _, _, results = _runs(world_size)
    for r in results:
        assert r["overlap"]["launched"] == r["overlap"]["n_buckets"] > 1
        assert r["bucket"]["launched"] == 0


# ---------------------------------------------------------------------------------------- message count vs bucket size
def _bucket_sweep(ctx, caps):
    out = []
    for cap in caps:
        ctx.comm.ledger.reset()
        _, ddp = _train(ctx, functools.partial(D.DataParallelOverlap, bucket_cap_bytes=cap), _tc(ctx.world_size),
                        model=GPT(PRESET), steps=1)
        L = ctx.comm.ledger
        out.append((cap, len(ddp.bucket_numels()), L.messages(tag=D.GRAD_TAG), L.bytes_sent(tag=D.GRAD_TAG)))
    return out


def test_message_count_falls_as_bucket_size_grows():
    n, model = 3, GPT(PRESET)
    psi_bytes = 4 * sum(p.numel() for p in model.parameters())
    caps = (1, 4096, 16384, 65536, psi_bytes)
    rows = launch(_bucket_sweep, n, caps, timeout=120)
    sizes = [p.numel() * 4 for p in model.parameters()]
    for i in range(len(caps)):   # the ranks' total never depends on the bucket size (one rank's share does, a little)
        assert sum(rank_rows[i][3] for rank_rows in rows) == 2 * (n - 1) * psi_bytes
    for rank_rows in rows:
        buckets = [row[1] for row in rank_rows]
        assert buckets == sorted(buckets, reverse=True)
        assert buckets[0] == len(sizes) and buckets[-1] == 1             # cap 1 B: one bucket per tensor; cap Ψ: one
        for cap, k, msgs, _ in rank_rows:
            assert msgs == 2 * (n - 1) * k
            # closing at ≥ cap bytes: every bucket but the last holds ≥ cap, and < cap + the largest tensor
            assert -(-psi_bytes // (cap + max(sizes))) <= k <= psi_bytes // cap + 1


# ---------------------------------------------------------------------------------------- any nn.Module
class FrozenNet(nn.Module):
    """Embedding → MLP → vocabulary, with a frozen projection in the middle."""

    def __init__(self, seed: int = 0, d: int = 24, vocab: int = 256):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, d)
        self.frozen = nn.Linear(d, d)
        self.frozen.weight.requires_grad_(False)   # frozen weight, trainable bias
        self.out = nn.Linear(d, vocab)

    def forward(self, x, y=None):
        logits = self.out(F.gelu(self.frozen(self.emb(x))))            # (B, T, V)
        return logits, None if y is None else F.cross_entropy(logits.flatten(0, 1), y.flatten())


class TiedNet(nn.Module):
    """Embedding whose weight is also the output projection (GPT-2's weight tying), plus one hidden layer."""

    def __init__(self, seed: int = 0, d: int = 24, vocab: int = 256):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, d)
        self.hidden = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight                             # tied: one Parameter, used twice

    def forward(self, x, y=None):
        logits = self.head(torch.tanh(self.hidden(self.emb(x))))       # (B, T, V)
        return logits, None if y is None else F.cross_entropy(logits.flatten(0, 1), y.flatten())


NETS = {"frozen": FrozenNet, "tied": TiedNet}


def _any_module(ctx):
    out = {}
    for name, cls in NETS.items():
        for variant in ("naive", "overlap"):
            model = cls(seed=100 + ctx.rank).double()                # different on every rank: broadcast must fix it
            ctx.comm.ledger.reset()
            r, _ = _train(ctx, WRAPPERS[variant], _tc(ctx.world_size), model=model)
            L = ctx.comm.ledger
            out[name, variant] = {"losses": r.losses, "params": r.params, "sent": L.bytes_sent(tag=D.GRAD_TAG),
                                  "bcast": L.bytes_sent(tag=D.BROADCAST_TAG) + L.bytes_recv(tag=D.BROADCAST_TAG)}
    return out


def test_frozen_and_tied_models_equal_reference_and_reduce_each_gradient_once():
    n = 3
    results = launch(_any_module, n, timeout=120)
    for name, cls in NETS.items():
        model = cls(seed=100).double()                                 # rank 0's model is what everyone trains
        frozen_before = {k: v.detach().clone() for k, v in model.named_parameters() if not v.requires_grad}
        trainable = [p for p in model.parameters() if p.requires_grad]   # parameters(): a tied weight once
        psi = sum(p.numel() for p in trainable)
        if name == "tied":
            assert len(list(model.parameters())) == len(list(model.named_parameters())) == 3
        ref_losses, ref_params = _reference(_tc(n), model=model)
        for variant in ("naive", "overlap"):
            losses = [sum(r[name, variant]["losses"][s] for r in results) / n for s in range(STEPS)]
            assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < TOL, (name, variant)
            for r in results:
                assert r[name, variant]["bcast"] > 0
                assert _max_diff(r[name, variant]["params"], ref_params) < TOL
                for k, v in frozen_before.items():
                    assert torch.equal(r[name, variant]["params"][k], v), "a frozen parameter moved"
            # frozen weights are not sent, a tied weight is sent once: the ranks' sum is exactly 2(N−1)·Ψ·8
            assert sum(r[name, variant]["sent"] for r in results) == STEPS * 2 * (n - 1) * psi * 8, (name, variant)


# ---------------------------------------------------------------------------------------- no_sync accumulation
ACCUM = 2


def _accumulate(ctx):
    """K micro-steps per optimizer step with the course's loop: `run` puts all but the last under no_sync()."""
    cfg, n = get_config(PRESET), ctx.world_size
    tc = _tc(n, ACCUM)
    out = {}
    for wrap_name in ("bucket", "overlap"):
        model = GPT(cfg, seed=tc.seed).double()
        ddp = WRAPPERS[wrap_name](model, ctx.comm)
        data = data_parallel_batches(ctx.comm, cfg.seq_len, tc.batch_size, num_microbatches=ACCUM, seed=tc.data_seed)
        ctx.comm.ledger.reset()
        with ddp:                               # every DDP kind is a context manager (overlap: its thread)
            r = run(ddp, optim.build(model, **optimizer_kwargs(tc)), data, steps=STEPS,
                    probes=[LedgerProbe(ctx.comm)], keep_params=True)
        out[wrap_name] = {"losses": r.losses, "params": r.params, "phases": r["ledger"]["phase_bytes"],
                          "expect": ddp.expected_bytes_sent()}
    return out


def test_no_sync_accumulation_equals_reference_and_communicates_once_per_optimizer_step():
    n = 2
    ref_losses, ref_params = _reference(_tc(n, ACCUM))
    results = launch(_accumulate, n, timeout=180)
    for wrap_name in ("bucket", "overlap"):
        losses = [sum(r[wrap_name]["losses"][s] for r in results) / n for s in range(STEPS)]
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < TOL, wrap_name
        for r in results:
            r = r[wrap_name]
            assert _max_diff(r["params"], ref_params) < TOL, wrap_name
            for phases in r["phases"]:      # forward/backward of both micro-steps, then one all-reduce of Ψ
                assert phases["forward"] == 0 and phases["step"] == 0
                sync = phases["sync"] + (phases["backward"] if wrap_name == "overlap" else 0)
                assert sync == r["expect"] and (wrap_name == "overlap" or phases["backward"] == 0)


# ---------------------------------------------------------------------------------------- bad input
def _bad_inputs(ctx):
    errors = {}

    def expect(name, exc, fn):
        try:
            fn()
        except exc as e:
            errors[name] = str(e)
        else:
            errors[name] = None

    expect("not a module", TypeError, lambda: D.DataParallelNaive(lambda x: x, ctx.comm))
    expect("not a communicator", TypeError, lambda: D.DataParallelBucket(GPT(PRESET), object()))
    expect("algorithm", ValueError, lambda: D.DataParallelOverlap(GPT(PRESET), ctx.comm, algorithm="carrier pigeon"))
    for cap in (0, -5, 1.5, True):
        expect(f"cap {cap!r}", ValueError,
               lambda cap=cap: D.DataParallelBucket(GPT(PRESET), ctx.comm, bucket_cap_bytes=cap))
    frozen = GPT(PRESET).requires_grad_(False)
    expect("all frozen", ValueError, lambda: D.DataParallelNaive(frozen, ctx.comm))
    expect("uneven batch", ValueError, lambda: data_parallel_batches(ctx.comm, 8, 5))
    expect("messages for rhd", ValueError, lambda: D.DataParallelNaive(GPT(PRESET), ctx.comm, algorithm="rhd")
           .expected_messages())
    ddp = D.DataParallelOverlap(GPT(PRESET), ctx.comm)               # two backwards without finishing in between
    x = torch.zeros(1, 8, dtype=torch.long)

    def twice():
        ddp(x, x)[1].backward()
        ddp(x, x)[1].backward()
    expect("ready twice", RuntimeError, twice)
    return errors


def test_bad_inputs_raise_readable_errors():
    errors = launch(_bad_inputs, 2, timeout=60)[0]
    missing = [k for k, v in errors.items() if v is None]
    assert not missing, f"no error raised for: {missing}"
    assert "nn.Module" in errors["not a module"]
    assert "Communicator" in errors["not a communicator"]
    assert "carrier pigeon" in errors["algorithm"] and "ring" in errors["algorithm"]
    assert all("bucket_cap_bytes" in errors[f"cap {c!r}"] for c in (0, -5, 1.5, True))
    assert "requires_grad" in errors["all frozen"]
    assert "multiple of 2" in errors["uneven batch"]
    assert "finish_gradient_synchronization" in errors["ready twice"]


def test_wrapping_outside_ranks_says_how_to_get_a_communicator():
    with pytest.raises(TypeError, match="launch"):
        D.DataParallelNaive(GPT(PRESET), None)
