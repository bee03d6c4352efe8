"""``tiers: auto``: each rank probes its step time and peak memory per candidate tier before training.

:func:`probe_tiers` runs on one rank, on its own (no collective): for each candidate tier, narrowest first, it deep-
copies the full model, slices the copy to the tier (:func:`~lightning_hetero.matformer.slicing.slice_model`), and
times a whole training step on a probe batch (forward, backward and an AdamW step, so that gradients and both optimizer
moments count in the peak) with :func:`~lightning_hetero.hetero.measure.time_call`, reading the peak memory around it.

What the peak means: the probe holds the full original model besides its copy, which training will not (the original
is sliced in place at setup), so the *training* peak of a tier is the measured peak less the bytes of the original's
parameters and buffers. That is what :class:`~lightning_hetero.hetero.tier_choice.TierProbe` carries.

Never out of memory: before probing a wider tier, its peak is predicted from the narrower probes (linear in the FFN
width through the last two probes, and at least the last probe plus four times the added parameter bytes: weights,
gradients, two AdamW moments; from a single probe, that plus half again for activations; before the first probe,
what the process holds now plus four times the copy's bytes). A tier predicted over the
limit (the raw peak, original included, against the limit; or the training peak against the budget) is not probed and
reported with no numbers; wider tiers are not probed either.

The RNG state is restored afterwards (``torch.random.fork_rng``), so the probe does not shift training's randomness.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from lightning_hetero.core import all_gather_json
from lightning_hetero.hetero.measure import memory_limit_bytes, peak_memory_bytes, reset_peak_memory, time_call
from lightning_hetero.hetero.tier_choice import TierChoice, TierMeasurement, TierProbe, choose_tiers
from lightning_hetero.hetero.tier_settings import AutoTierSettings, expand_per_rank
from lightning_hetero.matformer.adapters import FFNBlock
from lightning_hetero.matformer.slicing import slice_model

__all__ = ["AUTO_DOCUMENT", "CHOICE_DOCUMENT", "ProbeStep", "choose_auto_tiers", "probe_tiers", "tensor_bytes"]

log = logging.getLogger(__name__)

AUTO_DOCUMENT: dict[str, type | tuple[type, ...]] = {
    "error": (str, type(None)),
    "measurement": (dict, type(None)),
    "seconds": (int, float),
}
"""What every rank sends after probing (checked by ``all_gather_json``): its error, measurement and probe seconds."""

CHOICE_DOCUMENT: dict[str, type | tuple[type, ...]] = {"error": (str, type(None)), "choice": (dict, type(None))}
"""What every rank sends after choosing: its choice (every rank must hold rank 0's), or the chooser's error."""


@dataclass(frozen=True)
class ProbeStep:
    """How to run one training step's loss on a copy of the model (given by the Lightning adapter).

    Attributes:
        loss: ``loss(copy)`` runs the forward on the probe batch and returns the scalar loss to backpropagate.
        copy: Makes the copy of the module to slice (default ``copy.deepcopy``; the Trainer adapter leaves the
            Trainer out of it).
        context: A context the step runs in (the precision plugin's autocast, for example).
    """

    loss: Callable[[nn.Module], Tensor]
    copy: Callable[[nn.Module], nn.Module] = copy.deepcopy
    context: Callable[[], AbstractContextManager] = field(default=nullcontext)


def tensor_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers (each tensor once)."""
    seen: dict[int, int] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        seen[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def probe_tiers(
    module: nn.Module,
    blocks: Sequence[FFNBlock],
    device: torch.device,
    settings: AutoTierSettings,
    step: ProbeStep,
    rank: int,
    limit: int | None,
    extra_state_per_parameter_byte: float = 0.0,
) -> TierMeasurement:
    """Measure this rank's step time and training peak at every candidate tier (narrowest first; see the module).

    Args:
        module: The full-width module (not changed).
        blocks: Its FFNs (``find_ffns(module)``).
        device: The rank's device.
        settings: The candidates, probe repeats and warm-up, and the memory headroom.
        step: How to compute the loss on a copy.
        rank: This rank (recorded in the measurement).
        limit: This rank's memory limit in bytes (None: no limit, every candidate is probed).
        extra_state_per_parameter_byte: State that training keeps besides AdamW's, per byte of the tier's
            parameters, which the probe does not build (``mode="demo"``: the error-feedback buffer, 1.0); added to
            each tier's training peak.

    Returns:
        The measurement; tiers not probed (predicted over the limit) have no numbers.
    """
    original = tensor_bytes(module)
    budget = None if limit is None else limit * (1.0 - settings.memory_headroom)
    state_bytes = _per_width_state_bytes(module, blocks)
    widths = {tier: blocks[0].full_size >> tier for tier in settings.candidates}

    def parameter_bytes(tier: int) -> float:  # the sliced copy's parameters and buffers
        return original - state_bytes / 4 * (blocks[0].full_size - widths[tier])

    reset_peak_memory(device)
    baseline = peak_memory_bytes(device)
    probed: list[tuple[int, int]] = []  # (width, raw peak)
    tiers: dict[int, TierProbe] = {}
    over = False
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer on the copy, and the like
        for tier in sorted(settings.candidates, reverse=True):  # narrowest first
            if not over and limit is not None:
                if probed:
                    predicted = _predict(probed, widths[tier], state_bytes)
                else:  # the narrowest: what the process holds now, plus a copy's weights, gradients and moments
                    copy_bytes = original - state_bytes / 4 * (blocks[0].full_size - widths[tier])
                    predicted = baseline + 4 * copy_bytes
                training = predicted - original + extra_state_per_parameter_byte * parameter_bytes(tier)
                over = predicted > limit or (budget is not None and training > budget)
            if over:
                tiers[tier] = TierProbe(None, None)
                continue
            seconds, raw = _probe_one(module, tier, device, settings, step)
            probed.append((widths[tier], raw))
            extra = round(extra_state_per_parameter_byte * parameter_bytes(tier))  # what training adds to the probe
            tiers[tier] = TierProbe(seconds, max(raw - original, 0) + extra)
    return TierMeasurement(rank, limit, tiers)


def _per_width_state_bytes(module: nn.Module, blocks: Sequence[FFNBlock]) -> float:
    """Bytes that one more FFN hidden unit adds to training state: weights, gradients and two AdamW moments."""
    named = dict(module.named_parameters())
    per_unit = 0.0
    for block in blocks:
        for spec in block.parameters:
            tensor = named.get(spec.name)
            if tensor is not None:
                per_unit += tensor.numel() * tensor.element_size() / spec.full_size
    return 4.0 * per_unit


def _predict(probed: list[tuple[int, int]], width: int, state_per_unit: float) -> float:
    """The raw peak at ``width`` from the narrower probes (see the module docstring)."""
    last_width, last_peak = probed[-1]
    floor = last_peak + state_per_unit * (width - last_width)
    if len(probed) == 1:
        return last_peak + 1.5 * state_per_unit * (width - last_width)
    first_width, first_peak = probed[-2]
    slope = (last_peak - first_peak) / max(last_width - first_width, 1)
    return max(last_peak + slope * (width - last_width), floor)


def _probe_one(
    module: nn.Module, tier: int, device: torch.device, settings: AutoTierSettings, step: ProbeStep
) -> tuple[float, int]:
    """``(median step seconds, raw peak bytes)`` of training a sliced copy of ``module`` at ``tier``."""
    reset_peak_memory(device)
    candidate = step.copy(module)
    try:
        if tier > 0:
            slice_model(candidate, tier)
        candidate.train()
        params = [p for p in candidate.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=0.0)  # lr 0: the moments are allocated, the copy is thrown away

        def one_step() -> None:
            optimizer.zero_grad(set_to_none=True)
            with step.context():
                loss = step.loss(candidate)
            loss.backward()
            optimizer.step()

        seconds = time_call(one_step, device, repeats=settings.probe_repeats, warmup=settings.probe_warmup)
        peak = peak_memory_bytes(device)
    finally:
        optimizer = candidate = None  # type: ignore[assignment]
        if device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            release_freed_heap()
    return seconds, peak


def release_freed_heap() -> None:
    """Give the heap pages the probe's copies freed back to the kernel (glibc ``malloc_trim``; elsewhere nothing).

    Freed memory otherwise stays mapped in the allocator's arenas and charged to the process's cgroup: after four
    probe copies, a tier-1 rank whose probe peak fitted its limit with 185 MB to spare was OOM-killed 30 steps into
    training (docs/hetero.md).
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def memory_limits(owner: str, settings: AutoTierSettings, world_size: int, num_nodes: int) -> list[int | None] | None:
    """The ``memory_limit_bytes`` override expanded to one entry per rank (None: every rank measures its own)."""
    if settings.memory_limit_bytes is None:
        return None
    return expand_per_rank(
        owner, "settings.auto_tiers.memory_limit_bytes", settings.memory_limit_bytes, world_size, num_nodes
    )


def check_candidates(owner: str, settings: AutoTierSettings, blocks: Sequence[FFNBlock]) -> None:
    """Raise a ``ValueError`` naming ``auto_tiers.candidates`` if a candidate tier does not divide every FFN."""
    sizes = sorted({block.full_size for block in blocks})
    bad = [tier for tier in settings.candidates if any(size % (1 << tier) for size in sizes)]
    if bad:
        raise ValueError(
            f"{owner}: settings.auto_tiers.candidates={settings.candidates}: tier(s) {bad} need every FFN size "
            f"({sizes}) to be divisible by 2**tier; drop them."
        )


def choose_auto_tiers(
    owner: str,
    module: nn.Module,
    blocks: Sequence[FFNBlock],
    device: torch.device,
    settings: AutoTierSettings,
    step: ProbeStep | None,
    rank: int,
    world_size: int,
    num_nodes: int,
    extra_state_per_parameter_byte: float = 0.0,
) -> tuple[TierChoice, float]:
    """Probe this rank, gather every rank's measurements, choose, and check that every rank chose the same.

    Collective (every rank calls it, in the same order). Each rank runs the deterministic chooser on the same
    gathered measurements, then the choices are gathered once more and compared with rank 0's, so the result is
    identical everywhere. Any failure (no probe step, a probe error, an impossible fit) raises on every rank, after
    the collectives, so that no rank is left waiting in one.

    Returns:
        The choice, and this rank's probe wall seconds (copying, slicing, timing).

    Raises:
        ValueError: No probe step to run, or no tier fits some rank (the chooser's message, naming the rank and
            its numbers); RuntimeError: the probe failed on some rank (each rank's error named).
    """
    start = time.perf_counter()
    payload: dict[str, object] = {"error": None, "measurement": None, "seconds": 0.0}
    local_error: Exception | None = None
    try:
        if step is None:
            raise ValueError(
                f"{owner}: settings.tiers='auto' needs a probe batch to measure each tier, and none was found (the "
                "Trainer takes the first batch of the train dataloader; with Fabric call "
                "strategy.set_probe_step(lambda model: loss) before setup_module). Pass explicit tiers instead."
            )
        check_candidates(owner, settings, blocks)
        overrides = memory_limits(owner, settings, world_size, num_nodes)
        limit = overrides[rank] if overrides is not None and overrides[rank] is not None else None
        if limit is None:
            limit = memory_limit_bytes(device)
        measurement = probe_tiers(module, blocks, device, settings, step, rank, limit, extra_state_per_parameter_byte)
        payload["measurement"] = measurement.to_json()
    except Exception as error:  # reported to every rank first, so that no rank waits for this one
        local_error, payload["error"] = error, f"{type(error).__name__}: {error}"
    seconds = time.perf_counter() - start
    payload["seconds"] = seconds
    gathered = all_gather_json(payload, world_size, device, schema=AUTO_DOCUMENT)
    if local_error is not None:
        raise local_error
    failed = {r: doc["error"] for r, doc in enumerate(gathered) if doc["error"]}
    if failed:
        raise RuntimeError(f"{owner}: the tiers='auto' probe failed on rank(s) {sorted(failed)}: {failed}")
    measurements = [TierMeasurement.from_json(doc["measurement"], r) for r, doc in enumerate(gathered)]
    choice: TierChoice | None = None
    mine: dict[str, object] = {"error": None, "choice": None}
    try:
        choice = choose_tiers(
            measurements,
            max_slowdown=settings.max_slowdown,
            memory_headroom=settings.memory_headroom,
            num_layers=len(blocks) if settings.mix_layers else None,
        )
        mine["choice"] = choice.to_json()
    except ValueError as error:
        mine["error"] = str(error)
    choices = all_gather_json(mine, world_size, device, schema=CHOICE_DOCUMENT)
    if choice is None:
        raise ValueError(f"{owner}: {mine['error']}")
    differing = [r for r, doc in enumerate(choices) if doc != choices[0]]
    if differing:
        raise RuntimeError(
            f"{owner}: tiers='auto' chose differently on rank(s) {differing} than on rank 0 from the same "
            f"measurements: {choices[0]} vs {[choices[r] for r in differing]}."
        )
    slowest = max(float(doc["seconds"]) for doc in gathered)
    for line in choice.lines:
        log.info("%s", line)
    return choice, slowest
