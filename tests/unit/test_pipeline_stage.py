"""Pipeline stages on one process (course_lib.parallel.pipeline.stage and plan_pipeline): the stages chained are the
GPT, each stage saves exactly `stage_activation_bytes` per micro-batch (and they add up to the whole model's count),
the B/W split gives the same gradients as one backward and keeps W's inputs counted as activations until W runs,
and every bad pipeline shape is one ValueError that names the fix."""
import pytest
import torch

from course_lib.core.model import GPT, activation_bytes, get_config
from course_lib.memory import MemoryTracker
from course_lib.parallel.pipeline import (
    PipelineStage,
    boundary_bytes,
    defer_weight_grads,
    plan_pipeline,
    run_weight_grads,
    split_layers,
    stage_activation_bytes,
)

CFG = get_config("nano", n_layer=6, seq_len=16)


def _batch(B=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (B, CFG.seq_len), generator=g), torch.randint(0, 256, (B, CFG.seq_len), generator=g)


@pytest.mark.parametrize("S, layers, chunks", [(2, None, 1), (3, [3, 2, 1], 1), (4, None, 1), (6, None, 1),
                                               (3, None, 2), (2, None, 3)])
def test_stages_chained_are_the_gpt_forward_and_backward(S, layers, chunks):
    gpt = GPT(CFG, seed=1).double()
    x, y = _batch()
    ref_loss = gpt(x, y)[1]
    ref_loss.backward()
    ref = {k: p.grad.clone() for k, p in gpt.named_parameters()}
    gpt.zero_grad(set_to_none=True)
    bounds = split_layers(CFG.n_layer, S * chunks, layers)
    ranks = [PipelineStage(gpt, [c * S + r for c in range(chunks)], bounds, S * chunks) for r in range(S)]
    h = x
    for k in range(S * chunks):
        h = ranks[k % S](h, y if k == S * chunks - 1 else None, stage=k)
    assert torch.equal(h, ref_loss)
    h.backward()
    names = [k for st in ranks for k, _ in st.named_parameters()]
    assert sorted(names) == sorted(ref)                     # every parameter on exactly one rank, under its name
    assert all(torch.equal(st.get_parameter(k).grad, ref[k]) for st in ranks for k, _ in st.named_parameters())


def test_split_layers_even_by_default_or_as_given():
    assert split_layers(6, 4) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert split_layers(6, 3, [1, 2, 3]) == [(0, 1), (1, 3), (3, 6)]
    for bad in ([1, 2], [0, 3, 3], [2, 2, 3]):
        with pytest.raises(ValueError, match="at least one block and add up"):
            split_layers(6, 3, bad)


@pytest.mark.parametrize("S, layers", [(2, None), (3, [1, 3, 2]), (6, None)])
def test_each_stage_saves_exactly_its_closed_form_and_they_add_up_to_the_model(S, layers):
    gpt = GPT(CFG)
    bounds = split_layers(CFG.n_layer, S, layers)
    x, y = _batch(B=2)
    h = x
    total = 0
    for k in range(S):
        stage = PipelineStage(gpt, [k], bounds, S)
        inp = h.detach().requires_grad_() if k else h         # what stage k receives from stage k−1
        with MemoryTracker(timeline=False).watch(stage) as mem:
            out = stage(inp, y if k == S - 1 else None)
            assert mem.current["activations"] == stage_activation_bytes(CFG, bounds, k, 2), k
        total += stage_activation_bytes(CFG, bounds, k, 2)
        h = out
    assert total == activation_bytes(CFG, 2)


def test_deferred_weight_gradients_equal_one_backward_and_stay_activations_until_w():
    gpt = GPT(CFG, seed=2).double()
    x, y = _batch()
    gpt(x, y)[1].backward()
    ref = {k: p.grad.clone() for k, p in gpt.named_parameters()}
    gpt.zero_grad(set_to_none=True)
    pending = []
    with MemoryTracker(timeline=False).watch(gpt) as mem:
        with defer_weight_grads(pending):
            loss = gpt(x, y)[1]
        full = mem.current["activations"]
        loss.backward()                                       # B: input gradients, LayerNorm and embedding weights
        held = mem.current["activations"]
        linears = [k for k, m in gpt.named_modules() if isinstance(m, torch.nn.Linear)]
        assert len(pending) == len(linears) and gpt.lm_head.weight.grad is None
        assert gpt.ln_f.weight.grad is not None and gpt.wte.weight.grad is not None
        assert 0 < held < full                                # x and ∂L/∂y of every linear are still held
        run_weight_grads(pending)                             # W
        assert pending == [] and mem.current["activations"] == 0
    worst = max((gpt.get_parameter(k).grad - g).abs().max().item() for k, g in ref.items())
    assert worst < 1e-14


