"""The shared subspace: configuration, the orthonormal basis U, the frozen token table T_fixed and the Grassmann step.

Everything here is deterministic from a seed, so every pipeline rank builds bit-identical U and T_fixed rows without
communication:

- ``U`` (``d x k``, orthonormal columns) is the sign-fixed QR factor of a Gaussian drawn from a seeded CPU generator in
  float64, then cast and moved to the model's dtype/device (:func:`orthonormal_basis`).
- ``T_fixed`` (``V x d``) is never stored for big vocabularies: entry ``(v, j)`` is a Gaussian computed from a
  counter-based integer hash of ``(seed, v, j)`` (:class:`FixedTokenTable`), so any row can be produced on demand for
  the ids of a batch, on any device. Small tables are materialised once as a non-persistent buffer with the very same
  values.
- :func:`propose_basis` takes one Riemannian gradient step on the Grassmann manifold (QR retraction) towards the
  dominant output directions of the constrained matrices' gradients.

See ``docs/subspace_pipeline.md`` for the math.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

__all__ = [
    "COORD_DTYPES",
    "FixedTokenTable",
    "SubspaceBasis",
    "SubspaceConfig",
    "orthonormal_basis",
    "outside_span_fraction",
    "propose_basis",
]

COORD_DTYPES = ("fp32", "bf16", "int8")
"""Boundary codecs: float32 coordinates, bfloat16 coordinates, or int8 with one float32 scale per token (lossy)."""
_MODES = ("projected", "reparam")

# Tables up to this many entries (64 MiB in fp32) are materialised once; bigger ones are generated per batch.
MATERIALIZE_LIMIT = 1 << 24


@dataclass
class SubspaceConfig:
    """How a model is confined to the subspace and how stage boundaries are encoded.

    Args:
        subspace_dim: ``k``, the subspace dimension (number of coordinates per token at a boundary).
        dim_ratio: ``d / k`` instead of ``subspace_dim``; ``k = round(d / dim_ratio)``. Give exactly one of the two
            (neither is fine when ``compress=False``).
        seed: Seed of ``U`` and ``T_fixed`` (every rank derives the same ones).
        mode: ``"reparam"``: constrained weights are stored as coordinates ``W = U Z`` (any optimizer works).
            ``"projected"``: HF-shaped dense weights kept in span(U) by projecting their gradients
            (``StageModule.project_gradients_``) and :class:`~lightning_hetero.subspace_pipeline.SubspaceAdamW`.
        compress: False builds the plain model (no constraint, no T_fixed) and boundaries carry ``d`` numbers: the
            uncompressed pipeline baseline in the same code path.
        coord_dtype: Boundary codec, one of :data:`COORD_DTYPES`. ``"int8"`` is lossy in both directions.
        update_every: Optimizer steps between subspace (Grassmann) updates; 0 keeps U frozen. The runtime acts on it.
        update_lr: Step size of the Grassmann update (with the default normalisation, the tangent of the largest
            rotation angle per update is at most ``update_lr``).
        fixed_embedding_std: Standard deviation of ``T_fixed``; None uses the HF config's ``initializer_range``
            (0.02 for Llama), so the initial residual stream has the scale of an ordinary HF initialisation.
            Pluralis' code uses 1.0.
    """

    subspace_dim: int | None = None
    dim_ratio: float | None = None
    seed: int = 0
    mode: Literal["projected", "reparam"] = "reparam"
    compress: bool = True
    coord_dtype: Literal["fp32", "bf16", "int8"] = "fp32"
    update_every: int = 0
    update_lr: float = 0.1
    fixed_embedding_std: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ValueError(f"SubspaceConfig.mode={self.mode!r} is not supported; use 'reparam' or 'projected'.")
        if self.coord_dtype not in COORD_DTYPES:
            raise ValueError(f"SubspaceConfig.coord_dtype={self.coord_dtype!r}; use one of {', '.join(COORD_DTYPES)}.")
        if self.compress and (self.subspace_dim is None) == (self.dim_ratio is None):
            given = "both" if self.subspace_dim is not None else "neither"
            raise ValueError(
                f"SubspaceConfig got {given} of subspace_dim and dim_ratio; give exactly one: subspace_dim=k "
                f"(coordinates per token) or dim_ratio=d/k (e.g. dim_ratio=32)."
            )
        if self.subspace_dim is not None and (
            isinstance(self.subspace_dim, bool) or not isinstance(self.subspace_dim, int) or self.subspace_dim < 1
        ):
            raise ValueError(
                f"SubspaceConfig.subspace_dim={self.subspace_dim!r} must be a positive integer (the subspace size k)."
            )
        if self.dim_ratio is not None and not self.dim_ratio >= 1:
            raise ValueError(f"SubspaceConfig.dim_ratio={self.dim_ratio!r} must be >= 1 (it is d / k).")
        if self.update_every < 0:
            raise ValueError(f"SubspaceConfig.update_every={self.update_every} must be >= 0 (0 keeps U frozen).")
        if not self.update_lr > 0:
            raise ValueError(f"SubspaceConfig.update_lr={self.update_lr} must be > 0.")
        if self.fixed_embedding_std is not None and not self.fixed_embedding_std > 0:
            raise ValueError(f"SubspaceConfig.fixed_embedding_std={self.fixed_embedding_std} must be > 0 (or None).")

    def resolve_subspace_dim(self, hidden_size: int) -> int:
        """Return ``k`` for a model of width ``hidden_size`` (``d``).

        Raises:
            ValueError: ``k > d`` or ``dim_ratio`` too large for ``d``.
        """
        if self.subspace_dim is not None:
            rank = self.subspace_dim
        elif self.dim_ratio is not None:
            rank = round(hidden_size / self.dim_ratio)
            if rank < 1:
                raise ValueError(
                    f"SubspaceConfig.dim_ratio={self.dim_ratio} leaves k = round({hidden_size} / "
                    f"{self.dim_ratio}) = 0 coordinates; use dim_ratio <= {hidden_size}."
                )
        else:
            return hidden_size  # compress=False: the boundary carries the full width
        if rank > hidden_size:
            raise ValueError(
                f"SubspaceConfig.subspace_dim={rank} exceeds the model width d={hidden_size}; use subspace_dim <= "
                f"{hidden_size}."
            )
        return rank

    def resolve_fixed_std(self, hf_config: Any) -> float:
        """Standard deviation of ``T_fixed`` for a model with this HF config."""
        if self.fixed_embedding_std is not None:
            return float(self.fixed_embedding_std)
        return float(getattr(hf_config, "initializer_range", None) or 0.02)


def wide_dtype(device: torch.device | str | None) -> torch.dtype:
    """float64 for exact-ish one-off linear algebra, except on devices without float64 (MPS): float32."""
    return torch.float32 if torch.device(device or "cpu").type == "mps" else torch.float64


def orthonormal_basis(
    hidden_size: int, rank: int, seed: int, *, dtype: torch.dtype = torch.float32, device: Any = None
) -> Tensor:
    """Seeded ``d x k`` matrix with orthonormal columns, bit-identical on every rank.

    The Gaussian is drawn from a CPU generator and factorised in float64 (so the result does not depend on the
    device), the signs are fixed so that ``R`` has a positive diagonal, then it is cast and moved.
    """
    if not 1 <= rank <= hidden_size:
        raise ValueError(f"rank={rank} must be in [1, hidden_size={hidden_size}].")
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    gaussian = torch.randn(hidden_size, rank, generator=generator, dtype=torch.float64)
    return _sign_fixed_qr(gaussian).to(dtype=dtype, device=device)


def _sign_fixed_qr(matrix: Tensor) -> Tensor:
    """Q factor of ``matrix`` with the signs chosen so that R's diagonal is non-negative (makes QR unique)."""
    q, r = torch.linalg.qr(matrix)
    signs = torch.sign(torch.diagonal(r))
    signs = torch.where(signs == 0, torch.ones_like(signs), signs)
    return q * signs


