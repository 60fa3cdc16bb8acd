"""Offload on one process: vDNN activation offload, ZeRO-Offload (OffloadAdam on host, the DPU), the SSD tier, and
the modeled link — against the no-offload reference, torch's AdamW and the formulas (docs/formulas.md §6)."""
import errno
import os

import pytest
import torch

from course_lib import optim
from course_lib.core.costmodel import get_link
from course_lib.core.data import ShardedBatches
from course_lib.core.files import disk_full, is_temporary
from course_lib.core.handles import handle_of
from course_lib.core.model import (
    GPT,
    activation_bytes,
    block_activation_bytes,
    embed_activation_bytes,
    get_config,
    head_activation_bytes,
)
from course_lib.memopt.offload import (
    ActivationOffload,
    DiskTier,
    Machine,
    OffloadAdam,
    OffloadDiskError,
    OffloadPass,
    adamw_,
    apply_activation_offload,
    apply_offload,
    break_even_speedup,
    fit_options,
    gpt_shape,
    largest_fitting,
    link_schedule,
    measure_disk,
    offloaded_activation_peak,
    save_on_cpu_traffic,
    zero_offload_step_time,
)
from course_lib.memopt.recompute import apply_recompute
from course_lib.memory import MemoryTracker, SimulatedAccelerator, SimulatedOutOfMemoryError
from course_lib.parallel.pipeline.stage import PipelineStage, split_layers, stage_activation_bytes
from course_lib.train import MemoryProbe, TrainConfig, optimizer_kwargs, run

torch.set_num_threads(1)
NANO = get_config("nano")


def _fwd_bwd(model, cfg, B, wrap=None):
    """One forward + backward under the memory accountant: (gradients, tracker)."""
    x, y = ShardedBatches(cfg.seq_len, B).global_batch(0)
    m = wrap(model) if wrap else model
    torch.manual_seed(0)                         # the same dropout masks with and without offload
    with MemoryTracker().watch(model) as mem:
        _, loss = m(x, y)
        loss.backward()
        del loss
    if wrap:
        m.close()
    return {k: p.grad for k, p in model.named_parameters()}, mem, m


# ============================================================================================ activations
@pytest.mark.parametrize("cfg, B", [(NANO, 4), (get_config("nano", n_layer=1), 2),
                                    (get_config("nano", n_layer=3, vocab_size=2048), 2),
                                    (get_config("nano", n_layer=3, dropout=0.1), 2)],
                         ids=["nano", "one-layer", "big-head", "dropout"])
def test_activation_offload_gives_bitwise_gradients_and_keeps_only_the_layers_in_flight(cfg, B):
    ref, plain, _ = _fwd_bwd(GPT(cfg), cfg, B)
    got, mem, w = _fwd_bwd(GPT(cfg), cfg, B, ActivationOffload)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    A, layer = activation_bytes(cfg, B), block_activation_bytes(cfg, B)
    assert plain.max_by_category["activations"] == A
    assert mem.max_by_category["activations"] == offloaded_activation_peak(cfg, B)
    assert mem.peak_at("host") == cfg.n_layer * layer                   # every layer, once, on the host
    assert w.last_pass.layer_bytes == {i: layer for i in range(cfg.n_layer)}
    assert w.log.bytes_sent(op="d2h") == w.log.bytes_recv(op="h2d") == cfg.n_layer * layer
    assert mem.peak <= plain.peak and mem.total_at("host") == 0 and mem.current["activations"] == 0


def test_offloaded_activations_fit_a_budget_the_plain_step_does_not():
    cfg, B = get_config("nano", n_layer=4), 4
    x, y = ShardedBatches(cfg.seq_len, B).global_batch(0)
    _, plain, _ = _fwd_bwd(GPT(cfg), cfg, B)
    _, off, _ = _fwd_bwd(GPT(cfg), cfg, B, ActivationOffload)
    budget = off.peak
    assert budget < plain.peak
    with pytest.raises(SimulatedOutOfMemoryError, match="activations"):
        m = GPT(cfg)
        with SimulatedAccelerator(budget).track(m):
            _, loss = m(x, y)
            loss.backward()
    m = GPT(cfg)
    w = ActivationOffload(m)
    with SimulatedAccelerator(budget).track(m) as mem:
        _, loss = w(x, y)
        loss.backward()
    w.close()
    assert mem.peak == budget


