"""ZeRO-1/2 (`course_lib.parallel.zero`), ZeRO-3/FSDP (`course_lib.parallel.fsdp`) and DDP as ZeRO stage 0, all built
by `compose.apply_zero` and trained by `train.run`, on real gloo ranks against the single-process reference: losses
and parameters (1e-5, fp32), memory per rank by category (exact), ledger bytes (exact), on the GPT and on small
non-GPT models with a frozen parameter and with tied weights; and against PyTorch's FSDP2 fully_shard, gradient by
gradient.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib import optim
from course_lib.core.model import GPT, GPTConfig, param_count
from course_lib.distributed.collectives import ring_all_reduce_bytes
from course_lib.distributed.flat import bucket_params, padded_numel
from course_lib.distributed.launch import launch
from course_lib.distributed.mesh import data_parallel_batches
from course_lib.parallel.fsdp import FSDP
from course_lib.parallel.zero import ShardedOptimizer, apply_zero
from course_lib.train import MemoryProbe, TrainConfig, optimizer_kwargs, run, train_reference

pytestmark = pytest.mark.integration

# Ψ = 49,385, one block 15,155, the rest 19,075: none divisible by 2, 3 or 4, so every world size pads.
ODD = GPTConfig(seq_len=31, n_layer=2, n_head=5, d_model=35)
STEPS = 3
# AdamW divides each gradient by its running RMS; with the default eps=1e-8, a weight whose true gradient is ~0
# (the key bias: softmax ignores a constant added to a row) turns float-rounding noise of the reduction order into
# updates far above rounding. eps=1e-6 keeps the comparison about the parallel algorithm.
EPS = 1e-6
CAP = 64_000                   # bytes per ZeRO bucket: several buckets for the ODD model


def _adamw(params, tc):
    return optim.AdamW(params, **optimizer_kwargs(tc))


def _sharded(params, comm, stage, tc, **kw):
    return ShardedOptimizer(params, torch.optim.AdamW, comm, stage=stage, **optimizer_kwargs(tc), **kw)


def _train(ctx, model, opt, batches, steps):
    """Train `steps` steps with the course's loop under the memory accountant; return the global losses (mean over
    ranks), memory after the last step (before zero_grad), the category maxima and this rank's bytes by tag."""
    ctx.comm.ledger.reset()
    r = run(model, opt, batches, steps=steps, probes=[MemoryProbe(timeline=False)])
    by_tag = {k: v["sent"] for k, v in ctx.comm.ledger.by("tag").items()}
    mem = r["memory"]
    return {"losses": _global(ctx, r.losses), "mem": mem["after_step"][-1],
            "max": dict(mem["report"].max_by_category), "sent": by_tag}


def _global(ctx, losses):
    return ctx.comm.all_reduce(torch.tensor(losses, dtype=torch.float64), "avg", tag="loss").tolist()


class _Toy:
    """Batches of the toy models below: `get(step)` → this rank's (x, y)."""

    def __init__(self, rank, n, b):
        self.rank, self.n, self.b, self.accum_steps, self.micro_batch_size, self.seq_len = rank, n, b, 1, b, 5

    def get(self, step, micro=0):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randint(0, 13, (self.n * self.b, 5), generator=g), torch.randint(0, 13, (self.n * self.b, 5),
                                                                                     generator=g)
        return x[self.rank * self.b:(self.rank + 1) * self.b], y[self.rank * self.b:(self.rank + 1) * self.b]


def _gpt_worker(ctx, cfg, tc):
    data = data_parallel_batches(ctx.comm, cfg.seq_len, tc.batch_size)
    out = {}
    for stage in (0, 1, 2):                                 # stage 0 = DDP: all-reduce of buckets, full optimizer
        model = apply_zero(GPT(cfg, seed=tc.seed), ctx.comm, stage, bucket_cap_bytes=CAP)
        opt = optim.build(model, **optimizer_kwargs(tc))
        out[f"zero{stage}"] = _train(ctx, model, opt, data, STEPS)
        inner = model.module if stage == 0 else model
        out[f"zero{stage}"].update(P=opt.padded_numel if stage else sum(model.bucket_numels()),
                                   K=opt.num_shards if stage else len(list(inner.parameters())),
                                   state=inner.state_dict())
    for prefetch in (True, False):
        f = apply_zero(GPT(cfg, seed=tc.seed), ctx.comm, 3, fsdp_options={"prefetch": prefetch})
        opt = optim.build(f, **optimizer_kwargs(tc))
        r = _train(ctx, f, opt, data, STEPS)
        r.update(P=f.padded_numel, Psi_r=f.local_numel, n=len(list(f.parameters())), state=f.full_state_dict(),
                 units=[sum(g.full_layout.numel for g in u.groups) for u in f.units])
        out["zero3" if prefetch else "zero3_noprefetch"] = r
    return out


