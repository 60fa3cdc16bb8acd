"""Megatron tensor parallelism and sequence parallelism on real gloo ranks: the loss and every gradient equal the
single-process model's (float64) at t = 2, 3 (padded vocabulary) and 4; PyTorch's parallelize_module computes the same
and CommDebugMode counts the same collectives per block; every rank's bytes and activation bytes per layer equal the
closed forms; the full logits never exist; composition with DDP, ZeRO-1 and FSDP on a 2 × 2 mesh equals the reference
and PyTorch's own 2D composition; bad sizes fail on every rank before any byte moves."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from course_lib import optim
from course_lib.core.data import ShardedBatches
from course_lib.core.model import GPT, GPTConfig
from course_lib.distributed.collectives import ring_all_gather_bytes, ring_all_reduce_bytes, ring_reduce_scatter_bytes
from course_lib.distributed.launch import LaunchError, launch
from course_lib.distributed.mesh import Mesh, data_parallel_batches
from course_lib.parallel.tensor import (
    CollectiveLog,
    LayerActivationProbe,
    apply_tp,
    layer_activation_bytes,
    layer_bytes,
    layer_traffic,
    sp_layer_bytes,
    torch_parallelize_blocks,
    tp_bytes_per_microbatch,
)
from course_lib.parallel.zero import apply_zero
from course_lib.train import GradProbe, LedgerProbe, MemoryProbe, TrainConfig, optimizer_kwargs, run, train_reference

pytestmark = pytest.mark.integration

CFG = GPTConfig(seq_len=12, n_layer=2, n_head=12, d_model=24)
B, TOL, E = 2, 1e-12, 8
VARIANTS = {"1D": {}, "naive": {"plan": "naive"}, "SP": {"sequence_parallel": True},
            "SP keep": {"sequence_parallel": True, "regather": False}}


def _reference(cfg, accum_steps=1):
    model = GPT(cfg).double()
    r = run(model, optim.build(model, **optimizer_kwargs(TrainConfig())),
            ShardedBatches(cfg.seq_len, B, accum_steps=accum_steps), steps=1, probes=[GradProbe()])
    return r.losses[0], r["grads"]


def _variants(ctx, cfg, ref_grads, accum_steps, names=tuple(VARIANTS)):
    out = {}
    for name in names:
        kw = VARIANTS[name]
        tp = apply_tp(GPT(cfg).double(), ctx.comm, **kw)
        ctx.comm.ledger.reset()
        mem = MemoryProbe(timeline=False)
        with CollectiveLog() as log:
            r = run(tp, optim.build(tp, **optimizer_kwargs(TrainConfig())),
                    ShardedBatches(cfg.seq_len, B, accum_steps=accum_steps),
                    steps=1, probes=[GradProbe(), mem, LayerActivationProbe(mem)])
        out[name] = {"loss": r.losses[0], "sent": ctx.comm.ledger.bytes_sent(), "act": r["layer_activations"],
                     "layers": [layer_traffic(ctx.comm.ledger, i) for i in range(cfg.n_layer)],
                     "dgrad": max((r["grads"][k] - tp.local_shard(k, g)).abs().max().item()
                                  for k, g in ref_grads.items()),
                     "calls": {p: dict(log.counts(p + "blocks.0.")) for p in ("", "sp_regather/", "sp_params/")}}
    return out


@pytest.mark.parametrize("t", [2, 3, 4])
def test_loss_gradients_bytes_and_activations_per_layer_equal_the_reference_and_the_closed_forms(t):
    ref_loss, ref_grads = _reference(CFG)
    res = launch(_variants, t, CFG, ref_grads, 1, timeout=120)
    s, h, a = CFG.seq_len, CFG.d_model, CFG.n_head
    for rank, r in enumerate(res):
        for name, kw in VARIANTS.items():
            v = r[name]
            assert abs(v["loss"] - ref_loss) < TOL and v["dgrad"] < TOL, (t, name)
            assert v["sent"] == sum(tp_bytes_per_microbatch(CFG, B, t, rank, E, **kw).values()), (t, name)
            per_layer = (sp_layer_bytes if "SP" in name else layer_bytes)(B, s, h, t, rank, E)
            extra = 2 * ring_all_reduce_bytes(B * s * h, t, rank, E) if name == "naive" else 0   # k's and v's f
            assert [sum(p.values()) for p in v["layers"]] == [per_layer + extra] * CFG.n_layer
            if name != "naive":
                act = layer_activation_bytes(s, B, h, a, t, sequence_parallel="SP" in name,
                                             regather=name == "SP", elem=E)["total"]
                assert v["act"] == [act] * CFG.n_layer, (t, name)
        assert r["1D"]["calls"][""] == {"all_reduce": 4} and r["naive"]["calls"][""] == {"all_reduce": 6}
        # SP: g and ḡ in each pass; 2 re-gathers in backward; LN weights and biases, wo and fc_out biases summed
        assert r["SP"]["calls"] == {"": {"all_gather": 4, "reduce_scatter": 4}, "sp_regather/": {"all_gather": 2},
                                    "sp_params/": {"all_reduce": 6}}


def test_sequence_parallel_with_gradient_accumulation_and_tied_weights_equals_the_reference():
    cfg = CFG.replace(tie_weights=True)
    ref_loss, ref_grads = _reference(cfg, accum_steps=2)
    for r in launch(_variants, 2, cfg, ref_grads, 2, ("1D", "SP"), timeout=120):
        assert all(abs(v["loss"] - ref_loss) < TOL and v["dgrad"] < TOL for v in r.values())


class _Largest(TorchDispatchMode):
    """The most elements any op produced while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in torch.utils._pytree.tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor):
                self.numel = max(self.numel, x.numel())
        return out


