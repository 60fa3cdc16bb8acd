"""course_lib.parallel.dp on real gloo ranks: every wrapper (and torch's DistributedDataParallel) against the single-process
reference over 20 steps at world sizes 2, 3 and 4 (cs336's DDP test compares every parameter at every step; we
compare losses every step and every parameter at the end, within 1e-5 in fp32), the ledger's bytes and messages
against the closed forms exactly, models that are not the course GPT (a frozen parameter, tied weights),
gradient accumulation with no_sync, and the errors a learner meets first.

One launch per world size runs every wrapper; the tests read the results, so the file stays fast.
"""
from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from course_lib.parallel import dp as D
from course_lib.data import ShardedBatches
from course_lib.dist.launch import launch
from course_lib.model import GPT, get_config
from course_lib.train import TrainConfig, make_optimizer, train_reference

pytestmark = pytest.mark.integration

PRESET = "nano"
STEPS = 20
MICRO_BATCH_SIZE = 4
TOL = 1e-5
WORLD_SIZES = (2, 3, 4)
CAP = D.DEFAULT_BUCKET_CAP_BYTES
WRAPPERS = {
    "naive": D.DataParallelNaive,
    "bucket": D.DataParallelBucket,
    "overlap": D.DataParallelOverlap,
    "overlap_backend": functools.partial(D.DataParallelOverlap, algorithm="backend"),
    "torch_ddp": lambda m, comm: DistributedDataParallel(m, bucket_cap_mb=CAP / 2**20),
}


# lr 1e-3, not the course's 3e-3: AdamW turns a rounding difference δ in a gradient element near its ε (1e-8) into a
# parameter difference of up to lr·δ/ε, and at 3e-3 some seeds and batch sizes cross 1e-5 that way within 20 steps
# (notebook 03 explains it); at 1e-3 the margin to TOL is about 10× for these shapes.
LR = 1e-3


def _tc(world_size: int, accum_steps: int = 1, steps: int = STEPS) -> TrainConfig:
    return TrainConfig(steps=steps, batch_size=world_size * MICRO_BATCH_SIZE * accum_steps, lr=LR)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ---------------------------------------------------------------------------------------- every wrapper, N = 2, 3, 4
def _all_wrappers(ctx):
    out = {}
    for name, wrap in WRAPPERS.items():
        ctx.comm.ledger.reset()
        run = D.run_data_parallel(ctx, wrap, PRESET, _tc(ctx.world_size))
        ours = name != "torch_ddp"
        out[name] = {"losses": run.losses, "params": run.params, "n_buckets": run.n_buckets, "grads0": run.first_grads,
                     "sent": run.ledger.bytes_sent(tag=D.GRAD_TAG), "msgs": run.ledger.messages(tag=D.GRAD_TAG),
                     "expect_sent": run.expected_bytes_sent() if ours else None,
                     "expect_msgs": run.expected_messages() if ours else None,
                     "launched": run.buckets_launched_during_backward(STEPS - 1) if name != "naive" and ours else None}
    return out


@functools.lru_cache(maxsize=None)
def _runs(world_size: int):
    ref = train_reference(PRESET, _tc(world_size), progress=False)   # also warms AdamW's lazy imports before fork
    ref_params = {k: v.detach().clone() for k, v in ref.model.named_parameters()}
    return ref.losses, ref_params, launch(_all_wrappers, world_size, timeout=240)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_wrapper_equals_reference_losses_and_parameters_over_20_steps(world_size):
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
    x, y = ShardedBatches(get_config(PRESET).seq_len, world_size * MICRO_BATCH_SIZE).global_batch(0)
    model = GPT(PRESET)
    model(x, y)[1].backward()
    ref_grads = {k: p.grad for k, p in model.named_parameters()}
    for name in WRAPPERS:
        for r in results:
            d = _max_diff(r[name]["grads0"], ref_grads)
            assert d < 1e-6, f"{name}: the step-0 gradient differs from one process's by {d:.2e}"


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
        assert sum(r[name]["sent"] for r in results) == STEPS * 2 * (world_size - 1) * psi * 4, name
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
        run = D.run_data_parallel(ctx, functools.partial(D.DataParallelOverlap, bucket_cap_bytes=cap), PRESET,
                                  _tc(ctx.world_size, steps=1))
        out.append((cap, run.n_buckets, run.ledger.messages(tag=D.GRAD_TAG), run.ledger.bytes_sent(tag=D.GRAD_TAG)))
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
            model = cls(seed=100 + ctx.rank)                          # different on every rank: broadcast must fix it
            ctx.comm.ledger.reset()
            run = D.run_data_parallel(ctx, WRAPPERS[variant], PRESET, _tc(ctx.world_size), model=model)
            out[name, variant] = {"losses": run.losses, "params": run.params,
                                  "sent": run.ledger.bytes_sent(tag=D.GRAD_TAG),
                                  "bcast": run.ledger.bytes_sent(tag=D.BROADCAST_TAG)
                                  + run.ledger.bytes_recv(tag=D.BROADCAST_TAG)}
    return out


