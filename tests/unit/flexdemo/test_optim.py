"""DeMoSGD / DecoupledAdamW in one process: semantics against hand computations, state, errors, DTensor shards."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from lightning_hetero.flexdemo.optim import DecoupledAdamW, DeMoSGD
from lightning_hetero.replication import build_replicator
from lightning_hetero.replication.transforms import ChunkedDCT


def _param(
    *shape: int, seed: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | None = None
) -> torch.nn.Parameter:
    """Seeded on the CPU generator, then moved: the same values on every device."""
    return torch.nn.Parameter(
        torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)
    )


def test_weight_decay_works_and_is_decoupled(device: torch.device) -> None:
    # The anchor's DeToSGD raised AttributeError for its weight decay; here a zero gradient leaves only the decay.
    p = _param(4, 4, device=device)
    start = p.detach().clone()
    optimizer = DeMoSGD([p], lr=0.1, weight_decay=0.5)
    p.grad = torch.zeros_like(p)
    optimizer.step()
    assert torch.equal(p.detach(), start * (1 - 0.1 * 0.5))


def test_demo_sgd_single_replica_matches_hand_computation(device: torch.device) -> None:
    """n = 1: delta = beta*delta + lr*g; u = IDCT(topk(DCT(delta))); delta -= u; p -= lr*sign(u). Momentum is kept
    (the anchor's R == 1 path dropped it)."""
    p = _param(8, 8, device=device)
    start = p.detach().clone()
    optimizer = DeMoSGD([p], lr=0.01, momentum=0.9, kept_fraction=1 / 16, chunk=4)
    dct = ChunkedDCT(4)
    delta = torch.zeros(8, 8, device=device)
    expected = start.clone()
    for step in range(3):
        grad = torch.randn(8, 8, generator=torch.Generator().manual_seed(10 + step)).to(device)
        p.grad = grad.clone()
        optimizer.step()
        delta = 0.9 * delta + 0.01 * grad
        coefficients = dct.encode(delta)
        top = coefficients.abs().argmax(dim=1, keepdim=True)  # k = 1 of 16
        sent = torch.zeros_like(coefficients).scatter_(1, top, coefficients.gather(1, top))
        update = dct.decode(sent, (8, 8))
        delta = delta - update
        expected = expected - 0.01 * torch.sign(update)
    assert torch.allclose(p.detach(), expected, atol=1e-7)
    assert torch.allclose(optimizer.state[p]["delta"], delta, atol=1e-7)  # state lives on the parameter's device
    assert optimizer.state[p]["delta"].abs().sum() > 0


def test_full_decoupled_adamw_equals_torch_adamw_single_process(device: torch.device) -> None:
    ours, theirs = _param(5, 3, device=device), _param(5, 3, device=device)
    optimizer = DecoupledAdamW([ours], lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    reference = torch.optim.AdamW([theirs], lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    for step in range(10):
        grad = torch.randn(5, 3, generator=torch.Generator().manual_seed(step)).to(device)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        optimizer.step()
        reference.step()
    assert torch.allclose(ours, theirs, atol=1e-6, rtol=0)


def _adam_reference_step(
    param: torch.Tensor, grad: torch.Tensor, moments: dict[str, torch.Tensor], step: int, lr: float, wd: float
) -> torch.Tensor:
    """torch.optim.AdamW's formula (betas 0.9/0.999, eps 1e-8) written out, on ``grad``."""
    moments["m"] = 0.9 * moments["m"] + 0.1 * grad
    moments["v"] = 0.999 * moments["v"] + 0.001 * grad * grad
    direction = (moments["m"] / (1 - 0.9**step)) / ((moments["v"] / (1 - 0.999**step)).sqrt() + 1e-8)
    return param * (1 - lr * wd) - lr * direction


def test_gradient_exchange_single_replica_matches_hand_computation(device: torch.device) -> None:
    """exchange="gradient": e += g; u = IDCT(topk(DCT(e))); e -= u; then AdamW on u (moments from u, not from g)."""
    p = _param(8, 8, device=device)
    optimizer = DecoupledAdamW(
        [p], lr=0.01, weight_decay=0.1, exchange="gradient", replicator="demo", kept_fraction=1 / 16, chunk=4
    )
    dct = ChunkedDCT(4)
    error = torch.zeros(8, 8, device=device)
    moments = {"m": torch.zeros(8, 8, device=device), "v": torch.zeros(8, 8, device=device)}
    expected = p.detach().clone()
    for step in range(1, 4):
        grad = torch.randn(8, 8, generator=torch.Generator().manual_seed(20 + step)).to(device)
        p.grad = grad.clone()
        optimizer.step()
        error = error + grad
        coefficients = dct.encode(error)
        top = coefficients.abs().argmax(dim=1, keepdim=True)  # k = 1 of 16
        update = dct.decode(torch.zeros_like(coefficients).scatter_(1, top, coefficients.gather(1, top)), (8, 8))
        error = error - update
        expected = _adam_reference_step(expected, update, moments, step, lr=0.01, wd=0.1)
    assert torch.allclose(p.detach(), expected, atol=1e-6)
    assert torch.allclose(optimizer.state[p]["error"], error, atol=1e-6)
    assert torch.allclose(optimizer.state[p]["exp_avg"], moments["m"], atol=1e-6)  # moments of u, not of g


@pytest.mark.parametrize("exchange", ["preconditioned", "direction"])
def test_contribution_weight_survives_the_normalized_exchanges(device: torch.device, exchange: str) -> None:
    """A batch share scales the loss by w = W n_r / N; the local second moment cancels that scale, so what enters the
    error-feedback buffer must carry w again: buffer(w g, weight w) == w * buffer(g, weight 1) ."""
    optimizers = []
    for scale in (1.0, 0.625):
        p = _param(8, 8, device=device)
        # random selection: linear in the buffer and free of top-k ties that a rescale could flip
        optimizer = DecoupledAdamW([p], lr=0.01, exchange=exchange, replicator="random", kept_fraction=1 / 4)
        optimizer.contribution_weight = scale
        for step in range(1, 4):
            p.grad = scale * torch.randn(8, 8, generator=torch.Generator().manual_seed(50 + step)).to(device)
            optimizer.step()
        optimizers.append((p, optimizer))
    (p1, plain), (p2, weighted) = optimizers
    assert torch.allclose(weighted.state[p2]["error"], 0.625 * plain.state[p1]["error"], atol=1e-5)
    assert not torch.allclose(weighted.state[p2]["error"], plain.state[p1]["error"], atol=1e-2)


def test_preconditioned_exchange_single_replica_matches_hand_computation(device: torch.device) -> None:
    """exchange="preconditioned": p = g / (sqrt(v_hat) + eps); e += p; u = IDCT(topk(DCT(e))); e -= u; theta -= lr u.
    No first moment besides the buffer: beta1 is not used (0.0 and 0.9 give the same run)."""
    runs = []
    for beta1 in (0.9, 0.0):
        p = _param(8, 8, device=device)
        optimizer = DecoupledAdamW(
            [p],
            lr=0.01,
            betas=(beta1, 0.99),
            weight_decay=0.1,
            exchange="preconditioned",
            replicator="demo",
            kept_fraction=1 / 16,
            chunk=4,
        )
        for step in range(1, 4):
            p.grad = torch.randn(8, 8, generator=torch.Generator().manual_seed(30 + step)).to(device)
            optimizer.step()
        runs.append((p.detach().clone(), optimizer))
    assert torch.equal(runs[0][0], runs[1][0])
    assert "exp_avg" not in runs[0][1].state[next(iter(runs[0][1].state))]
    dct, error, v = ChunkedDCT(4), torch.zeros(8, 8, device=device), torch.zeros(8, 8, device=device)
    expected = _param(8, 8, device=device).detach().clone()
    for step in range(1, 4):
        grad = torch.randn(8, 8, generator=torch.Generator().manual_seed(30 + step)).to(device)
        v = 0.99 * v + 0.01 * grad * grad
        error = error + grad / ((v / (1 - 0.99**step)).sqrt() + 1e-8)
        coefficients = dct.encode(error)
        top = coefficients.abs().argmax(dim=1, keepdim=True)
        update = dct.decode(torch.zeros_like(coefficients).scatter_(1, top, coefficients.gather(1, top)), (8, 8))
        error = error - update
        expected = expected * (1 - 0.01 * 0.1) - 0.01 * update
    assert torch.allclose(runs[0][0], expected, atol=1e-6)


def test_gradient_exchange_keeping_everything_equals_torch_adamw(device: torch.device) -> None:
    ours, theirs = _param(6, 4, device=device), _param(6, 4, device=device)
    optimizer = DecoupledAdamW(
        [ours], lr=0.01, weight_decay=0.1, exchange="gradient", replicator="topk", kept_fraction=1.0
    )
    reference = torch.optim.AdamW([theirs], lr=0.01, weight_decay=0.1)
    for step in range(8):
        grad = torch.randn(6, 4, generator=torch.Generator().manual_seed(step)).to(device)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        optimizer.step()
        reference.step()
    assert torch.allclose(ours, theirs, atol=1e-6, rtol=0)
    assert optimizer.state[ours]["error"].abs().max() == 0  # everything was sent


def test_exchange_mode_must_match_on_resume() -> None:
    p = _param(4, 4)
    trained = DecoupledAdamW([p], replicator="random", kept_fraction=0.5, exchange="gradient")
    p.grad = torch.ones(4, 4)
    trained.step()
    state = copy.deepcopy(trained.state_dict())
    with pytest.raises(ValueError, match=r"exchange='gradient'.*adamw_exchange"):
        DecoupledAdamW([p], replicator="random", kept_fraction=0.5).load_state_dict(state)  # default: preconditioned
    same = DecoupledAdamW([p], replicator="random", kept_fraction=0.5, exchange="gradient")
    same.load_state_dict(state)
    assert torch.equal(same.state[p]["error"], trained.state[p]["error"])
    # A checkpoint from before the setting existed (0.1) was taken in direction mode.
    for group in state["param_groups"]:
        del group["exchange"]
    with pytest.raises(ValueError, match="exchange='direction'"):
        DecoupledAdamW([p], replicator="random", kept_fraction=0.5).load_state_dict(state)
    DecoupledAdamW([p], replicator="random", kept_fraction=0.5, exchange="direction").load_state_dict(state)
    # Full ignores the exchange: a 0.1 Full checkpoint resumes under the new default.
    full = DecoupledAdamW([p], replicator="full")
    full.step()
    old_full = copy.deepcopy(full.state_dict())
    for group in old_full["param_groups"]:
        del group["exchange"]
    DecoupledAdamW([p], replicator="full").load_state_dict(old_full)


def test_exchange_mode_is_checked() -> None:
    with pytest.raises(ValueError, match="exchange must be one of"):
        DecoupledAdamW([_param(3)], exchange="moments")  # type: ignore[arg-type]


def test_defaults() -> None:
    p = _param(3)
    assert DeMoSGD([p]).replicator.name == "demo" and DeMoSGD([p]).defaults["sign"] is True
    adamw = DecoupledAdamW([p])
    assert adamw.replicator.name == "full" and adamw.defaults["sign"] is False
    assert DecoupledAdamW([p], replicator="random", kept_fraction=0.5).replicator.kept_fraction == 0.5


def test_bf16_params_keep_fp32_state(device: torch.device) -> None:
    p = _param(6, 5, dtype=torch.bfloat16, device=device)
    for optimizer in (DeMoSGD([p], replicator="demo", chunk=4), DecoupledAdamW([p], replicator="random")):
        p.grad = torch.randn(6, 5).to(device=device, dtype=torch.bfloat16)
        optimizer.step()
        assert p.dtype == torch.bfloat16
        assert all(v.dtype == torch.float32 and v.device == device for v in optimizer.state[p].values() if v.dim())
        restored = type(optimizer)([p], replicator=optimizer.replicator.name)
        restored.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        assert all(v.dtype == torch.float32 for v in restored.state[p].values() if v.dim())  # torch would cast


def test_state_dict_carries_replicator_state() -> None:
    p = _param(4)
    optimizer = DecoupledAdamW([p], replicator="diloco", sync_every=2)
    for _ in range(3):
        p.grad = torch.ones(4)
        optimizer.step()
    state = optimizer.state_dict()
    assert state["replicator"]["name"] == "diloco" and state["replicator"]["step"] == 3
    assert state["replicator"]["syncs"] == 1 and set(state["replicator"]["anchors"]) == {0}
    with pytest.raises(ValueError, match="Checkpoint holds state of replicator 'diloco'"):
        DecoupledAdamW([p], replicator="full").load_state_dict(state)
    with pytest.raises(ValueError, match="parameter groups do not match"):
        DecoupledAdamW([p, _param(2)], replicator="diloco").load_state_dict(state)


def test_closure_and_missing_gradients(device: torch.device) -> None:
    used, unused = _param(3, 3, device=device), _param(2, device=device)
    optimizer = DeMoSGD([used, unused], lr=0.1, kept_fraction=0.5)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = used.sum() ** 2
        loss.backward()
        return loss

    before = unused.detach().clone()
    loss = optimizer.step(closure)
    assert isinstance(loss, torch.Tensor)
    assert torch.equal(unused.detach(), before)  # no gradient counts as zero: sign(0) = 0, no decay configured


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda p: DeMoSGD(p, lr=-1.0), "lr must be >= 0.0"),
        (lambda p: DeMoSGD(p, momentum=1.0), "momentum must be >= 0.0 and < 1.0"),
        (lambda p: DeMoSGD(p, weight_decay=-0.1), "weight_decay must be >= 0.0"),
        (lambda p: DecoupledAdamW(p, betas=(0.9, 1.0)), r"betas\[1\] must be"),
        (lambda p: DeMoSGD(p, replicator="nope"), "replicator must be one of"),
        (lambda p: DeMoSGD(p, kept_fraction=0.0), r"kept_fraction must be a number in \(0, 1\]"),
        (lambda p: DeMoSGD(p, chunk=1000), r"chunk must be an integer in \[1, 256\]"),
        (lambda p: DeMoSGD(p, chunk=128, index_bits=12), "index_bits=12 cannot address chunk=128"),
        (lambda p: DeMoSGD(p, replicator=build_replicator("demo"), chunk=4), "were given with a ready-built"),
    ],
)
def test_bad_arguments(factory: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        factory([_param(2)])  # type: ignore[operator]


def test_launch_errors() -> None:
    p, q = _param(3), _param(3)
    optimizer = DeMoSGD([p], kept_fraction=0.5)
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="not in this optimizer"):
        optimizer.launch([q])
    optimizer.launch([p])
    with pytest.raises(RuntimeError, match="already launched"):
        optimizer.launch([p])
    optimizer.step()
    assert optimizer.comm_stats()["launched_early"] == 1