def _widest(ctx):
    tp = apply_tp(GPT(CFG).double(), ctx.comm)
    x, y = ShardedBatches(CFG.seq_len, B).get(0)
    with _Largest() as largest:
        tp(x, y)[1].backward()
    return largest.numel


def test_the_vocab_parallel_head_and_loss_never_hold_a_tensor_of_the_full_logits_size():
    full, local = B * CFG.seq_len * CFG.vocab_size, B * CFG.seq_len * CFG.vocab_size // 2
    for numel in launch(_widest, 2, timeout=60):
        assert local <= numel < full            # the local logits (B, T, V/2) exist; nothing of B·T·V elements


def _versus_dtensor(ctx, ref_grads):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    out = {}
    for prepare in (False, True):
        model = torch_parallelize_blocks(GPT(CFG).double(), mesh, prepare_input=prepare)
        with CommDebugMode() as comms:
            r = run(model, optim.build(model, **optimizer_kwargs(TrainConfig())), ShardedBatches(CFG.seq_len, B),
                    steps=1, probes=[GradProbe()])
        grads = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in r["grads"].items()}
        out[prepare] = {"counts": {str(k): n for k, n in comms.get_comm_counts().items()},
                        "dgrad": max((grads[k] - g).abs().max().item() for k, g in ref_grads.items())}
        ours = apply_tp(GPT(CFG).double(), ctx.comm, plan="megatron" if prepare else "naive")
        r2 = run(ours, optim.build(ours, **optimizer_kwargs(TrainConfig())), ShardedBatches(CFG.seq_len, B), steps=1,
                 probes=[GradProbe()])
        out[prepare]["vs ours"] = max((r2["grads"][k] - ours.local_shard(k, g)).abs().max().item()
                                      for k, g in grads.items())
    return out


def test_equal_to_parallelize_module_with_the_collective_counts_comm_debug_mode_sees():
    _, ref_grads = _reference(CFG)
    for r in launch(_versus_dtensor, 2, ref_grads, timeout=180):
        assert r[False]["counts"] == {"c10d_functional.all_reduce": 6 * CFG.n_layer}     # plain plan: 6 per block
        assert r[True]["counts"] == {"c10d_functional.all_reduce": 4 * CFG.n_layer}      # + PrepareModuleInput: 4
        assert all(v["dgrad"] < TOL and v["vs ours"] < TOL for v in r.values())


