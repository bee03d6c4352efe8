"""FlexDeMo replicators and optimizers on spawned gloo groups (2 and 4 ranks; the world stands for the replicate group).

One launch per world size runs every check (spawning costs seconds on this box); the module fixture keeps the
per-rank results and each test asserts one family of them:

- replicas bit-identical after 20 steps for every replicator with both optimizers (different data per rank);
- exact ledger payload (label "inter") against ``Replicator.payload_bytes`` for every replicator and value encoding;
- DeMo against an independent numpy/scipy re-implementation simulating all replicas in-process;
- Full + DecoupledAdamW against ``torch.optim.AdamW`` on the mean gradient (1e-6 after 10 steps), and the same for
  DecoupledAdamW(exchange="gradient") with a top-k replicator that keeps every value;
- DiLoCo against a hand-written simulation of n local AdamW replicas plus outer Nesterov, bytes only every H steps
  (DeMo + DiLoCo keeping every DCT coefficient against the same simulation);
- state_dict round trip through ``torch.save``: bit-identical continuation;
- launching buckets early gives bit-identical results to the step-only path.
"""

from __future__ import annotations

import functools
import hashlib
import io
from typing import Any

import numpy as np
import pytest
import scipy.fft
import torch
import torch.distributed as dist

from lightning_hetero import comm
from lightning_hetero.flexdemo.optim import DecoupledAdamW, DeMoSGD
from lightning_hetero.replication import build_replicator
from lightning_hetero.testing import run_distributed

pytestmark = pytest.mark.timeout(300)

SHAPES = [(10, 6), (10,), (3, 10), (2, 3, 5), (0, 4)]  # matrix, vector, matrix, 3-D, empty (never gets a gradient)
LR = 0.01
OPTIONS: dict[str, dict[str, Any]] = {
    "demo": {"chunk": 4},
    "topk": {"chunk": 2},
    "random": {"seed": 7},
    "striding": {},
    "full": {},
    "diloco": {"sync_every": 4, "outer_lr": 0.8, "outer_momentum": 0.5},
    # DeMo + DiLoCo: the synchronising step sends the delta's DCT top-k (error feedback across periods)
    "diloco-demo": {
        "sync_every": 4,
        "outer_lr": 0.8,
        "outer_momentum": 0.5,
        "outer_kept_fraction": 0.25,
        "outer_chunk": 4,
    },
}
COMPRESSION = 0.25
OPTIMIZERS = {
    "sgd": DeMoSGD,
    "adamw": DecoupledAdamW,  # exchange="preconditioned" (the default): the error-feedback buffer is the first moment
    "adamw-gradient": functools.partial(DecoupledAdamW, exchange="gradient"),  # Adam after the exchange
    "adamw-direction": functools.partial(DecoupledAdamW, exchange="direction"),  # local Adam's direction (0.1)
}


# ----------------------------------------------------------------------------------------------- model + data
def _init_params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator) * 0.4) for shape in SHAPES]


def _batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * replica + step)
    return torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)


