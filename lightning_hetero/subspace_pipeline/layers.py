"""Layers whose outputs are confined to span(U): the residual-stream writers and the trainable token embedding.

Two ways to keep a matrix ``W`` (PyTorch layout ``(d_out=d, d_in)``) writing into the residual stream inside span(U):

- **reparam** (:class:`SubspaceLinear`): store coordinates ``Z`` (``k x d_in``) and compute ``y = (x Z^T) U^T``,
  i.e. ``W = U Z``. Constraint-free; any optimizer works.
- **projected** (:class:`ProjectedLinear`): an ordinary ``nn.Linear`` (HF-shaped, same FQNs) whose weight starts in
  span(U); ``StageModule.project_gradients_`` projects its gradient (``G <- U U^T G``) and
  :class:`~lightning_hetero.subspace_pipeline.SubspaceAdamW` keeps the update in the span.

The trainable embedding :class:`SubspaceEmbedding` likewise stores ``E_k`` (``V x k``, reparam; ``E = E_k U^T``) or a
dense ``V x d`` table with rows in span(U) (projected). The frozen ``T_fixed`` is added by the stage, not here.

Layers hold an *unregistered* reference to the stage's :class:`~lightning_hetero.subspace_pipeline.basis.SubspaceBasis`,
so U is stored once per stage and a rebase (an in-place copy of U) reaches every layer. :func:`constrain_layer_` swaps a
decoder layer's residual writers for these layers; :data:`CONFINED_WRITER_TYPES` is what a writer may be afterwards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_hetero.hf.decoder import RESIDUAL_WRITERS
from lightning_hetero.subspace_pipeline.basis import SubspaceBasis, wide_dtype

__all__ = ["CONFINED_WRITER_TYPES", "ProjectedLinear", "SubspaceEmbedding", "SubspaceLinear", "constrain_layer_"]


class SubspaceLinear(nn.Module):
    """``y = (x Z^T + b_k) U^T``: a linear map into span(U) stored as ``k`` coordinates per output (reparam mode).

    Parameters: ``weight_coords`` ``Z`` (``k x in_features``) and, when the original layer had a bias,
    ``bias_coords`` (``k``). The dense equivalent is ``W = U Z``, ``b = U b_k`` (:meth:`dense_weight`).
    """

    def __init__(self, owner: SubspaceBasis, in_features: int, bias: bool, *, dtype=None, device=None) -> None:
        super().__init__()
        object.__setattr__(self, "_owner", owner)  # not a submodule: U is registered once, on the stage
        self.in_features = in_features
        self.out_features = owner.hidden_size
        self.weight_coords = nn.Parameter(torch.empty(owner.subspace_dim, in_features, dtype=dtype, device=device))
        self.bias_coords = nn.Parameter(torch.zeros(owner.subspace_dim, dtype=dtype, device=device)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, owner: SubspaceBasis) -> SubspaceLinear:
        """Coordinates of the projection of ``linear`` onto span(U): ``Z = U^T W`` (so ``U Z = U U^T W``)."""
        weight = linear.weight
        if weight.shape[0] != owner.hidden_size:
            raise ValueError(
                f"a residual-stream writer must have out_features = d = {owner.hidden_size}; got {weight.shape[0]}."
            )
        layer = cls(owner, weight.shape[1], linear.bias is not None, dtype=weight.dtype, device=weight.device)
        wide = wide_dtype(weight.device)
        u = owner.basis.to(device=weight.device, dtype=wide)
        with torch.no_grad():
            layer.weight_coords.copy_(u.T @ weight.to(wide))
            if linear.bias is not None:
                layer.bias_coords.copy_(u.T @ linear.bias.to(wide))
        return layer

    @property
    def basis(self) -> Tensor:
        """The shared ``U`` (``d x k``)."""
        return self._owner.basis

    def forward(self, x: Tensor) -> Tensor:
        coords = F.linear(x, self.weight_coords, self.bias_coords)
        return F.linear(coords, self.basis.to(coords.dtype))

    def dense_weight(self) -> Tensor:
        """``U Z`` (``d x in_features``)."""
        return self.basis.to(self.weight_coords.dtype) @ self.weight_coords

    def dense_bias(self) -> Tensor | None:
        """``U b_k`` or None."""
        return None if self.bias_coords is None else self.basis.to(self.bias_coords.dtype) @ self.bias_coords

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.weight_coords.shape[0]}"


class ProjectedLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters and FQNs as HF's) whose weight is kept in span(U) (projected mode).

    Its forward is ``nn.Linear``'s; projection of weights and gradients is done by the stage
    (``StageModule.project_gradients_`` / ``reproject_weights_``) and the optimizer.
    """

    @classmethod
    def from_linear(cls, linear: nn.Linear, owner: SubspaceBasis) -> ProjectedLinear:
        """Wrap ``linear``'s own parameters (no copy) and project them onto span(U) in place."""
        if linear.weight.shape[0] != owner.hidden_size:
            raise ValueError(
                f"a residual-stream writer must have out_features = d = {owner.hidden_size}; got "
                f"{linear.weight.shape[0]}."
            )
        with torch.device("meta"):
            layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        layer.weight = linear.weight
        layer.bias = linear.bias
        object.__setattr__(layer, "_owner", owner)
        layer.project_()
        return layer

    @torch.no_grad()
    def project_(self) -> None:
        """``W <- U U^T W`` (and the bias) in place."""
        u = self._owner.basis.to(self.weight.dtype)
        self.weight.copy_(u @ (u.T @ self.weight))
        if self.bias is not None:
            self.bias.copy_(u @ (u.T @ self.bias))

    def dense_weight(self) -> Tensor:
        """The weight itself (already dense)."""
        return self.weight

    def dense_bias(self) -> Tensor | None:
        """The bias itself."""
        return self.bias