def test_without_prefetch_each_layer_is_fetched_when_its_backward_asks_and_gradients_still_match():
    ref, _, _ = _fwd_bwd(GPT(NANO), NANO, 2)
    got, mem, w = _fwd_bwd(GPT(NANO), NANO, 2, lambda m: ActivationOffload(m, prefetch=False))
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    layer = block_activation_bytes(NANO, 2)
    emb, head = embed_activation_bytes(NANO, 2), head_activation_bytes(NANO, 2)
    assert mem.max_by_category["activations"] == emb + max(head, layer)      # one layer in flight, never two


def test_a_storage_saved_by_several_ops_moves_once_and_save_on_cpu_moves_it_per_save_with_the_weights():
    cfg, B = NANO, 2
    batch = ShardedBatches(cfg.seq_len, B).global_batch(0)
    theirs = save_on_cpu_traffic(GPT(cfg), batch)
    ref, _, _ = _fwd_bwd(GPT(cfg), cfg, B)
    assert all(torch.equal(ref[k], theirs["grads"][k]) for k in ref)
    assert theirs["storage_bytes"] == activation_bytes(cfg, B)            # unique storages: the activations
    assert theirs["parameter_saves"] > 0 and theirs["parameter_bytes"] > 0
    assert theirs["bytes"] > theirs["storage_bytes"] + theirs["parameter_bytes"]   # duplicates and views
    _, _, w = _fwd_bwd(GPT(cfg), cfg, B, ActivationOffload)
    saves_in_layers = w.last_pass.saves
    assert w.log.messages(op="d2h") < saves_in_layers                     # one copy per storage, not per save


def test_the_modeled_link_carries_each_offloaded_byte_once_each_way():
    _, _, w = _fwd_bwd(GPT(NANO), NANO, 4, ActivationOffload)
    link = get_link("PCIe Gen4 x16")
    s = w.modeled_schedule(link)
    layer = block_activation_bytes(NANO, 4)
    assert s.link_seconds["h2d"] == pytest.approx(NANO.n_layer * link.time(layer), rel=1e-12)   # one per layer
    assert s.link_seconds["d2h"] == pytest.approx(sum(link.time(n) for _, _, n in w.last_pass.offloads), rel=1e-12)
    assert sorted(w.last_pass.fetches) == list(range(NANO.n_layer)) and s.exposed >= 0


def _stated_pass(L, nbytes, fwd, bwd, head):
    """What ActivationOffload records for L layers of one storage each, with stated (not measured) times: layer i
    runs forward over [i·fwd, (i+1)·fwd] and offloads half-way; backward starts in the head (the top layer's
    prefetch issued then), each layer's backward takes `bwd` and issues the prefetch of the layer below."""
    p = OffloadPass()
    for i in range(L):
        p.forward[i] = (i * fwd, (i + 1) * fwd)
        p.offloads.append((i * fwd + fwd / 2, i, nbytes))
        p.layer_bytes[i] = nbytes
    t = L * fwd
    p.fetches[L - 1] = (t, nbytes)
    t += head
    for i in reversed(range(L)):
        p.needed[i], p.backward[i] = t, (t, t + bwd)
        if i:
            p.fetches[i - 1] = (t, nbytes)
        t += bwd
    return p


@pytest.mark.parametrize("fwd, bwd, head", [(1e-3, 2e-3, 3e-4), (4e-4, 1e-3, 5e-3), (1e-3, 4e-4, 1e-3)])
def test_the_link_stops_hiding_when_the_tightest_window_is_shorter_than_one_transfer(fwd, bwd, head):
    """Stated times: the tightest windows are the top layer's offload (fwd/2: issued half-way through the last
    forward, due at its end), the head's backward (the top layer's prefetch) and a layer's backward (the next
    prefetch). A device s times faster shrinks them by s, so the link is exposed from s* = min(fwd/2, head, bwd)/t."""
    link = get_link("PCIe Gen4 x16")
    nbytes, L = 1 << 20, 4
    p = _stated_pass(L, nbytes, fwd, bwd, head)
    s_star = min(fwd / 2, head, bwd) / link.time(nbytes)
    assert link_schedule(p, link, speedup=s_star / 1.01).exposed == 0.0
    assert link_schedule(p, link, speedup=s_star * 1.01).exposed > 0.0
    assert break_even_speedup(p, link) == pytest.approx(s_star, rel=2e-3)
    s = link_schedule(p, link, speedup=s_star / 1.01)
    assert s.link_seconds == pytest.approx({"d2h": L * link.time(nbytes), "h2d": L * link.time(nbytes)}, rel=1e-12)
    assert s.compute_seconds == pytest.approx((L * fwd + head + L * bwd) / (s_star / 1.01), rel=1e-12)