def _loss(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    w1, b1, w2, t, _ = params
    out = torch.tanh(x @ w1.T + b1) @ w2.T + x[:, :5] @ t.sum(0).T
    return (out - y).pow(2).mean()


def _grads(params: list[torch.Tensor], replica: int, step: int) -> list[torch.Tensor | None]:
    leaves = [p.detach().clone().requires_grad_(True) for p in params]
    _loss(leaves, *_batch(replica, step)).backward()
    return [leaf.grad for leaf in leaves]


def _backward(params: list[torch.nn.Parameter], replica: int, step: int) -> None:
    for p in params:
        p.grad = None
    _loss(params, *_batch(replica, step)).backward()


def _digest(params: list[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for p in params:
        digest.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _make(kind: str, name: str, params: list[torch.nn.Parameter], **extra: Any) -> Any:
    options = {**OPTIONS[name], **extra}
    kwargs = {"lr": LR} if kind == "sgd" else {"lr": LR, "weight_decay": 0.1}
    if kind == "sgd":
        kwargs["weight_decay"] = 0.05
    replicator = name.partition("-")[0]  # "diloco-demo" is the diloco replicator with outer_kept_fraction
    options.setdefault("kept_fraction", COMPRESSION)
    optimizer = OPTIMIZERS[kind](params, replicator=replicator, **kwargs, **options)
    optimizer.bind(dist.group.WORLD)
    return optimizer


def _train(optimizer: Any, params: list[torch.nn.Parameter], rank: int, steps: range, buckets: Any = None) -> None:
    for step in steps:
        _backward(params, rank, step)
        for bucket in buckets or []:
            optimizer.launch([params[i] for i in bucket])
        optimizer.step()


# -------------------------------------------------------------------------------------- independent references
def _blocks(x: np.ndarray, chunk: int) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    matrix = x.reshape(1, -1) if x.ndim == 1 else x.reshape(x.shape[0], -1)
    rows, cols = matrix.shape
    br, bc = min(chunk, rows), min(chunk, cols)
    padded = np.zeros((-(-rows // br) * br, -(-cols // bc) * bc))
    padded[:rows, :cols] = matrix
    out = [
        scipy.fft.dctn(padded[r : r + br, c : c + bc], norm="ortho").reshape(-1)
        for r in range(0, padded.shape[0], br)
        for c in range(0, padded.shape[1], bc)
    ]
    return np.stack(out), (rows, cols, br, bc)


def _unblocks(coefficients: np.ndarray, geometry: tuple[int, int, int, int], shape: tuple[int, ...]) -> np.ndarray:
    rows, cols, br, bc = geometry
    grid_cols = -(-cols // bc)
    padded = np.zeros((-(-rows // br) * br, grid_cols * bc))
    for i, row in enumerate(coefficients):
        r, c = divmod(i, grid_cols)
        padded[r * br : (r + 1) * br, c * bc : (c + 1) * bc] = scipy.fft.idctn(row.reshape(br, bc), norm="ortho")
    return padded[:rows, :cols].reshape(shape)


def _reference_demo(n: int, steps: int, beta: float, chunk: int, combine: str, sign: bool) -> list[torch.Tensor]:
    """Straightforward DeMo on n simulated replicas: numpy float64 state, scipy DCT, argsort top-k."""
    params = [p.detach().clone() for p in _init_params()]
    deltas = [[np.zeros(s) for s in SHAPES] for _ in range(n)]
    for step in range(steps):
        grads = [_grads(params, r, step) for r in range(n)]
        for i, shape in enumerate(SHAPES):
            if not np.prod(shape):
                continue
            total, picks, geometry = None, None, None
            for r in range(n):
                g = grads[r][i]
                deltas[r][i] = beta * deltas[r][i] + LR * (0.0 if g is None else g.double().numpy())
                coefficients, geometry = _blocks(deltas[r][i], chunk)
                k = max(1, int(COMPRESSION * coefficients.shape[1] + 1e-9))
                chosen = np.argsort(-np.abs(coefficients), axis=1, kind="stable")[:, :k]
                sent = np.zeros_like(coefficients)
                np.put_along_axis(sent, chosen, np.take_along_axis(coefficients, chosen, axis=1), axis=1)
                mask = np.zeros_like(coefficients)
                np.put_along_axis(mask, chosen, 1.0, axis=1)
                deltas[r][i] = deltas[r][i] - _unblocks(sent, geometry, shape)
                total = sent if total is None else total + sent
                picks = mask if picks is None else picks + mask
            combined = total / n if combine == "mean" else total / np.maximum(picks, 1)
            update = _unblocks(combined, geometry, shape)
            update = np.sign(update) if sign else update
            params[i] = (params[i].double() - LR * torch.from_numpy(update)).float()
    return params


def _reference_adamw_mean(n: int, steps: int) -> list[torch.Tensor]:
    params = [p.detach().clone().requires_grad_(True) for p in _init_params()]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.1)
    for step in range(steps):
        grads = [_grads(params, r, step) for r in range(n)]
        for i, p in enumerate(params):
            present = [g[i] for g in grads if g[i] is not None]
            p.grad = torch.stack(present).sum(0) / n if present else torch.zeros_like(p)
        optimizer.step()
    return [p.detach() for p in params]


def _reference_diloco(n: int, steps: int, rank: int) -> list[torch.Tensor]:
    """n replicas with local torch AdamW; every H steps the outer Nesterov step on the mean delta (by hand)."""
    h, outer_lr, mu = (
        OPTIONS["diloco"]["sync_every"],
        OPTIONS["diloco"]["outer_lr"],
        OPTIONS["diloco"]["outer_momentum"],
    )
    replicas = [[p.detach().clone().requires_grad_(True) for p in _init_params()] for _ in range(n)]
    inner = [torch.optim.AdamW(ps, lr=LR, weight_decay=0.1) for ps in replicas]
    anchor = [p.detach().clone() for p in replicas[0]]
    momentum: list[torch.Tensor | None] = [None] * len(SHAPES)
    for step in range(steps):
        for r in range(n):
            grads = _grads(replicas[r], r, step)
            for p, g in zip(replicas[r], grads, strict=True):
                p.grad = torch.zeros_like(p) if g is None else g
            inner[r].step()
        if (step + 1) % h == 0:
            with torch.no_grad():
                for i in range(len(SHAPES)):
                    delta = sum(anchor[i] - replicas[r][i] for r in range(n)) / n
                    momentum[i] = delta.clone() if momentum[i] is None else mu * momentum[i] + delta
                    new = anchor[i] - outer_lr * (delta + mu * momentum[i])
                    for r in range(n):
                        replicas[r][i].copy_(new)
                    anchor[i] = new.clone()
    return [p.detach() for p in replicas[rank]]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x.double() - y.double()).abs().max().item() if x.numel() else 0.0) for x, y in zip(a, b, strict=True))


# ------------------------------------------------------------------------------------------------ child process
def _step_payload(optimizer: Any, params: list[torch.nn.Parameter], rank: int, step: int) -> tuple[int, int, int]:
    """(ledger payload of label inter, inter calls, analytic payload_bytes) of one step."""
    _backward(params, rank, step)
    with comm.get_ledger().capture() as seen:
        optimizer.step()
    records = [record for record in seen.records() if record.label == comm.INTER]
    return sum(r.payload_bytes for r in records), len(records), optimizer.replicator.payload_bytes(SHAPES)


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    out: dict[str, Any] = {"identical": {}, "ledger": {}, "resume": {}, "launch": {}}

    for name in OPTIONS:  # replicas bit-identical after 20 steps
        for kind in OPTIMIZERS:
            params = _init_params()
            optimizer = _make(kind, name, params)
            _train(optimizer, params, rank, range(20))
            out["identical"][f"{name}-{kind}"] = (_digest(params), _digest(_init_params()))

    for name in OPTIONS:  # exact ledger bytes, every value encoding
        for values in ("fp32", "bf16", "sign", "ternary"):
            params = _init_params()
            optimizer = _make("sgd", name, params, values=values)
            steps = OPTIONS["diloco"]["sync_every"] if name.startswith("diloco") else 2
            out["ledger"][f"{name}-{values}"] = [_step_payload(optimizer, params, rank, s) for s in range(steps)]
    for bits in (12, 16):
        params = _init_params()
        optimizer = _make("sgd", "demo", params, index_bits=bits, values="sign")
        out["ledger"][f"demo-sign-{bits}bit"] = [_step_payload(optimizer, params, rank, 0)]

    for combine in ("mean", "pickers"):  # DeMo against the independent simulation
        for sign in (True, False):
            params = _init_params()
            optimizer = DeMoSGD(
                params,
                lr=LR,
                momentum=0.9,
                sign=sign,
                replicator="demo",
                kept_fraction=COMPRESSION,
                chunk=4,
                combine=combine,
            )
            optimizer.bind(dist.group.WORLD)
            _train(optimizer, params, rank, range(6))
            reference = _reference_demo(world_size, 6, 0.9, 4, combine, sign)
            out[f"demo-reference-{combine}-{sign}"] = _max_diff(params, reference)

    params = _init_params()  # Full + DecoupledAdamW == torch AdamW on the mean gradient
    optimizer = DecoupledAdamW(params, lr=LR, weight_decay=0.1, replicator="full")
    optimizer.bind(dist.group.WORLD)
    _train(optimizer, params, rank, range(10))
    out["adamw-full"] = _max_diff(params, _reference_adamw_mean(world_size, 10))
    params = _init_params()  # exchange="gradient" keeping every value: the same torch AdamW on the mean gradient
    optimizer = _make("adamw-gradient", "topk", params, kept_fraction=1.0)
    _train(optimizer, params, rank, range(10))
    out["adamw-gradient-keep-all"] = _max_diff(params, _reference_adamw_mean(world_size, 10))

    params = _init_params()  # DiLoCo against the hand-written outer Nesterov
    optimizer = _make("adamw", "diloco", params)
    _train(optimizer, params, rank, range(6))
    out["diloco-mid-cycle"] = _max_diff(params, _reference_diloco(world_size, 6, rank))
    _train(optimizer, params, rank, range(6, 8))
    out["diloco-synced"] = _max_diff(params, _reference_diloco(world_size, 8, rank))
    params = _init_params()  # DeMo + DiLoCo keeping every DCT coefficient: the same outer steps (DCT round trip)
    optimizer = _make("adamw", "diloco-demo", params, outer_kept_fraction=1.0)
    _train(optimizer, params, rank, range(8))
    out["diloco-demo-keep-all"] = _max_diff(params, _reference_diloco(world_size, 8, rank))

    for name in OPTIONS:  # resume through torch.save: bit-identical continuation
        for kind in OPTIMIZERS:
            params = _init_params()
            optimizer = _make(kind, name, params)
            _train(optimizer, params, rank, range(10))
            straight = _digest(params)
            params = _init_params()
            optimizer = _make(kind, name, params)
            _train(optimizer, params, rank, range(5))
            buffer = io.BytesIO()
            torch.save({"params": [p.detach() for p in params], "optimizer": optimizer.state_dict()}, buffer)
            buffer.seek(0)
            saved = torch.load(buffer, weights_only=False)
            params = _init_params(seed=123)
            with torch.no_grad():
                for p, value in zip(params, saved["params"], strict=True):
                    p.copy_(value)
            optimizer = _make(kind, name, params)
            optimizer.load_state_dict(saved["optimizer"])
            _train(optimizer, params, rank, range(5, 10))
            out["resume"][f"{name}-{kind}"] = (straight, _digest(params))

    for name in ("demo", "random", "topk", "full"):  # launch early in two buckets == step only
        for values in ("fp32", "sign"):
            digests = []
            for buckets in (None, [[2, 3], [0], [1, 4]]):
                params = _init_params()
                optimizer = _make("sgd", name, params, values=values)
                _train(optimizer, params, rank, range(6), buckets)
                digests.append(_digest(params))
            stats = optimizer.comm_stats()
            out["launch"][f"{name}-{values}"] = (digests, stats["launched_early"], stats["buckets"])
    return out


# 4 ranks (pytest -m heavy) adds nothing the 2-rank run does not exercise but the number of replicas.
@pytest.fixture(
    scope="module", params=[2, pytest.param(4, marks=[pytest.mark.slow, pytest.mark.heavy])], ids=["2ranks", "4ranks"]
)
def results(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    return request.param, run_distributed(_worker, request.param, timeout=240)


# ------------------------------------------------------------------------------------------------------ tests
def test_replicas_bit_identical_after_20_steps(results: tuple[int, list[dict[str, Any]]]) -> None:
    _, per_rank = results
    for case, (digest, initial) in per_rank[0]["identical"].items():
        assert digest != initial, f"{case}: parameters did not move"
        assert all(r["identical"][case][0] == digest for r in per_rank), f"{case}: replicas diverged"


def test_ledger_payload_matches_formula(results: tuple[int, list[dict[str, Any]]]) -> None:
    n, per_rank = results
    for rank_result in per_rank:
        for case, steps in rank_result["ledger"].items():
            for step, (payload, calls, analytic) in enumerate(steps):
                if case.startswith("diloco") and step < len(steps) - 1:
                    assert (payload, calls) == (0, 0), f"{case}: DiLoCo sent bytes on local step {step}"
                    continue
                assert calls == 1, f"{case}: expected one collective per step, got {calls}"
                assert payload == analytic > 0, f"{case} step {step}: ledger {payload} != formula {analytic}"


def test_payload_formulas_by_hand() -> None:
    # demo chunk 4, kept_fraction 1/4: (10, 6) -> 3 x 2 blocks of 16 (k=4): 24 coefficients; (10,) -> 3 chunks of 4
    # (k=1): 3; (3, 10) -> 1 x 3 blocks of 3x4 (k=3): 9; (2, 15) -> 1 x 4 blocks of 2x4 (k=2): 8; empty: 0.
    counts, rows = [24, 3, 9, 8], [6, 3, 3, 4]
    demo = build_replicator("demo", 0.25, chunk=4, values="bf16")
    assert demo.payload_bytes(SHAPES) == sum((3 * c + 1) // 2 + 2 * c for c in counts)
    demo_sign = build_replicator("demo", 0.25, chunk=4, values="sign", index_bits=16)
    assert demo_sign.payload_bytes(SHAPES) == sum(
        2 * c + (c + 7) // 8 + 4 * r for c, r in zip(counts, rows, strict=True)
    )
    random = build_replicator("random", 0.25)  # slots floor(N / 4): 15, 2, 7, 7
    assert random.payload_bytes(SHAPES) == 4 * (15 + 2 + 7 + 7)
    assert build_replicator("full", values="bf16").payload_bytes(SHAPES) == 2 * (60 + 10 + 30 + 30)


def test_demo_matches_independent_reimplementation(results: tuple[int, list[dict[str, Any]]]) -> None:
    _, per_rank = results
    for rank_result in per_rank:
        for key in [k for k in rank_result if k.startswith("demo-reference")]:
            assert rank_result[key] < 1e-6, f"{key}: max |param - reference| = {rank_result[key]}"


def test_full_decoupled_adamw_equals_torch_adamw_on_mean_gradient(results: tuple[int, list[dict[str, Any]]]) -> None:
    _, per_rank = results
    assert all(r["adamw-full"] < 1e-6 for r in per_rank), [r["adamw-full"] for r in per_rank]


def test_gradient_exchange_keeping_everything_equals_torch_adamw(results: tuple[int, list[dict[str, Any]]]) -> None:
    _, per_rank = results
    diffs = [r["adamw-gradient-keep-all"] for r in per_rank]
    assert all(diff < 1e-6 for diff in diffs), diffs


def test_diloco_matches_outer_nesterov_reference(results: tuple[int, list[dict[str, Any]]]) -> None:
    _, per_rank = results
    for rank_result in per_rank:
        assert rank_result["diloco-mid-cycle"] < 1e-6
        assert rank_result["diloco-synced"] < 1e-6
        assert rank_result["diloco-demo-keep-all"] < 1e-5


def test_resume_is_bit_identical(results: tuple[int, list[dict[str, Any]]]) -> None:
    _, per_rank = results
    for rank_result in per_rank:
        for case, (straight, resumed) in rank_result["resume"].items():
            assert straight == resumed, f"{case}: resumed run differs from the uninterrupted one"


def test_launch_early_equals_step_only(results: tuple[int, list[dict[str, Any]]]) -> None:
    _, per_rank = results
    for rank_result in per_rank:
        for case, (digests, launched_early, buckets) in rank_result["launch"].items():
            assert digests[0] == digests[1], f"{case}: early launch changed the result"
            assert (launched_early, buckets) == (5, 3), case