def test_pytorch_refuses_a_backward_after_an_in_place_weight_update():
    """What PipeDream's naive mode sidesteps with `.data`: the saved weight changed, so autograd's version check
    fails — the bug weight stashing avoids, made loud."""
    lin = torch.nn.Linear(4, 4)
    loss = lin(torch.randn(2, 4, requires_grad=True)).pow(2).sum()
    with torch.no_grad():
        lin.weight.sub_(0.1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_tied_embeddings_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="tie_weights=False"):
        PipelineStage(GPT(CFG.replace(tie_weights=True)), [0], split_layers(6, 2), 2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(pp_size=7, num_microbatches=4), "cannot split n_layer=6 blocks into 7 stage"),
    (dict(pp_size=2, num_microbatches=0), "use num_microbatches ≥ 1"),
    (dict(pp_size=2, num_microbatches=-1), "use num_microbatches ≥ 1"),
    (dict(pp_size=4, num_microbatches=4, world_size=6), "world size 6 is not a multiple of pp_size=4"),
    (dict(pp_size=3, num_microbatches=3, schedule="interleaved", chunks=4), "chunks=4 does not divide the layers"),
    (dict(pp_size=4, num_microbatches=4, schedule="interleaved", chunks=2), "does not divide the layers per rank"),
    (dict(pp_size=1, num_microbatches=4, schedule="interleaved", chunks=2), "needs pp_size ≥ 2"),
    (dict(pp_size=2, num_microbatches=5, schedule="interleaved", chunks=3), "equal rounds"),
    (dict(pp_size=2, num_microbatches=2, schedule="1f1b", chunks=3), "needs the 'interleaved' schedule"),
    (dict(pp_size=2, num_microbatches=2, layers=[5, 2]), "add up"),
])
def test_bad_pipeline_shapes_raise_one_error_naming_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        plan_pipeline(CFG, **kwargs)
    assert "use " in str(err.value) or "e.g." in str(err.value)


def test_a_good_plan_holds_its_schedule_and_bounds():
    plan = plan_pipeline(CFG, 3, 4, "interleaved", chunks=2, world_size=6)
    assert plan.bounds == tuple((k, k + 1) for k in range(6)) and plan.num_stages == 3 and plan.num_microbatches == 4
    assert plan.schedule.stages_of(1) == [1, 4]


@pytest.mark.parametrize("elem, dropout", [(2, 0.0), (8, 0.0), (2, 0.1)])
def test_stage_activation_bytes_add_up_to_the_models_for_every_element_size(elem, dropout):
    """One source (model.embed_activation_bytes / head_activation_bytes): LayerNorm's statistics and
    cross-entropy's weight are in the activation dtype, so the stages agree with the model at 2 and 8 bytes too."""
    cfg = CFG.replace(dropout=dropout)
    for S in (2, 3):
        bounds = split_layers(cfg.n_layer, S)
        assert sum(stage_activation_bytes(cfg, bounds, k, 3, elem) for k in range(S)) == activation_bytes(cfg, 3,
                                                                                                        elem_bytes=elem)


def test_the_last_stage_runs_the_models_own_loss_and_the_stage_its_hidden_shape():
    class Halved(GPT):
        def loss(self, logits, targets):
            return super().loss(logits, targets) / 2

        def hidden_shape(self, batch_size, seq_len=None):
            return ("shape of", batch_size, seq_len)

    x, y = _batch()
    model = Halved(CFG)
    want = GPT(CFG)(x, y)[1] / 2
    bounds = split_layers(CFG.n_layer, 2)
    first, last = (PipelineStage(model, [k], bounds, 2) for k in range(2))
    assert torch.allclose(last(first(x), y), want, rtol=0, atol=1e-6)
    assert first.hidden_shape(3, 16) == ("shape of", 3, 16)
    assert {n for n, _ in first.named_children()} == {"wte", "wpe", "drop", "blocks"}
    assert {n for n, _ in last.named_children()} == {"blocks", "ln_f", "lm_head"}


def test_deferred_weight_gradients_reach_grad_through_autograd_and_its_hooks():
    """B leaves a deferred weight's .grad alone and fires no hook for it; W accumulates it the way autograd does
    and fires its post-accumulate-grad hook once — what DDP's overlap and ZeRO-2 listen to."""
    gpt = GPT(CFG, seed=3).double()
    x, y = _batch()
    linears = {id(m.weight) for m in gpt.modules() if isinstance(m, torch.nn.Linear)}
    fired = []
    for p in gpt.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(id(p)))
    pending = []
    with defer_weight_grads(pending):
        loss = gpt(x, y)[1]
    loss.backward()
    assert not linears & set(fired) and len(fired) == len(list(gpt.parameters())) - len(linears) - len(
        [m for m in gpt.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None])
    fired.clear()
    run_weight_grads(pending)
    assert sorted(fired) == sorted(id(p) for m in gpt.modules() if isinstance(m, torch.nn.Linear)
                                   for p in m.parameters())


def test_boundary_bytes_under_sequence_parallelism_are_a_tth():
    plan = plan_pipeline(CFG, 3, 4)
    whole = boundary_bytes(plan, 2, CFG.seq_len, CFG.d_model, 4)
    assert boundary_bytes(plan, 2, CFG.seq_len, CFG.d_model, 4, tp_size=4, sequence_parallel=True) == \
        [w // 4 for w in whole]
    assert boundary_bytes(plan, 2, CFG.seq_len, CFG.d_model, 4, tp_size=4) == whole   # replicated: every tp rank
    assert whole == [2 * 4 * 16 * 32 * 4 * n for n in (1, 2, 1)]                        # M·b·T·d·e per message