@pytest.fixture(scope="module")
def odd_reference():
    return {n: train_reference(ODD, TrainConfig(steps=STEPS, batch_size=2 * n, eps=EPS), progress=False)
            for n in (2, 3, 4)}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_zero_0_1_2_3_equal_reference_with_exact_memory_and_ring_bytes(world_size, odd_reference):
    n, e = world_size, 4
    ref = odd_reference[n]
    res = launch(_gpt_worker, n, ODD, TrainConfig(steps=STEPS, batch_size=2 * n, eps=EPS), timeout=120)
    psi = param_count(ODD)
    ref_state = ref.model.state_dict()
    for variant in ("zero0", "zero1", "zero2", "zero3", "zero3_noprefetch"):
        r0 = res[0][variant]
        assert max(abs(a - b) for a, b in zip(r0["losses"], ref.losses)) < 1e-5, variant
        assert list(r0["state"]) == list(ref_state), variant        # every name, buffers included
        for k, v in ref_state.items():
            torch.testing.assert_close(r0["state"][k], v, atol=1e-5, rtol=0, msg=f"{variant} {k}")
    buckets = [sum(t.numel() for t in b) for b in bucket_params(list(GPT(ODD).parameters()), CAP)]
    for rank, r in enumerate(res):
        z = r["zero0"]                                       # DDP: the buckets are the gradients, nothing padded
        assert z["P"] == psi and z["mem"]["parameters"] == z["mem"]["gradients"] == e * psi
        assert z["mem"]["optimizer"] == 8 * psi + 4 * z["K"]
        assert z["sent"]["ddp_grad"] == STEPS * sum(ring_all_reduce_bytes(b, n, rank, e) for b in buckets)
        for stage in (1, 2):
            z = r[f"zero{stage}"]
            P, K = z["P"], z["K"]
            assert P > psi and P == sum(padded_numel(b, n) for b in buckets) and K == len(buckets)
            assert z["mem"]["parameters"] == e * P
            assert z["mem"]["gradients"] == (e * P if stage < 2 else e * P // n)
            assert z["mem"]["optimizer"] == 8 * P // n + 4 * K
            assert z["sent"]["zero_rs"] == z["sent"]["zero_ag"] == STEPS * (n - 1) * e * P // n
        for variant in ("zero3", "zero3_noprefetch"):
            z = r[variant]
            P = z["P"]
            assert P % n == 0 and P >= psi
            assert z["mem"]["parameters"] == z["mem"]["gradients"] == e * P // n
            assert z["mem"]["optimizer"] == 8 * z["Psi_r"] + 4 * z["n"]   # AdamW over this rank's shards
            for tag in ("fsdp_fwd_ag", "fsdp_bwd_ag", "fsdp_rs"):
                assert z["sent"][tag] == STEPS * (n - 1) * e * P // n, (variant, tag)
            # gathered parameters: the root stays gathered through forward and backward; each block is copied out
            # of its all-gather only when it is about to compute and freed after use, so one block at a time — a
            # prefetched all-gather waits in a communication buffer (units = [block 0, block 1, root], unpadded)
            blocks, root = z["units"][:-1], z["units"][-1]
            assert z["max"]["parameters"] == e * (P // n + root + max(blocks)), variant
        assert sum(rr["zero3"]["Psi_r"] for rr in res) == psi
        assert r["zero3"]["max"]["activations"] == r["zero0"]["max"]["activations"] > 0   # hooks compose with tracker


# ------------------------------------------------------------------------------------------ non-GPT models
class TiedMLP(nn.Module):
    """Embedding → MLP → output layer that reuses the embedding matrix (a tied weight across two units)."""

    def __init__(self, vocab=13, d=6, frozen=False):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.emb = nn.Embedding(vocab, d)
        self.body = nn.Sequential(nn.Linear(d, 2 * d + 1), nn.Tanh(), nn.Linear(2 * d + 1, d))
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        if frozen:                     # the frozen variant: untie, freeze the first linear layer
            self.out.weight = nn.Parameter(torch.randn(vocab, d, generator=g) * 0.3)
            self.body[0].weight.requires_grad_(False)

    def forward(self, idx, targets):
        logits = self.out(self.body(self.emb(idx)))
        return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _toy_reference(frozen, n, b, opt_cls, steps, **kw):
    m = TiedMLP(frozen=frozen)
    opt = opt_cls([p for p in m.parameters() if p.requires_grad], **kw)
    losses, data = [], _Toy(0, 1, n * b)
    for step in range(steps):
        loss = m(*data.get(step))[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, m.state_dict()


SGD = dict(lr=0.1, momentum=0.9)
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=EPS, weight_decay=0.1)


def _toy_worker(ctx, b):
    n, out = ctx.world_size, {}
    for frozen in (False, True):
        data = _Toy(ctx.rank, n, b)
        for name, opt_cls, kw in (("adamw", torch.optim.AdamW, ADAMW), ("sgd", torch.optim.SGD, SGD)):
            m = TiedMLP(frozen=frozen)
            opt = ShardedOptimizer(m.parameters(), opt_cls, ctx.comm, stage=2, **kw)
            r = _train(ctx, m, opt, data, STEPS)
            out[(frozen, "zero2", name)] = dict(r, state=m.state_dict(), P=opt.padded_numel, K=opt.num_shards)
        m = TiedMLP(frozen=frozen)
        f = FSDP(m, ctx.comm)                       # default units: emb, body, out (emb and out share a weight)
        trainable = [p for p in f.parameters() if p.requires_grad]
        r = _train(ctx, f, torch.optim.AdamW(trainable, **ADAMW), data, STEPS)
        frozen_numel = sum(g.padded for u in f.units for g in u.groups if not g.shards[0].requires_grad)
        out[(frozen, "fsdp", "adamw")] = dict(r, state=f.full_state_dict(), P=f.padded_numel, F=frozen_numel,
                                              units=len(f.units), root=f.root is not None)
    return out


def test_frozen_and_tied_weights_on_a_non_gpt_model_sgd_and_adamw():
    n, b = 3, 4
    res = launch(_toy_worker, n, b, timeout=120)
    for frozen in (False, True):
        ref = {"adamw": _toy_reference(frozen, n, b, torch.optim.AdamW, STEPS, **ADAMW),
               "sgd": _toy_reference(frozen, n, b, torch.optim.SGD, STEPS, **SGD)}
        trainable = sum(p.numel() for p in TiedMLP(frozen=frozen).parameters() if p.requires_grad)
        for (fz, variant, opt_name), r in res[0].items():
            if fz != frozen:
                continue
            ref_losses, ref_state = ref[opt_name]
            assert max(abs(a - c) for a, c in zip(r["losses"], ref_losses)) < 1e-5, (frozen, variant, opt_name)
            assert list(r["state"]) == list(ref_state)           # the tied weight appears under both names
            for k, v in ref_state.items():
                torch.testing.assert_close(r["state"][k], v, atol=1e-5, rtol=0, msg=f"{variant} {opt_name} {k}")
        z_sgd, z_adam, f = res[0][(frozen, "zero2", "sgd")], res[0][(frozen, "zero2", "adamw")], \
            res[0][(frozen, "fsdp", "adamw")]
        assert z_adam["P"] == padded_numel(trainable, n)           # a tied weight is bucketed once
        assert z_sgd["mem"]["optimizer"] == 4 * z_sgd["P"] // n    # SGD momentum: one buffer, no step counter
        assert z_adam["mem"]["optimizer"] == 8 * z_adam["P"] // n + 4 * z_adam["K"]
        for rank_res in res:
            r = rank_res[(frozen, "fsdp", "adamw")]
            P, Fz = r["P"], r["F"]
            assert r["sent"]["fsdp_rs"] == STEPS * (n - 1) * 4 * P // n        # tied weight reduced once
            assert r["sent"]["fsdp_fwd_ag"] == STEPS * (n - 1) * 4 * (P + Fz) // n   # frozen ones gathered too
            assert r["mem"]["gradients"] == 4 * P // n
        # tied: emb and out share their only weight, which goes to the root; units = body + root.
        # frozen (untied): emb, body (a trainable and a frozen flat parameter), out; no root.
        assert (f["units"], f["root"], f["F"] > 0) == ((3, False, True) if frozen else (2, True, False))


# ------------------------------------------------------------------------------------------ bf16 and FSDP2
def _bf16_and_fsdp2_worker(ctx, cfg, tc):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    data = data_parallel_batches(ctx.comm, cfg.seq_len, tc.batch_size)
    out = {}
    m = GPT(cfg, seed=tc.seed)
    f = FSDP(m, ctx.comm, units=m.blocks, compute_dtype=torch.bfloat16)
    out["bf16"] = _train(ctx, f, _adamw(f.parameters(), tc), data, tc.steps)
    out["bf16"].update(P=f.padded_numel, dtypes={p.dtype for p in f.parameters()})
    # the same step on FSDP2 and on ours: every parameter's local shard and its gradient after one backward
    theirs = GPT(cfg, seed=tc.seed)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    for block in theirs.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    m = GPT(cfg, seed=tc.seed)
    ours = FSDP(m, ctx.comm, units=m.blocks)
    x, y = data.get(0)
    theirs(x, y)[1].backward()
    ours(x, y)[1].backward()
    out["shards"] = [(n, tuple(p.shape), tuple(p.to_local().shape), (q.detach() - p.to_local()).abs().max().item(),
                      (q.grad - p.grad.to_local()).abs().max().item())
                     for (n, p), (_, q) in zip(theirs.named_parameters(), m.named_parameters())]
    out["names"] = ([n for n, _ in theirs.named_parameters()], [n for n, _ in m.named_parameters()],
                    list(m.state_dict()) == list(GPT(cfg).state_dict()))
    for model in (theirs, ours):
        model.zero_grad(set_to_none=True)
    out["fsdp2"] = run(theirs, _adamw(theirs.parameters(), tc), data, steps=tc.steps).losses
    out["ours"] = run(ours, _adamw(ours.parameters(), tc), data, steps=tc.steps).losses
    out["fsdp2"], out["ours"] = _global(ctx, out["fsdp2"]), _global(ctx, out["ours"])
    return out


def test_fsdp_shards_every_parameter_like_fsdp2_and_equals_it_gradient_by_gradient():
    """FSDP2 is the independent reference: the same dim-0 shard of every parameter on every rank, the same gradient
    shard after one backward (every parameter checked: the module exposes its shards), the same losses."""
    n, tc = 2, TrainConfig(steps=4, batch_size=8, eps=EPS)
    ref = train_reference("nano", tc, progress=False)
    res = launch(_bf16_and_fsdp2_worker, n, GPT("nano").config, tc, timeout=120)
    n_params = len(list(GPT("nano").parameters()))
    for r in res:
        theirs_names, our_names, same_keys = r["names"]
        assert our_names == theirs_names and same_keys and len(r["shards"]) == n_params
        for name, full, local, d_value, d_grad in r["shards"]:
            assert local[0] == -(-full[0] // n) or local[0] == full[0] - (n - 1) * -(-full[0] // n), (name, local)
            assert d_value == 0.0, name                              # the same rows of the same initial values
            assert d_grad < 1e-6, (name, d_grad)                     # the same reduce-scattered gradient
        assert max(abs(a - b) for a, b in zip(r["ours"], r["fsdp2"])) < 1e-5
        bf = r["bf16"]
        assert bf["dtypes"] == {torch.float32}                   # master shards stay fp32
        for tag in ("fsdp_fwd_ag", "fsdp_bwd_ag", "fsdp_rs"):    # 2 bytes per element on the wire
            assert bf["sent"][tag] == tc.steps * (n - 1) * 2 * bf["P"] // n
    assert max(abs(a - b) for a, b in zip(res[0]["ours"], ref.losses)) < 1e-5
    assert max(abs(a - b) for a, b in zip(res[0]["bf16"]["losses"], ref.losses)) < 0.05   # bf16: close, not equal


# ------------------------------------------------------------------------------------------ wrapping and accumulation
def _broadcast_and_accumulation_worker(ctx, tc):
    out = {}
    m = GPT("nano", seed=ctx.rank)                              # every rank starts from a different model ...
    ShardedOptimizer(m.parameters(), torch.optim.AdamW, ctx.comm, stage=1)
    out["zero_init"] = m.state_dict()                           # ... and the wrapper broadcast rank 0's
    m = GPT("nano", seed=ctx.rank)
    out["fsdp_init"] = FSDP(m, ctx.comm, units=m.blocks).full_state_dict()
    cfg = GPT("nano").config                                    # two micro-batches per step, gradients accumulated
    data = data_parallel_batches(ctx.comm, cfg.seq_len, tc.batch_size, accum_steps=2)
    for name in ("zero2", "fsdp"):
        m = GPT(cfg, seed=tc.seed)
        if name == "zero2":
            model, opt = m, _sharded(m.parameters(), ctx.comm, 2, tc, bucket_cap_bytes=32_000)
        else:
            model = FSDP(m, ctx.comm, units=m.blocks)
            opt = _adamw(model.parameters(), tc)
        out[name] = _global(ctx, run(model, opt, data, steps=STEPS).losses)
        out[name + "_state"] = model.full_state_dict() if name == "fsdp" else m.state_dict()
    return out


def test_wrappers_broadcast_rank_0_and_accumulate_gradients_over_micro_steps():
    n, tc = 3, TrainConfig(steps=STEPS, batch_size=12, eps=EPS)
    ref = train_reference("nano", tc, progress=False)
    res = launch(_broadcast_and_accumulation_worker, n, tc, timeout=120)
    rank0_init = GPT("nano", seed=0).state_dict()
    for r in res:
        for key in ("zero_init", "fsdp_init"):
            assert all(torch.equal(r[key][k], v) for k, v in rank0_init.items()), key
    for name in ("zero2", "fsdp"):
        assert max(abs(a - b) for a, b in zip(res[0][name], ref.losses)) < 1e-5, name
        for k, v in ref.model.state_dict().items():
            torch.testing.assert_close(res[0][name + "_state"][k], v, atol=1e-5, rtol=0, msg=f"{name} {k}")
