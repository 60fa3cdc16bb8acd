"""2D (SUMMA), 2.5D (Tesseract) and 3D tensor parallelism on real gloo ranks: the three SUMMA forms equal torch.matmul;
a linear layer on each grid — 1D on 3 ranks, 2D on 2×2 and 3×3, 2.5D on 2×2×2, 3D on 2×2×2 — equals nn.Linear forward
and backward; every rank sends exactly `grid_bytes` and holds exactly `grid_memory`; a world that is not a square or a
cube is refused on every rank before any group is made."""
import pytest
import torch

from course_lib.distributed.launch import launch
from course_lib.memory import MemoryTracker
from course_lib.parallel.tensor import GridLinear, grid_bytes, grid_memory, make_grid, summa, summa_abt, summa_atb

pytestmark = pytest.mark.integration
E = 8


def _rand(*shape, seed):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _summa_forms(ctx):
    grid = make_grid(ctx.comm, "2D")
    block = lambda M: grid.piece(M, "output")          # noqa: E731  (block (i, j) of any matrix)
    P, Q = _rand(12, 8, seed=0), _rand(8, 16, seed=1)   # P·Q
    U, C = _rand(12, 16, seed=2), _rand(20, 16, seed=3)  # U·Cᵀ
    A, V = _rand(12, 8, seed=4), _rand(12, 16, seed=5)   # Aᵀ·V
    return {"A·B": (summa(grid, block(P), block(Q)) - block(P @ Q)).abs().max().item(),
            "A·Bᵀ": (summa_abt(grid, block(U), block(C)) - block(U @ C.T)).abs().max().item(),
            "Aᵀ·B": (summa_atb(grid, block(A), block(V)) - block(A.T @ V)).abs().max().item()}


def test_the_three_summa_forms_equal_torch_matmul_on_a_2x2_grid():
    for r in launch(_summa_forms, 4, timeout=60):
        assert max(r.values()) < 1e-13, r


def _linear(ctx, kind, depth, R, K, N):
    X, dY = _rand(R, K, seed=0), _rand(R, N, seed=1)
    linear = torch.nn.Linear(K, N, bias=False).double()
    with torch.no_grad():
        linear.weight.copy_(_rand(N, K, seed=2))
    ref_x = X.clone().requires_grad_(True)
    linear(ref_x).backward(dY)
    grid = make_grid(ctx.comm, kind, depth=depth)
    layer = GridLinear(linear, grid)
    x = grid.piece(X, "input").clone().requires_grad_(True)
    ctx.comm.ledger.reset()
    with MemoryTracker(timeline=False) as mem:
        mem.watch(layer)
        y = layer(x)
        held = {c: mem.current[c] for c in ("parameters", "activations")}
    y.backward(grid.piece(dY, "output"))
    return {"y": (y - grid.piece(X @ linear.weight.detach().T, "output")).abs().max().item(),
            "dx": (x.grad - grid.piece(ref_x.grad, "input")).abs().max().item(),
            "dw": (layer.weight.grad - grid.piece(linear.weight.grad.T, "weight")).abs().max().item(),
            "sent": ctx.comm.ledger.bytes_sent(), "held": held, "q": grid.q, "d": grid.d,
            "depth_rank": grid.coords.get("l", 0)}


@pytest.mark.parametrize("kind, P, depth, shape", [("1D", 3, 1, (12, 6, 9)), ("2D", 4, 1, (8, 12, 6)),
                                                   ("2D", 9, 1, (9, 6, 12)), ("2.5D", 8, 2, (8, 6, 4)),
                                                   ("3D", 8, 1, (8, 12, 6))])
def test_a_linear_layer_on_each_grid_equals_nn_linear_with_exact_bytes_and_memory(kind, P, depth, shape):
    R, K, N = shape
    for rank, r in enumerate(launch(_linear, P, kind, depth, R, K, N, timeout=120)):
        assert max(r["y"], r["dx"], r["dw"]) < 1e-13, (kind, rank, r)
        want = grid_bytes(kind, R, K, N, q=r["q"], d=r["d"], rank=rank if kind == "1D" else r["depth_rank"], elem=E)
        assert r["sent"] == want, (kind, rank)
        assert r["held"] == grid_memory(kind, R, K, N, q=r["q"], d=r["d"], elem=E)


def _bad_grid(ctx, kind):
    try:
        make_grid(ctx.comm, kind)
    except ValueError as e:
        return str(e), ctx.comm.ledger.bytes_sent()
    return None, 0


@pytest.mark.parametrize("kind, P, match", [("2D", 6, "square number of ranks"), ("3D", 4, "cube number of ranks")])
def test_a_world_that_is_not_a_square_or_a_cube_is_refused_on_every_rank(kind, P, match):
    for message, sent in launch(_bad_grid, P, kind, timeout=60):
        assert message is not None and match in message and sent == 0