def outside_span_fraction(matrix: Tensor, basis: Tensor, axis: int = 0) -> float:
    """Relative mass of ``matrix`` outside span(basis): ``||(I - U U^T) W|| / ||W||`` along ``axis``.

    ``axis`` is the dimension (of size ``d``) whose vectors should lie in the span: 0 for an ``nn.Linear`` weight
    ``(d_out, d_in)`` writing into the residual stream, 1 for an embedding table ``(V, d)``.
    """
    w = matrix.detach().to(device="cpu", dtype=torch.float64).movedim(axis, 0).reshape(matrix.shape[axis], -1)
    u = basis.detach().to(device="cpu", dtype=torch.float64)
    residual = w - u @ (u.T @ w)
    norm = torch.linalg.norm(w)
    return float(torch.linalg.norm(residual) / norm) if norm > 0 else 0.0


def propose_basis(basis: Tensor, accumulated: Tensor, lr: float, *, normalize: bool = True) -> Tensor:
    """One Grassmann gradient step on the out-of-subspace gradient energy, with a QR retraction.

    With ``C = sum_i G_i G_i^T`` over the constrained matrices' full (unprojected) gradients, the objective
    ``F(U) = -1/2 tr(U^T C U)`` (equivalently: the gradient energy outside span(U), ``sum ||(I - UU^T) G_i||^2``, up to
    a constant) has Euclidean gradient ``-C U`` and Riemannian gradient ``-(I - UU^T) C U``. The step is
    ``U <- qr(U + lr * (I - UU^T) C U).Q`` (an Oja-style power iteration). ``accumulated`` is ``C U`` (``d x k``), as
    accumulated by ``StageModule.accumulate_subspace_gradient_`` and summed over stages/replicas.

    Compute it on ONE rank and broadcast the result: encoder and decoder must use bit-identical U.

    Args:
        basis: Current ``U`` (``d x k``, orthonormal).
        accumulated: ``C U`` (``d x k``).
        lr: Step size. With ``normalize=True`` the tangent step is scaled by ``1 / ||C U||_F``, so ``lr`` bounds the
            tangent of the largest rotation angle and does not depend on the gradients' scale.
        normalize: See ``lr``.

    Returns:
        The new basis, same dtype and device as ``basis``, orthonormal (float64 QR, sign-fixed so that ``lr -> 0``
        returns ``basis``).
    """
    if accumulated.shape != basis.shape:
        raise ValueError(
            f"accumulated has shape {tuple(accumulated.shape)} but the basis is {tuple(basis.shape)}; pass the d x k "
            f"statistic from StageModule.subspace_statistic (summed over stages)."
        )
    # d x k only: done on the CPU in float64 (deterministic, and available on every backend)
    u = basis.detach().to(device="cpu", dtype=torch.float64)
    cu = accumulated.detach().to(device="cpu", dtype=torch.float64)
    tangent = cu - u @ (u.T @ cu)  # (I - U U^T) C U: the Riemannian ascent direction of tr(U^T C U)
    if normalize:
        scale = torch.linalg.norm(cu)
        if scale == 0 or not torch.isfinite(scale):
            return basis.clone()
        tangent = tangent / scale
    return _sign_fixed_qr(u + lr * tangent).to(dtype=basis.dtype, device=basis.device)