def test_frozen_and_tied_models_equal_reference_and_reduce_each_gradient_once():
    n = 3
    results = launch(_any_module, n, timeout=120)
    cfg = get_config(PRESET)
    for name, cls in NETS.items():
        model = cls(seed=100)                                          # rank 0's model is what everyone trains
        frozen_before = {k: v.detach().clone() for k, v in model.named_parameters() if not v.requires_grad}
        ref = train_reference(cfg, _tc(n), model=model, progress=False)
        ref_params = dict(ref.model.named_parameters())
        trainable = [p for p in model.parameters() if p.requires_grad]   # parameters(): a tied weight once
        psi = sum(p.numel() for p in trainable)
        if name == "tied":
            assert len(list(model.parameters())) == len(list(model.named_parameters())) == 3
        for variant in ("naive", "overlap"):
            losses = [sum(r[name, variant]["losses"][s] for r in results) / n for s in range(STEPS)]
            assert max(abs(a - b) for a, b in zip(losses, ref.losses)) < TOL, (name, variant)
            for r in results:
                assert r[name, variant]["bcast"] > 0
                assert _max_diff(r[name, variant]["params"], {k: v.detach() for k, v in ref_params.items()}) < TOL
                for k, v in frozen_before.items():
                    assert torch.equal(r[name, variant]["params"][k], v), "a frozen parameter moved"
            # frozen weights are not sent, a tied weight is sent once: the ranks' sum is exactly 2(N−1)·Ψ·4
            assert sum(r[name, variant]["sent"] for r in results) == STEPS * 2 * (n - 1) * psi * 4, (name, variant)


# ---------------------------------------------------------------------------------------- no_sync accumulation
ACCUM = 2


def _accumulate(ctx):
    cfg, n = get_config(PRESET), ctx.world_size
    out = {}
    for wrap_name in ("bucket", "overlap"):
        model = GPT(cfg)
        ddp = WRAPPERS[wrap_name](model, ctx.comm)
        opt = make_optimizer(model.parameters(), _tc(n, ACCUM))
        data = ShardedBatches(cfg.seq_len, MICRO_BATCH_SIZE, n, ctx.rank, accum_steps=ACCUM)
        ctx.comm.ledger.reset()
        losses, sent_after_micro = [], []
        for step in range(STEPS):
            total = 0.0
            for micro in range(ACCUM):
                with ddp.no_sync() if micro < ACCUM - 1 else contextlib.nullcontext():
                    _, loss = ddp(*data.get(step, micro))
                    (loss / ACCUM).backward()
                    ddp.finish_gradient_synchronization()              # a no-op inside no_sync
                total += loss.item() / ACCUM
                sent_after_micro.append(ctx.comm.ledger.bytes_sent(tag=D.GRAD_TAG))
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(total)
        if hasattr(ddp, "close"):
            ddp.close()
        out[wrap_name] = {"losses": losses, "params": {k: v.detach() for k, v in model.named_parameters()},
                          "sent": sent_after_micro, "expect": ddp.expected_bytes_sent()}
    return out


def test_no_sync_accumulation_equals_reference_and_communicates_once_per_optimizer_step():
    n = 2
    ref = train_reference(PRESET, _tc(n, ACCUM), progress=False)
    ref_params = {k: v.detach() for k, v in ref.model.named_parameters()}
    results = launch(_accumulate, n, timeout=180)
    for wrap_name in ("bucket", "overlap"):
        losses = [sum(r[wrap_name]["losses"][s] for r in results) / n for s in range(STEPS)]
        assert max(abs(a - b) for a, b in zip(losses, ref.losses)) < TOL, wrap_name
        for r in results:
            r = r[wrap_name]
            assert _max_diff(r["params"], ref_params) < TOL, wrap_name
            sent = r["sent"]                                           # cumulative bytes after every micro-step
            for step in range(STEPS):
                before = sent[step * ACCUM - 1] if step else 0
                assert sent[step * ACCUM: step * ACCUM + ACCUM - 1] == [before] * (ACCUM - 1)   # nothing under no_sync
                assert sent[step * ACCUM + ACCUM - 1] - before == r["expect"]                   # one all-reduce of Ψ


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
        expect(f"cap {cap!r}", ValueError, lambda: D.DataParallelBucket(GPT(PRESET), ctx.comm, bucket_cap_bytes=cap))
    frozen = GPT(PRESET).requires_grad_(False)
    expect("all frozen", ValueError, lambda: D.DataParallelNaive(frozen, ctx.comm))
    expect("uneven batch", ValueError,
           lambda: D.run_data_parallel(ctx, D.DataParallelNaive, PRESET, TrainConfig(steps=1, batch_size=5)))
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