def test_unbound_step_in_a_multi_rank_world_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    p = _param(3)
    p.grad = torch.ones(3)
    optimizer = DeMoSGD([p], kept_fraction=0.5)
    with pytest.warns(UserWarning, match=r"before bind\(\): running as a single replica"):
        optimizer.step()


def test_dtensor_parameters_update_their_local_shard() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    plain = _param(6, 4)
    sharded = torch.nn.Parameter(distribute_tensor(plain.detach().clone(), mesh, [Shard(0)]))
    grad = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    plain.grad = grad.clone()
    sharded.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
    for cls in (DeMoSGD, DecoupledAdamW):
        reference_param = plain.detach().clone().requires_grad_(True)
        reference_param.grad = grad.clone()
        reference = cls([reference_param], lr=0.1, replicator="demo", chunk=4)
        ours = cls([sharded], lr=0.1, replicator="demo", chunk=4)
        ours.bind(None)
        start = sharded.to_local().clone()
        reference.step()
        ours.step()
        assert not torch.equal(sharded.to_local(), start)
        assert torch.equal(sharded.to_local(), reference_param.detach())
        with torch.no_grad():
            sharded.to_local().copy_(plain.detach())


def test_replicator_cannot_be_shared_between_optimizers() -> None:
    replicator = build_replicator("demo")
    DeMoSGD([torch.nn.Parameter(torch.zeros(2))], replicator=replicator)
    with pytest.raises(ValueError, match="already used by another optimizer"):
        DeMoSGD([torch.nn.Parameter(torch.zeros(2))], replicator=replicator)