def _micro_batches(cfg, B, k):
    return [ShardedBatches(cfg.seq_len, B, seed=5).global_batch(j) for j in range(k)]


@pytest.mark.parametrize("order", ["reverse", "forward"])
@pytest.mark.parametrize("cfg", [NANO, get_config("nano", n_layer=3, vocab_size=2048)], ids=["nano", "big-head"])
def test_several_forwards_in_flight_each_bring_their_own_layers_back(order, cfg):
    """k forwards, then their k backwards (as 1F1B does on stage 0): every forward keeps its own layers, each
    storage moves once, gradients are bitwise those without offload (summed in the same order), and the device
    holds (k − 1)·(A_emb + A_head) + A_emb + A_layer + max(A_head, A_layer) at most."""
    B, k = 2, 3
    batches = _micro_batches(cfg, B, k)
    backward_order = list(reversed(range(k))) if order == "reverse" else list(range(k))
    grads, mems = {}, {}
    for name in ("plain", "offload"):
        model = GPT(cfg)
        w = ActivationOffload(model) if name == "offload" else model
        with MemoryTracker().watch(model) as mem:
            losses = [w(x, y)[1] for x, y in batches]
            if name == "offload":
                assert w.in_flight == k
            for j in backward_order:
                losses[j].backward()
            del losses
        grads[name], mems[name] = {n: p.grad for n, p in model.named_parameters()}, mem
    w.close()
    assert all(torch.equal(grads["plain"][n], grads["offload"][n]) for n in grads["plain"])
    layer = block_activation_bytes(cfg, B)
    assert mems["plain"].max_by_category["activations"] == k * activation_bytes(cfg, B)
    assert mems["offload"].max_by_category["activations"] == offloaded_activation_peak(cfg, B, in_flight=k) == \
        (k - 1) * (embed_activation_bytes(cfg, B) + head_activation_bytes(cfg, B)) + \
        offloaded_activation_peak(cfg, B)
    assert mems["offload"].peak_at("host") == k * cfg.n_layer * layer          # every forward's layers, once
    assert w.log.bytes_sent(op="d2h") == w.log.bytes_recv(op="h2d") == k * cfg.n_layer * layer
    assert sum(e.op == "h2d" for e in w.log.events) == k * cfg.n_layer          # one fetch per layer per forward
    assert w.in_flight == 0 and mems["offload"].current["activations"] == 0 and mems["offload"].total_at("host") == 0


def test_a_forward_whose_graph_is_dropped_leaves_nothing_behind():
    model = GPT(NANO)
    w = ActivationOffload(model)
    (x, y), = _micro_batches(NANO, 2, 1)
    with MemoryTracker().watch(model) as mem:
        loss = w(x, y)[1]
        assert w.in_flight == 1 and mem.current_at("host")["activations"] == NANO.n_layer * \
            block_activation_bytes(NANO, 2)
        del loss
        with torch.no_grad():
            w(x, y)
    assert w.in_flight == 0 and mem.total_at("host") == 0


def test_activation_offload_runs_inside_a_pipeline_stage_called_directly():
    """Stage 0 of 2 (2 of 4 blocks, the embedding), as the pipeline executor runs it: the stage is called, no
    wrapper. Two micro-batches forward, then both backward: bitwise the stage's gradients without offload, and
    device activations k·A_emb + 2·A_layer (no head here: the top block arrives, then the one below it)."""
    cfg, B, k = get_config("nano", n_layer=4), 2, 2
    bounds = split_layers(cfg.n_layer, 2)
    batches = _micro_batches(cfg, B, k)
    g = torch.Generator().manual_seed(1)
    grads_out = [torch.randn(B, cfg.seq_len, cfg.d_model, generator=g) for _ in range(k)]
    got, mems = {}, {}
    for name in ("plain", "offload"):
        stage = PipelineStage(GPT(cfg), [0], bounds, 2)
        if name == "offload":
            assert apply_activation_offload(stage) is stage              # in place: the same kind of model
            off = handle_of(stage, "activation_offload")
        with MemoryTracker().watch(stage) as mem:
            outs = [stage(x) for x, _ in batches]
            for out, grad in zip(outs, grads_out):
                torch.autograd.backward(out, grad)
            del outs
        got[name], mems[name] = {n: p.grad for n, p in stage.named_parameters()}, mem
    off.close()
    assert all(torch.equal(got["plain"][n], got["offload"][n]) for n in got["plain"])
    layer, emb = block_activation_bytes(cfg, B), embed_activation_bytes(cfg, B)
    assert stage_activation_bytes(cfg, bounds, 0, B) == emb + 2 * layer
    assert mems["plain"].max_by_category["activations"] == k * (emb + 2 * layer)
    assert mems["offload"].max_by_category["activations"] == k * emb + 2 * layer
    assert off.log.bytes_sent(op="d2h") == off.log.bytes_recv(op="h2d") == k * 2 * layer
    assert off.in_flight == 0