class SubspaceEmbedding(nn.Module):
    """The trainable part ``E`` of the token embedding, with rows in span(U).

    reparam: parameter ``weight_coords`` ``E_k`` (``V x k``), ``E[ids] = E_k[ids] U^T``.
    projected: parameter ``weight_in_span`` (``V x d``) kept in span(U) by gradient projection and the optimizer.
    The padding row receives no gradient, as in ``nn.Embedding(padding_idx=...)``.
    """

    def __init__(
        self,
        owner: SubspaceBasis,
        vocab_size: int,
        mode: str,
        padding_idx: int | None = None,
        *,
        dtype=None,
        device=None,
    ) -> None:
        super().__init__()
        object.__setattr__(self, "_owner", owner)
        self.mode = mode
        self.vocab_size = vocab_size
        self.padding_idx = padding_idx
        width = owner.subspace_dim if mode == "reparam" else owner.hidden_size
        name = "weight_coords" if mode == "reparam" else "weight_in_span"
        self.register_parameter(name, nn.Parameter(torch.empty(vocab_size, width, dtype=dtype, device=device)))

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, owner: SubspaceBasis, mode: str) -> SubspaceEmbedding:
        """Initialise from an HF embedding's projection onto span(U): ``E_k = W U`` (reparam) or ``W U U^T``."""
        weight = embedding.weight
        layer = cls(owner, weight.shape[0], mode, embedding.padding_idx, dtype=weight.dtype, device=weight.device)
        wide = wide_dtype(weight.device)
        u = owner.basis.to(device=weight.device, dtype=wide)
        with torch.no_grad():
            coords = weight.to(wide) @ u
            layer.trainable_weight.copy_(coords if mode == "reparam" else coords @ u.T)
        return layer

    @property
    def trainable_weight(self) -> nn.Parameter:
        """``weight_coords`` (reparam) or ``weight_in_span`` (projected)."""
        return self.weight_coords if self.mode == "reparam" else self.weight_in_span

    @property
    def basis(self) -> Tensor:
        """The shared ``U``."""
        return self._owner.basis

    def forward(self, input_ids: Tensor) -> Tensor:
        rows = F.embedding(input_ids, self.trainable_weight, self.padding_idx)
        output = rows @ self.basis.to(rows.dtype).T if self.mode == "reparam" else rows
        return output

    def dense_weight(self) -> Tensor:
        """The trainable part as a ``V x d`` table (without ``T_fixed``)."""
        weight = self.trainable_weight
        return weight @ self.basis.to(weight.dtype).T if self.mode == "reparam" else weight

    def extra_repr(self) -> str:
        k = self._owner.subspace_dim
        return f"{self.vocab_size}, mode={self.mode}, subspace_dim={k}, padding_idx={self.padding_idx}"


CONFINED_WRITER_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, SubspaceLinear)
"""What a residual writer of a supported decoder may be: HF's ``nn.Linear`` or a confined layer (``ProjectedLinear``
is an ``nn.Linear``). Pass to :func:`lightning_hetero.hf.decoder.find_decoder` as ``writer_types``."""


def constrain_layer_(layer: nn.Module, owner: SubspaceBasis, mode: str) -> None:
    """Replace a decoder layer's ``o_proj`` and ``down_proj`` by their confined versions, in place.

    ``reparam``: :class:`SubspaceLinear` with ``Z = U^T W``; ``projected``: :class:`ProjectedLinear` sharing the
    original parameters, projected onto span(U). Either way the layer computes ``U U^T W`` afterwards.
    """
    for writer in RESIDUAL_WRITERS:
        parent_path, name = writer.rsplit(".", 1)
        parent = layer.get_submodule(parent_path)
        linear = getattr(parent, name)
        if isinstance(linear, SubspaceLinear | ProjectedLinear):
            raise ValueError(
                f"{writer} is already confined; build the stages from an unmodified HF model (or pass copy=True)."
            )
        confined = (
            SubspaceLinear.from_linear(linear, owner)
            if mode == "reparam"
            else ProjectedLinear.from_linear(linear, owner)
        )
        setattr(parent, name, confined)