class SubspaceBasis(nn.Module):
    """Holds the shared basis ``U`` as a persistent buffer (``basis``), plus the fixed token table.

    One instance per stage module; the constrained layers keep an *unregistered* reference to it, so U is stored,
    moved and checkpointed once and a rebase (an in-place copy) is seen by every layer at once.
    """

    def __init__(self, basis: Tensor, fixed: FixedTokenTable) -> None:
        super().__init__()
        self.register_buffer("basis", basis)
        # Sum over committed steps of C U (d x k), C = sum of g g^T over the boundary residual gradients. Saved, so a
        # resume in the middle of an update interval proposes the same next basis.
        self.register_buffer("accumulated", torch.zeros_like(basis, dtype=torch.float32))
        self.fixed = fixed
        self.tracking = False
        """When True, the stage adds the residual-gradient sketch at its boundaries to ``pending`` in backward."""
        self.pending: Tensor | None = None

    @property
    def hidden_size(self) -> int:
        """``d``."""
        return self.basis.shape[0]

    @property
    def subspace_dim(self) -> int:
        """``k``."""
        return self.basis.shape[1]

    def encode(self, hidden: Tensor, input_ids: Tensor) -> Tensor:
        """Coordinates ``(h - T_fixed[ids]) U`` of the residual stream, ``(..., k)``."""
        u = self.basis
        return (hidden - self.fixed(input_ids, dtype=hidden.dtype)) @ u.to(hidden.dtype)

    def decode(self, coordinates: Tensor, input_ids: Tensor) -> Tensor:
        """Rebuild the residual stream ``c U^T + T_fixed[ids]``, ``(..., d)`` (exact when h - T lies in span(U))."""
        u = self.basis
        return coordinates @ u.to(coordinates.dtype).T + self.fixed(input_ids, dtype=coordinates.dtype)

    # Gradient sketch for the Grassmann update: C U = sum_t g_t (g_t^T U) over the full (d-dim) residual-stream
    # gradients g_t at the stage boundaries, never forming C (d x d).

    def add_boundary_gradient(self, grad: Tensor) -> None:
        """Add ``g^T (g U)`` for the ``(..., d)`` gradient of the residual stream at a boundary (tensor hook)."""
        u = self.basis.to(torch.float32)
        g = grad.reshape(-1, grad.shape[-1]).to(torch.float32)
        self._add_pending(g.T @ (g @ u))

    def _add_pending(self, term: Tensor) -> None:
        self.pending = term if self.pending is None else self.pending + term

    def commit_gradient_(self) -> None:
        """Move the pending (this step's) sketch into ``accumulated``."""
        if self.pending is not None:
            self.accumulated.add_(self.pending.to(self.accumulated))
            self.pending = None

    def reset_gradient_(self) -> None:
        """Forget the accumulated and pending sketch (after a basis change they refer to the old U)."""
        self.accumulated.zero_()
        self.pending = None