def test_a_later_stage_keeps_its_received_input_and_offloads_the_rest():
    """Stage 1 of 2 (blocks 2–3, the head and the loss), its input held by the caller as the pipeline executor holds
    it: that storage stays (moving it would free nothing), everything else its blocks save moves. Two micro-batches
    forward, then both backward; X = one input's bytes: (k − 1)·(A_head + X) + max(A_head + X + A_layer, 2·A_layer)
    on the device, k·(2·A_layer − X) over the link each way."""
    cfg, B, k = get_config("nano", n_layer=4), 2, 2
    bounds = split_layers(cfg.n_layer, 2)
    batches = _micro_batches(cfg, B, k)
    g = torch.Generator().manual_seed(2)
    inputs = [torch.randn(B, cfg.seq_len, cfg.d_model, generator=g) for _ in range(k)]
    got, mems = {}, {}
    for name in ("plain", "offload"):
        stage = PipelineStage(GPT(cfg), [1], bounds, 2)
        off = ActivationOffload(stage) if name == "offload" else None
        xs = [x.clone().requires_grad_() for x in inputs]
        with MemoryTracker().watch(stage) as mem:
            losses = [stage(x, y) for x, (_, y) in zip(xs, batches)]
            for loss in losses:
                loss.backward()
            del losses
        got[name], mems[name] = {n: p.grad for n, p in stage.named_parameters()}, mem
        got[name]["inputs"] = torch.cat([x.grad for x in xs])
    off.close()
    assert all(torch.equal(got["plain"][n], got["offload"][n]) for n in got["plain"])
    A, H, X = block_activation_bytes(cfg, B), head_activation_bytes(cfg, B), 4 * B * cfg.seq_len * cfg.d_model
    assert stage_activation_bytes(cfg, bounds, 1, B) == 2 * A + H
    assert mems["plain"].max_by_category["activations"] == k * (2 * A + H)
    assert mems["offload"].max_by_category["activations"] == (k - 1) * (H + X) + max(H + X + A, 2 * A)
    assert off.log.bytes_sent(op="d2h") == off.log.bytes_recv(op="h2d") == k * (2 * A - X)


def test_activation_offload_refuses_what_it_cannot_handle():
    cfg = get_config("nano", n_layer=4)
    with pytest.raises(TypeError, match="has no transformer blocks"):
        apply_activation_offload(torch.nn.Linear(4, 4))
    model = GPT(cfg)
    apply_activation_offload(model)
    with pytest.raises(ValueError, match="already applied"):
        apply_activation_offload(model)
    stage = PipelineStage(model, [0], split_layers(cfg.n_layer, 2), 2)     # cut after offloading the GPT
    with pytest.raises(ValueError, match="already applied"):
        apply_activation_offload(stage)
    x, _ = _micro_batches(cfg, 2, 1)[0]
    with pytest.raises(RuntimeError, match="apply it to the model that is called"):
        stage(x)
    handle_of(model, "activation_offload").remove()                          # hooks off: the stage runs plainly
    assert handle_of(model, "activation_offload") is None and stage(x).shape == (2, cfg.seq_len, cfg.d_model)
    apply_recompute(model, policy="full")
    with pytest.raises(ValueError, match="offload or recompute a block, not both"):
        apply_activation_offload(model)