def _dp_tp(ctx, tc, ref_params):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = Mesh(ctx.comm, dp=2, tp=2)
    batches = data_parallel_batches(mesh, CFG.seq_len, tc.batch_size, seed=tc.data_seed)
    out = {"coords": mesh.coords}
    for stage in (0, 1, 3):
        tp = apply_tp(GPT(CFG, seed=tc.seed).double(), mesh)
        model = apply_zero(tp, mesh, stage)
        opt = optim.build(model, **optimizer_kwargs(tc))
        ctx.comm.ledger.reset()
        r = run(model, opt, batches, steps=tc.steps, probes=[LedgerProbe(ctx.comm, groups=("dp", "tp"))],
                keep_params=stage != 3)
        out[stage] = {"losses": r.losses, "bytes": r["ledger"]["group_bytes"],
                      "d_param": max((v - tp.local_shard(k, ref_params[k])).abs().max().item()
                                     for k, v in r.params.items()) if stage != 3 else 0.0}
        out[stage]["dp_want"] = (model.expected_bytes_sent() if stage == 0 else
                                 sum(ring_reduce_scatter_bytes(b.padded, 2, mesh.dp_rank, E)
                                     + ring_all_gather_bytes(b.padded, 2, mesh.dp_rank, E) for b in opt.buckets)
                                 if stage == 1 else 3 * model.padded_numel // 2 * E)
    dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ref_model = torch_parallelize_blocks(GPT(CFG, seed=tc.seed).double(), dm["tp"])
    for block in ref_model.blocks:
        fully_shard(block, mesh=dm["dp"])
    fully_shard(ref_model, mesh=dm["dp"])
    r = run(ref_model, optim.build(ref_model, **optimizer_kwargs(tc)), batches, steps=tc.steps)
    out["torch"] = {"losses": r.losses}
    return out


def test_tp_composes_with_ddp_zero1_and_fsdp_on_a_2x2_mesh_like_pytorch_2d():
    tc = TrainConfig(steps=2, batch_size=2 * B, eps=1e-6)
    ref = train_reference(CFG, tc, model=GPT(CFG, seed=tc.seed).double(), progress=False)
    res = launch(_dp_tp, 4, tc, {k: v.detach() for k, v in ref.model.named_parameters()}, timeout=240)
    for key in (0, 1, 3, "torch"):
        for tp_rank in (0, 1):
            pair = [r[key]["losses"] for r in res if r["coords"]["tp"] == tp_rank]
            mean = [(a + b) / 2 for a, b in zip(*pair)]
            assert max(abs(a - b) for a, b in zip(mean, ref.losses)) < TOL, key
    for r in res:
        tp_want = sum(tp_bytes_per_microbatch(CFG, B, 2, r["coords"]["tp"], E).values())
        for stage in (0, 1, 3):
            assert r[stage]["d_param"] < TOL
            assert r[stage]["bytes"] == [{"dp": r[stage]["dp_want"], "tp": tp_want}] * tc.steps, stage


def _bad(ctx, cfg, kw):
    try:
        apply_tp(GPT(cfg).double(), ctx.comm, **kw)
    except ValueError as e:
        return str(e), ctx.comm.ledger.bytes_sent()
    return None, ctx.comm.ledger.bytes_sent()


@pytest.mark.parametrize("cfg, kw, match", [(CFG.replace(n_head=4), {}, "n_head=4"),
                                            (CFG.replace(seq_len=13), {"sequence_parallel": True}, "seq_len=13"),
                                            (CFG, {"pad_vocab": False}, "pad_vocab=True")])
def test_bad_sizes_fail_on_every_rank_before_any_byte_moves(cfg, kw, match):
    for message, sent in launch(_bad, 3, cfg, kw, timeout=60):
        assert message is not None and match in message and sent == 0


def _sequence_too_short(ctx):
    tp = apply_tp(GPT(CFG).double(), ctx.comm, sequence_parallel=True)
    tp(torch.zeros(1, 11, dtype=torch.long))


def test_a_batch_sequence_parallelism_cannot_split_is_refused_on_every_rank():
    with pytest.raises(LaunchError, match="not a multiple of tp_size=2"):
        launch(_sequence_too_short, 2, timeout=60)