# ---------------------------------------------------------------------------------------------------------------------
# Counter-based Gaussian table (identical values on every rank and device, nothing stored for big vocabularies).

_MASK32 = 0xFFFFFFFF


def _mul32(x: Tensor, constant: int) -> Tensor:
    """``(x * constant) mod 2**32`` for int64 ``x`` in ``[0, 2**32)`` without int64 overflow (16-bit halves)."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32


def _hash32(x: Tensor) -> Tensor:
    """A 32-bit integer mixer ("lowbias32") on int64 tensors holding values in ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _uniform(rows: Tensor, columns: Tensor, key: int) -> Tensor:
    """Uniforms in (0, 1) (float64; float32 on MPS), one per (row, column) pair, from the hash of (key, row, column)."""
    row_hash = _hash32((rows & _MASK32) ^ key)
    mixed = _hash32(row_hash.unsqueeze(-1) ^ _hash32((columns + 0x9E3779B9) & _MASK32))
    return (mixed.to(wide_dtype(rows.device)) + 0.5) / 4294967296.0


class FixedTokenTable(nn.Module):
    """The frozen full-rank token table ``T_fixed`` (``V x d``), regenerated from a seed, never trained or sent.

    Entry ``(v, j)`` is ``std * N(0, 1)`` from a Box-Muller transform of two hashed uniforms keyed by
    ``(seed, v, j)``. Tables with at most ``MATERIALIZE_LIMIT`` entries are computed once into a non-persistent
    buffer; larger ones produce only the rows of the ids asked for, on the ids' device (O(B*S*d) per call). Both
    paths give the same values. Integer hashing is exact on every device; the float transform may differ by an ulp
    between CPU and CUDA libm, which only matters if two adjacent stages run on different device types.

    The state dict holds the seed and std (``_extra_state``), not the table.
    """

    def __init__(self, vocab_size: int, hidden_size: int, seed: int, std: float, *, materialize: bool | None = None):
        super().__init__()
        self.vocab_size = int(vocab_size)
        self.hidden_size = int(hidden_size)
        self.seed = int(seed)
        self.std = float(std)
        self._materialize = materialize
        self.register_buffer("table", None, persistent=False)
        self._rebuild()

    def _rebuild(self) -> None:
        materialize = self._materialize
        if materialize is None:
            materialize = self.vocab_size * self.hidden_size <= MATERIALIZE_LIMIT
        device = self.table.device if self.table is not None else None
        self.table = self.generate(torch.arange(self.vocab_size, device=device)) if materialize else None

    def _keys(self) -> tuple[int, int]:
        base = _hash32(torch.tensor([self.seed & _MASK32], dtype=torch.int64))
        key_radius = int(_hash32(base ^ 0x68E31DA4))
        key_angle = int(_hash32(base ^ 0xB5297A4D))
        return key_radius, key_angle

    def generate(self, input_ids: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """Compute the rows of ``input_ids`` from the hash (``(*ids.shape, d)``); no caching."""
        ids = input_ids.to(torch.int64)
        columns = torch.arange(self.hidden_size, device=ids.device, dtype=torch.int64)
        key_radius, key_angle = self._keys()
        radius = torch.sqrt(-2.0 * torch.log(_uniform(ids, columns, key_radius)))
        angle = (2.0 * math.pi) * _uniform(ids, columns, key_angle)
        # Canonical values are float32, so the materialised, on-demand and exported tables agree bit for bit.
        return (self.std * radius * torch.cos(angle)).to(torch.float32).to(dtype)

    def forward(self, input_ids: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """Rows ``T_fixed[input_ids]`` with shape ``(*input_ids.shape, d)``."""
        # (checked on CPU only: on an accelerator the check would synchronise the stream every forward)
        on_cpu = input_ids.device.type == "cpu"
        if on_cpu and input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, {self.vocab_size}); got min {int(input_ids.min())}, "
                f"max {int(input_ids.max())}."
            )
        if self.table is not None:
            rows = self.table.to(input_ids.device)[input_ids]
            return rows if dtype is None else rows.to(dtype)
        return self.generate(input_ids, dtype=dtype or torch.float32)

    def full(self, dtype: torch.dtype = torch.float32, chunk: int = 4096) -> Tensor:
        """The whole ``V x d`` table (for export), generated in row chunks."""
        parts = [
            self.generate(torch.arange(s, min(s + chunk, self.vocab_size)), dtype)
            for s in range(0, self.vocab_size, chunk)
        ]
        return torch.cat(parts, dim=0)

    def get_extra_state(self) -> Tensor:
        # A float64 tensor (not a dict) so that state-dict consumers may call .detach()/.cpu() on every value; all
        # four numbers are exact in float64 (seeds up to 2**53).
        return torch.tensor([self.seed, self.std, self.vocab_size, self.hidden_size], dtype=torch.float64)

    def set_extra_state(self, state: Tensor) -> None:
        seed, std, vocab_size, hidden_size = parse_fixed_state(state)
        if (vocab_size, hidden_size) != (self.vocab_size, self.hidden_size):
            raise ValueError(
                f"checkpoint T_fixed is {vocab_size}x{hidden_size} but this model's is "
                f"{self.vocab_size}x{self.hidden_size}; the checkpoint belongs to another model."
            )
        if (seed, std) != (self.seed, self.std):
            self.seed, self.std = seed, std
            self._rebuild()

    def extra_repr(self) -> str:
        stored = "materialized" if self.table is not None else "on demand"
        return f"{self.vocab_size}, {self.hidden_size}, seed={self.seed}, std={self.std}, {stored}"


def parse_fixed_state(state: Tensor) -> tuple[int, float, int, int]:
    """``(seed, std, vocab_size, hidden_size)`` from a ``FixedTokenTable`` extra state."""
    values = [float(v) for v in torch.as_tensor(state, dtype=torch.float64).reshape(-1)]
    return int(values[0]), values[1], int(values[2]), int(values[3])