# ============================================================================================ ZeRO-Offload
def test_our_cpu_adamw_is_torchs_adamw_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(1000, generator=g)
    a, b = p0.clone().requires_grad_(), p0.clone()
    opt = torch.optim.AdamW([a], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    m, v = torch.zeros(1000), torch.zeros(1000)
    for step in range(1, 6):
        grad = torch.randn(1000, generator=g)
        a.grad = grad.clone()
        opt.step()
        adamw_(b, grad, m, v, step, lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
        assert torch.equal(a.detach(), b)


def test_offload_adam_in_fp32_trains_exactly_like_torch_adamw():
    tc = TrainConfig(steps=3, batch_size=4, weight_decay=0.1)
    batches = ShardedBatches(NANO.seq_len, tc.batch_size)
    m1, m2 = GPT(NANO), GPT(NANO)
    r1 = run(m1, optim.build(m1, **optimizer_kwargs(tc)), batches, steps=tc.steps)
    opt = OffloadAdam(m2.parameters(), **optimizer_kwargs(tc))
    r2 = run(m2, opt, batches, steps=tc.steps)
    assert r1.losses == r2.losses
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
    psi = sum(p.numel() for p in m2.parameters())
    assert opt.log.bytes_sent(op="d2h") == opt.log.bytes_recv(op="h2d") == tc.steps * 4 * psi


def _mixed(tier, steps=3, **kw):
    tc = TrainConfig(steps=steps, batch_size=4, weight_decay=0.1)
    model = GPT(NANO).to(torch.bfloat16)
    opt = OffloadAdam(model.parameters(), tier=tier, **optimizer_kwargs(tc), **kw)
    probe = MemoryProbe()
    r = run(model, opt, ShardedBatches(NANO.seq_len, tc.batch_size), steps=steps, probes=[probe])
    opt.close()
    return r, model, opt


def test_zero_offload_keeps_2psi_on_the_device_moves_2psi_each_way_and_equals_the_mixed_precision_run():
    steps = 3
    r_dev, m_dev, _ = _mixed("device", steps)
    r_host, m_host, opt = _mixed("host", steps)
    assert r_dev.losses == r_host.losses
    assert all(torch.equal(a, b) for a, b in zip(m_dev.parameters(), m_host.parameters()))
    psi = sum(p.numel() for p in m_host.parameters())
    before = r_dev["memory"]["after_step"][-1]
    after = r_host["memory"]["after_step"][-1]
    assert before["parameters"] + before["gradients"] + before["optimizer"] == 16 * psi        # 2 + 2 + 12
    assert (after["parameters"], after["gradients"], after["optimizer"]) == (2 * psi, 0, 0)
    host = r_host["memory"]["report"].at("host")["current"]
    assert host["gradients"] == 2 * psi and host["optimizer"] == 12 * psi
    # each gradient leaves as autograd produces it: at most the largest one is ever on the device
    largest = max(p.numel() for p in m_host.parameters()) * 2
    assert r_host["memory"]["report"].max_by_category["gradients"] == largest
    assert opt.log.bytes_sent(op="d2h") == opt.log.bytes_recv(op="h2d") == steps * 2 * psi


def test_the_delayed_update_trains_on_parameters_one_step_old():
    """DPU: after the warm-up, the forward of step i + 1 uses the parameters of step i − 1. With a warm-up as long
    as the run it is the ordinary run; with a shorter one the first steps agree and the rest differ."""
    r_sync, m_sync, _ = _mixed("host", 5)
    r_long, m_long, _ = _mixed("host", 5, dpu=True, dpu_warmup=5)
    assert r_sync.losses == r_long.losses and all(torch.equal(a, b) for a, b in zip(m_sync.parameters(),
                                                                                    m_long.parameters()))
    r_dpu, m_dpu, opt = _mixed("host", 5, dpu=True, dpu_warmup=2)
    assert r_dpu.losses[:3] == r_sync.losses[:3]     # steps 0, 1 ordinary; step 2 runs on step 1's parameters
    assert opt.steps_done == 5 and len(opt.timings) == 5
    psi = sum(p.numel() for p in m_dpu.parameters())
    host = r_dpu["memory"]["report"].at("host")["peak"]
    assert host >= 4 * psi + 12 * psi                # two gradient buffers + the fp32 state


def test_modeled_step_time_with_the_delayed_update_is_the_longer_of_device_and_cpu():
    link = get_link("PCIe Gen4 x16")
    psi = 10**6
    plain = zero_offload_step_time(0.1, 0.2, 0.15, psi, link=link)
    dpu = zero_offload_step_time(0.1, 0.2, 0.15, psi, link=link, dpu=True)
    assert plain["total"] == pytest.approx(0.3 + 0.15 + link.time(2 * psi))
    assert dpu["total"] == pytest.approx(max(0.3, 0.15 + link.time(2 * psi))) and dpu["total"] < plain["total"]


def test_bad_optimizer_options_are_refused_with_the_fix():
    params = GPT(NANO).parameters()
    with pytest.raises(ValueError, match="tier must be one of"):
        OffloadAdam(params, tier="gpu")
    with pytest.raises(ValueError, match="needs tier='host' or 'disk'"):
        OffloadAdam(GPT(NANO).parameters(), tier="device", dpu=True)


# ============================================================================================ the SSD tier
def test_the_ssd_tier_reads_and_writes_12psi_per_step_and_ends_where_the_host_tier_ends(tmp_path):
    steps = 3
    r_host, m_host, _ = _mixed("host", steps)
    r_disk, m_disk, opt = _mixed("disk", steps, offload_dir=str(tmp_path), chunk_bytes=64 << 10)
    assert r_host.losses == r_disk.losses
    assert all(torch.equal(a, b) for a, b in zip(m_host.parameters(), m_disk.parameters()))
    psi = sum(p.numel() for p in m_disk.parameters())
    assert opt.log.bytes_recv(op="read") == steps * 12 * psi
    assert opt.log.bytes_sent(op="write") == (steps + 1) * 12 * psi          # the first state, then every step
    assert len(opt.disk.chunks) > 3
    rep = r_disk["memory"]["report"]
    assert rep.at("disk")["peak"] == rep.at("disk")["current"]["optimizer"] == 12 * psi      # until close()
    assert rep.at("host")["current"]["optimizer"] == 0
    in_flight = max(snap.get("optimizer", 0) for _, snap in rep.at("host")["timeline"])
    assert 0 < in_flight <= 3 * max(opt.disk.chunk_nbytes)                    # ≤ 3 chunks in host memory
    assert opt.disk.closed and os.listdir(tmp_path) == []                    # removed at the end


def test_a_directory_too_small_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(OffloadDiskError, match="needs .* Free space there, or pass offload_dir="):
        DiskTier([100_000] * 4, directory=str(tmp_path), chunk_bytes=1 << 20, quota=1000)
    assert os.listdir(tmp_path) == []


def test_a_disk_filling_up_mid_step_raises_a_clear_error_and_leaves_no_file(tmp_path):
    writes = []

    def fault(chunk, nbytes):
        writes.append(chunk)
        if len(writes) > 6:                          # the first state is written, then a step runs out of space
            raise OSError(errno.ENOSPC, "No space left on device")
    model = GPT(NANO).to(torch.bfloat16)
    opt = OffloadAdam(model.parameters(), tier="disk", offload_dir=str(tmp_path), chunk_bytes=32 << 10, fault=fault)
    with pytest.raises(OffloadDiskError, match="is full: writing chunk"):
        run(model, opt, ShardedBatches(NANO.seq_len, 2), steps=3)
    assert opt.disk.closed and os.listdir(tmp_path) == []


def test_a_disk_that_fills_up_inside_a_chunk_write_leaves_the_old_chunk_and_no_temporary(tmp_path):
    """The ENOSPC comes from inside the one atomic write (`files.disk_full`), half-way through a chunk: the chunk on
    disk is still the old one, the temporary file is gone, and the error names the fix."""
    tier = DiskTier([1000, 2000], directory=str(tmp_path), chunk_bytes=12_000)
    tier.initialize([torch.ones(1000), torch.ones(2000)])
    before = open(tier.path(0), "rb").read()
    with disk_full(after_bytes=tier.chunk_nbytes[0] // 2), pytest.raises(OffloadDiskError, match="is full: .*"
                                                                                           "offload_dir="):
        tier.write_chunk(0, torch.zeros(tier.chunk_nbytes[0] // 4))
    assert open(tier.path(0), "rb").read() == before
    assert not any(is_temporary(p) for p in os.listdir(tier.root))
    tier.close()
    assert os.listdir(tmp_path) == []


def test_an_offload_directory_that_cannot_hold_files_is_a_clear_error(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(OffloadDiskError, match="offload_dir= an existing, writable directory"):
        DiskTier([10], directory=str(not_a_dir))
    with pytest.raises(OffloadDiskError, match="writable directory"):
        DiskTier([10], directory=str(tmp_path / "missing" / "dir"))
    assert os.listdir(tmp_path) == ["file"]


def test_chunk_writes_are_atomic_renames(tmp_path):
    tier = DiskTier([1000, 2000, 3000], directory=str(tmp_path), chunk_bytes=12_000)
    tier.initialize([torch.ones(1000), torch.ones(2000) * 2, torch.ones(3000) * 3])
    seen = []
    real = os.replace

    def spy(src, dst):
        seen.append((os.path.basename(src), os.path.basename(dst), os.path.exists(src)))
        return real(src, dst)
    os.replace = spy
    try:
        tier.step(lambda i, master, m, v: master.add_(1))
    finally:
        os.replace = real
    assert seen and all(is_temporary(src) and src.startswith(f".{dst}.") and existed for src, dst, existed in seen)
    masters = []
    tier.step(lambda i, master, m, v: masters.append((i, master.clone())))
    assert sorted((i, float(t[0])) for i, t in masters) == [(0, 2.0), (1, 3.0), (2, 4.0)]
    tier.close()
    assert not any(p.suffix == ".tmp" for p in tmp_path.rglob("*")) and os.listdir(tmp_path) == []


def test_measured_disk_bandwidth_is_positive_and_leaves_nothing(tmp_path):
    bw = measure_disk(str(tmp_path), nbytes=4 << 20, chunk_bytes=1 << 20)
    assert bw["read"] > 0 and bw["write"] > 0 and bw["bytes"] == 4 * 12 * ((1 << 20) // 12)   # 4 chunks of 12 B × n
    assert os.listdir(tmp_path) == []


def test_apply_offload_builds_the_pieces_for_train_run(tmp_path):
    tc = TrainConfig(steps=2, batch_size=2)
    gpt = GPT(NANO)
    model = apply_offload(gpt, optimizer="disk", offload_dir=str(tmp_path))
    opt = optim.build(model, **optimizer_kwargs(tc))
    off = handle_of(model, "activation_offload")
    assert model is gpt and isinstance(off, ActivationOffload) and isinstance(opt, OffloadAdam) and opt.log is off.log
    r = run(model, opt, ShardedBatches(NANO.seq_len, tc.batch_size), steps=tc.steps)
    off.close()
    opt.close()
    assert len(r.losses) == 2 and next(model.parameters()).dtype == torch.bfloat16
    assert {e.group for e in opt.log.events} >= {"pcie", "disk", "compute"}
    with pytest.raises(ValueError, match="tier must be one of"):
        optim.build(apply_offload(GPT(NANO), optimizer="nvme"), lr=1e-3)


# ============================================================================================ the decision
def test_the_decision_model_fits_by_its_formulas():
    m = Machine()
    limits = {k: largest_fitting(k, m) for k in fit_options(1e9, m)}
    assert limits["none"] < limits["recompute"]
    assert limits["offload: host"] == pytest.approx(m.host_bytes / 16, rel=2e-3)   # host: 16Ψ
    assert limits["offload: host"] < limits["offload: SSD"] < limits[f"ZeRO-3 ×{m.zero_ranks}"]
    for k, psi in limits.items():
        assert fit_options(psi, m)[k]["fits"] and not fit_options(psi * 1.01, m)[k]["fits"]
    o = fit_options(1e9, m)
    assert not o["none"]["recompute"] and not o["offload: host"]["recompute"]
    assert o["none"]["device"] - o["offload: host"]["device"] == 14e9          # 16Ψ → 2Ψ, same activations


def test_the_decision_model_counts_korthikantis_activations_and_16_bytes_per_parameter():
    m = Machine()
    psi = 7e9
    shape = gpt_shape(psi)
    L, h, a, s, b = shape["n_layer"], shape["d_model"], shape["n_head"], m.seq_len, m.micro_batch_size
    layer = s * b * h * (34 + 5 * a * s / h)                      # docs/formulas.md §4.3, 16-bit, with dropout
    o = fit_options(psi, m)
    assert o["recompute"]["device"] == pytest.approx(16 * psi + L * 2 * s * b * h + layer, rel=1e-12)
    assert o["offload: host"]["device"] == pytest.approx(2 * psi + (L * 2 * s * b * h + layer if
                                                          o["offload: host"]["recompute"] else L * layer), rel=1e-12)
    assert o["offload: SSD"]["disk"] == 12 * psi and o["offload: SSD"]["host"] == 4 * psi
