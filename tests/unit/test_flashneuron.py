"""FlashNeuron (course_lib.memopt.offload.flashneuron): activations of chosen blocks to the SSD tier's files and
back; bytes per step, the gradients (exact for 'raw', bitwise the in-memory rounding for 'bf16', whose error is
bounded per element), the selection and the bad inputs (docs/formulas.md §14.3–14.5)."""
import os
import stat

import pytest
import torch

from course_lib.core.model import GPT, block_activation_bytes, get_config
from course_lib.memopt.offload import OffloadDiskError
from course_lib.memopt.offload import flashneuron as FN

CFG = get_config("nano")
B = 2


def _batch():
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, 256, (B, CFG.seq_len), generator=g), torch.randint(0, 256, (B, CFG.seq_len), generator=g))


def _grads(model, batch, hook=None):
    _, loss = model(*batch)
    loss.backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("codec", ["raw", "bf16"])
def test_bytes_written_and_read_equal_the_formula_and_gradients_match(codec, tmp_path):
    batch = _batch()
    ref = GPT(CFG, seed=0)
    rounding = FN.RoundedInMemory(ref, [0, 1]) if codec == "bf16" else None
    want = _grads(ref, batch)
    if rounding:
        rounding.close()
    model = GPT(CFG, seed=0)
    with FN.FlashNeuronOffload(model, [0, 1], codec=codec, directory=tmp_path) as fn:
        got = _grads(model, batch)
        n = FN.flashneuron_bytes(CFG, B, 2, codec)
        assert fn.log.bytes_sent(op="write") == n and fn.log.bytes_recv(op="read") == n
        assert fn.files.files == []                       # every file was read back and removed
        assert all(fn.errors) and (codec == "raw") == (not fn.errors)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert os.listdir(tmp_path) == []


def test_the_bf16_bound_holds_and_is_tight_enough_to_fail():
    x = torch.randn(10_000) * 10.0 ** torch.randint(-30, 30, (10_000,)).float()
    y = x.to(torch.bfloat16).float()
    assert FN.bf16_error_ok(x, y)
    assert not FN.bf16_error_ok(x, y * (1 + 2.0 ** -6))


def test_a_disk_that_fills_mid_step_leaves_no_files_and_the_model_untouched(tmp_path):
    model = GPT(CFG, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    quota = FN.flashneuron_bytes(CFG, B, 2) // 2          # room for about one of the two blocks
    fn = FN.FlashNeuronOffload(model, [0, 1], directory=tmp_path, quota=quota)
    with pytest.raises(OffloadDiskError, match="is full") as err:
        model(*_batch())
    assert "\n" not in str(err.value)
    fn.close()
    assert os.listdir(tmp_path) == []
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_missing_or_read_only_directory_is_one_clear_error(tmp_path):
    with pytest.raises(OffloadDiskError, match="cannot create"):
        FN.ActivationFiles(directory=tmp_path / "missing")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user who can write anywhere")
        with pytest.raises(OffloadDiskError, match="cannot create"):
            FN.ActivationFiles(directory=ro)
        assert os.listdir(ro) == []
    finally:
        ro.chmod(stat.S_IRWXU)


def test_selection_offloads_the_first_blocks_until_the_rest_fit_and_models_the_disk():
    a = [100] * 4
    sel = FN.select_offload(a, [1.0] * 4, [2.0] * 4, write_bw=100.0, read_bw=100.0, room=200)
    assert sel.layers == [0, 1] and sel.kept_bytes == 200 and sel.fits
    assert sel.write_exposed == 0.0 and sel.read_exposed == 0.0
    slow = FN.select_offload(a, [1.0] * 4, [2.0] * 4, write_bw=10.0, read_bw=10.0, room=200)
    # writes: block 0 from t=1 to 11, block 1 from 11 to 21; the forward ends at 4 → 17 s exposed
    assert slow.write_exposed == pytest.approx(17.0)
    # reads start with backward: block 1 by t=10 (due at 4), block 0 by 20 (due at 6)
    assert slow.read_exposed == pytest.approx(14.0)


def test_gds_has_no_host_copy_and_no_cpu_on_the_data_path():
    c = FN.storage_path_costs(1e9, disk_bw=3e9, host_copy_bw=10e9)
    assert c["GPUDirect Storage"]["copies"] == 0 and not c["GPUDirect Storage"]["cpu_on_data_path"]
    assert c["GPUDirect Storage"]["host_memory_bytes"] == 0 and c["GPUDirect Storage"]["cpu_seconds"] == 0
    assert c["bounce (buffered)"]["copies"] == 2 and c["bounce (buffered)"]["cpu_seconds"] == pytest.approx(0.1)
    assert c["bounce (buffered)"]["host_memory_bytes"] == 4e9 and c["bounce (O_DIRECT)"]["host_memory_bytes"] == 2e9
    assert c["GPUDirect Storage"]["seconds"] == pytest.approx(1e9 / 3e9)
    assert c["bounce (O_DIRECT)"]["seconds"] > c["GPUDirect Storage"]["seconds"]


def test_block_bytes_formula_counts_the_mask_raw():
    T = CFG.seq_len
    assert FN.flashneuron_bytes(CFG, B, 1, "bf16") == (block_activation_bytes(CFG, B) - T * T) // 2 + T * T
