"""One pipeline stage of a subspace-constrained HF decoder: :class:`StageModule`.

A stage holds only its own pieces (its decoder layers, the embedding on the first stage, the final norm and LM head on
the last, a private copy of the rotary embedding, and the shared-subspace state), so a rank keeps ~1/num_stages of
the model and no parameter is registered in two stages. Its ``forward(x, input_ids)``:

1. first stage: ``h = T_fixed[ids] + E(ids)``; other stages: ``h = decode(x) U^T + T_fixed[ids]``;
2. runs its decoder layers with RoPE and the causal mask HF would build (SDPA: none, ``is_causal``);
3. last stage: ``logits = lm_head(norm(h))``; other stages: ``encode((h - T_fixed[ids]) U)`` (``k`` per token).

State-dict keys keep the HF FQNs of the causal LM (``model.layers.7.mlp.down_proj.weight``, ``lm_head.weight``);
confined weights add their coordinate form (``...o_proj.weight_coords``, ``model.embed_tokens.weight_coords`` or
``...weight_in_span``), and ``subspace.basis`` (U), ``subspace.accumulated`` and ``subspace.fixed._extra_state``
(seed and std of T_fixed, not the table) are saved.
"""

from __future__ import annotations

import copy as copy_module
import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_hetero.hf.decoder import DecoderParts, maybe_copy
from lightning_hetero.pipeline.boundary_codec import BoundaryCodec
from lightning_hetero.subspace_pipeline.basis import (
    FixedTokenTable,
    SubspaceBasis,
    SubspaceConfig,
    orthonormal_basis,
    wide_dtype,
)
from lightning_hetero.subspace_pipeline.layers import (
    ProjectedLinear,
    SubspaceEmbedding,
    SubspaceLinear,
    constrain_layer_,
)
from lightning_hetero.subspace_pipeline.optim import project_along, reproject_parameter_, rotate_parameter_

__all__ = ["StageModule"]


def _layer_type(hf_config: Any, index: int) -> str:
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return layer_types[index]
    if getattr(hf_config, "model_type", "") == "mistral" and getattr(hf_config, "sliding_window", None) is not None:
        return "sliding_attention"
    return "full_attention"


def _attention_masks(
    hf_config: Any, hidden: Tensor, attention_mask: Tensor | None, position_ids: Tensor, needed: set[str]
) -> dict[str, Any]:
    """The masks HF's own model forward would pass to each layer type (None for plain causal SDPA)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    # transformers 5 renamed the cache argument (the old name warns on every call); 4.x knows only the old one.
    cache = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
    kwargs = {
        "config": hf_config,
        "inputs_embeds": hidden,
        "attention_mask": attention_mask,
        cache: None,
        "position_ids": position_ids,
    }
    masks: dict[str, Any] = {}
    if "full_attention" in needed:
        masks["full_attention"] = create_causal_mask(**kwargs)
    if "sliding_attention" in needed:
        masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
    return masks


class StageModule(nn.Module):
    """One pipeline stage (or, with ``is_first and is_last``, the whole constrained model). Build with
    :func:`build_stages` or :func:`~lightning_hetero.subspace_pipeline.constrained_model`.

    Attributes:
        stage_index, num_stages: Position in the pipeline.
        layer_range: ``(start, stop)`` global indices of its decoder layers.
        constrained_layers: Global indices of its layers whose ``o_proj``/``down_proj`` are confined.
        boundary_layers: Global indices ``i`` such that the residual stream entering layer ``i`` is a pipeline
            boundary (this stage's input; for the whole model, every boundary of the split). The Grassmann sketch
            records the residual gradient there.
        is_first, is_last: Whether it embeds token ids / produces logits.
        config: The :class:`SubspaceConfig`; ``hf_config``: the HF config.
        codec: The :class:`~lightning_hetero.pipeline.boundary_codec.BoundaryCodec` of its boundaries.
    """

    def __init__(
        self,
        *,
        hf_config: Any,
        config: SubspaceConfig,
        stage_index: int,
        num_stages: int,
        layer_range: tuple[int, int],
        constrained_layers: Iterable[int],
        boundary_layers: Iterable[int],
        is_first: bool,
        is_last: bool,
        hidden_size: int,
        vocab_size: int,
    ) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.config = config
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.layer_range = tuple(layer_range)
        self.constrained_layers = tuple(sorted(constrained_layers))
        self.boundary_layers = tuple(sorted(boundary_layers))
        self.is_first = is_first
        self.is_last = is_last
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.subspace_dim = config.resolve_subspace_dim(hidden_size) if config.compress else hidden_size
        self.codec = BoundaryCodec(config.coord_dtype, self.subspace_dim)
        self.model = nn.Module()  # holds embed_tokens / layers / norm / rotary_emb under HF's FQNs
        self.subspace: SubspaceBasis | None = None
        self.lm_head: nn.Module | None = None

    # ----------------------------------------------------------------------------------------------------------------
    # construction

    @classmethod
    def build(
        cls,
        parts: DecoderParts,
        config: SubspaceConfig,
        *,
        layer_range: tuple[int, int],
        constrained_layers: Iterable[int],
        stage_index: int,
        num_stages: int,
        is_first: bool,
        is_last: bool,
        boundary_layers: Iterable[int] | None = None,
        copy: bool = False,
    ) -> StageModule:
        """Assemble a stage from the HF parts (reused in place unless ``copy``); see :func:`build_stages`.

        ``boundary_layers`` defaults to the stage's own input boundary (``(start,)`` unless it is the first stage).
        """
        start, stop = layer_range
        constrained = [i for i in constrained_layers if start <= i < stop]
        if boundary_layers is None:
            boundary_layers = () if is_first else (start,)
        stage = cls(
            hf_config=parts.config,
            config=config,
            stage_index=stage_index,
            num_stages=num_stages,
            layer_range=layer_range,
            constrained_layers=constrained,
            boundary_layers=[i for i in boundary_layers if start <= i < stop],
            is_first=is_first,
            is_last=is_last,
            hidden_size=parts.hidden_size,
            vocab_size=parts.vocab_size,
        )
        reference = parts.layers[start].self_attn.q_proj.weight  # dtype/device of the decoder's weights
        if config.compress:
            basis = orthonormal_basis(
                parts.hidden_size, stage.subspace_dim, config.seed, dtype=reference.dtype, device=reference.device
            )
            fixed = FixedTokenTable(
                parts.vocab_size, parts.hidden_size, config.seed, config.resolve_fixed_std(parts.config)
            )
            stage.subspace = SubspaceBasis(basis, fixed).to(reference.device)
            stage.subspace.tracking = config.update_every > 0
        stage.model.layers = nn.ModuleDict({str(i): maybe_copy(parts.layers[i], copy) for i in range(start, stop)})
        stage.model.rotary_emb = copy_module.deepcopy(parts.rotary_emb)  # tiny; never shared between stages
        if is_first:
            embedding = parts.embed_tokens
            if config.compress:
                embedding = SubspaceEmbedding.from_embedding(embedding, stage.subspace, config.mode)
            else:
                embedding = maybe_copy(embedding, copy)
            stage.model.embed_tokens = embedding
        if is_last:
            stage.model.norm = maybe_copy(parts.norm, copy)
            # untie: a deep copy gives the head its own weight (pipelines place it on another stage)
            stage.lm_head = maybe_copy(parts.lm_head, parts.tied or copy)
        if config.compress:
            for index in constrained:
                constrain_layer_(stage.model.layers[str(index)], stage.subspace, config.mode)
        return stage

    # ----------------------------------------------------------------------------------------------------------------
    # forward

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype of the decoder weights (the residual stream's dtype)."""
        return next(iter(self.model.layers.values())).input_layernorm.weight.dtype

    @property
    def basis(self) -> Tensor | None:
        """``U`` (``d x k``), or None when ``compress=False``."""
        return None if self.subspace is None else self.subspace.basis

    def boundary_shape(self, batch: int, seq: int) -> tuple[int, int, int]:
        """Shape of the tensor crossing a boundary (sent by non-last stages, received by non-first stages)."""
        return self.codec.wire_shape(batch, seq)

    @property
    def boundary_dtype(self) -> torch.dtype:
        """dtype of the boundary tensor (float32 container for int8)."""
        return self.codec.wire_dtype

    def output_shape(self, batch: int, seq: int) -> tuple[int, int, int]:
        """Shape of this stage's output: logits on the last stage, else :meth:`boundary_shape`."""
        return (batch, seq, self.vocab_size) if self.is_last else self.boundary_shape(batch, seq)

    def boundary_bytes(self, batch: int, seq: int) -> int:
        """Bytes one boundary tensor occupies, per direction."""
        return self.codec.wire_bytes(batch, seq)

    def forward(self, x: Tensor | None, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Run this stage. ``x``: the received boundary tensor (ignored on the first stage); ``input_ids``: ``(B, S)``
        token ids (every stage has them); ``attention_mask``: optional ``(B, S)`` padding mask (right padding)."""
        if self.is_first:
            hidden = self.embed(input_ids)
        else:
            if x is None:
                raise ValueError(f"stage {self.stage_index} is not the first stage: pass the received boundary tensor.")
            hidden = self.codec.decode(x, self.compute_dtype)
            if self.subspace is not None:
                hidden = self.subspace.decode(hidden, input_ids)
        hidden = self.run_layers(hidden, attention_mask)
        if self.is_last:
            return self.lm_head(self.model.norm(hidden))
        if self.subspace is not None:
            hidden = self.subspace.encode(hidden, input_ids)
        return self.codec.encode(hidden)

    def embed(self, input_ids: Tensor) -> Tensor:
        """First stage: ``T_fixed[ids] + E(ids)`` (compress) or HF's embedding."""
        trainable = self.model.embed_tokens(input_ids)
        if self.subspace is None:
            return trainable
        return trainable + self.subspace.fixed(input_ids, dtype=trainable.dtype)

    def run_layers(self, hidden: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """The stage's decoder layers, called exactly as HF's model forward calls them (no cache)."""
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        position_embeddings = self.model.rotary_emb(hidden, position_ids)
        types = {int(i): _layer_type(self.hf_config, int(i)) for i in self.model.layers}
        masks = _attention_masks(self.hf_config, hidden, attention_mask, position_ids, set(types.values()))
        tracking = self.subspace is not None and self.subspace.tracking
        for index, layer in self.model.layers.items():
            if tracking and hidden.requires_grad and int(index) in self.boundary_layers:
                # the full d-dim residual gradient is only known here, at the receiver; the sender gets (dL/dh) U
                hidden.register_hook(self.subspace.add_boundary_gradient)
            output = layer(
                hidden,
                attention_mask=masks[types[int(index)]],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
            )
            hidden = output[0] if isinstance(output, tuple) else output
        return hidden

    # ----------------------------------------------------------------------------------------------------------------
    # keeping weights in the span (projected mode)

    def constrained_parameters(self) -> dict[nn.Parameter, int]:
        """Dense parameters that must stay in span(U) -> the axis (of size d) along which they live in it.

        Projected mode only (``o_proj``/``down_proj`` weights and biases: axis 0; the embedding's
        ``weight_in_span``: axis 1); empty in reparam mode (coordinates are unconstrained) and without compression.
        Pass it as ``SubspaceAdamW(..., constrained=stage.constrained_parameters())``.
        """
        result: dict[nn.Parameter, int] = {}
        if self.subspace is None or self.config.mode != "projected":
            return result
        for module in self.modules():
            if isinstance(module, ProjectedLinear):
                result[module.weight] = 0
                if module.bias is not None:
                    result[module.bias] = 0
            elif isinstance(module, SubspaceEmbedding):
                result[module.weight_in_span] = 1
        return result

    @torch.no_grad()
    def project_gradients_(self) -> None:
        """Projected mode: ``grad <- U U^T grad`` along each constrained axis (call after backward, before the
        optimizer step). The gradient of ``o_proj`` inside a stage is not confined by itself, since later layers read
        the full residual stream. No-op in reparam mode."""
        for parameter, axis in self.constrained_parameters().items():
            if parameter.grad is not None:
                parameter.grad.copy_(project_along(parameter.grad, self.basis, axis))

    @torch.no_grad()
    def reproject_weights_(self) -> None:
        """Projected mode: ``W <- U U^T W`` (removes float round-off drift; SubspaceAdamW keeps W in span up to it)."""
        for parameter, axis in self.constrained_parameters().items():
            parameter.copy_(project_along(parameter, self.basis, axis))

    # ----------------------------------------------------------------------------------------------------------------
    # subspace updates

    def track_subspace_gradient(self, enabled: bool = True) -> None:
        """Turn the Grassmann sketch on/off (on by default when ``config.update_every > 0``)."""
        if self.subspace is not None:
            self.subspace.tracking = enabled

    def accumulate_subspace_gradient_(self) -> None:
        """Add this step's sketch ``sum_t g_t (g_t^T U)`` to :attr:`subspace_statistic`.

        ``g_t`` are the full ``d``-dim gradients of the residual stream at this stage's input boundary, one per token
        of every micro-batch, recorded by a tensor hook during backward (only the receiving stage knows them: the
        sender only ever sees ``g U``). Call once per optimizer step after backward; statistics of several stages
        (one boundary each) and of data-parallel replicas combine by summation. The first stage contributes zero."""
        if self.subspace is not None:
            self.subspace.commit_gradient_()

    @property
    def subspace_statistic(self) -> Tensor | None:
        """The accumulated ``C U`` (``d x k``, float32) for
        :func:`~lightning_hetero.subspace_pipeline.propose_basis`."""
        return None if self.subspace is None else self.subspace.accumulated

    def reset_subspace_statistic_(self) -> None:
        """Zero the accumulated statistic (``rebase_`` does it too)."""
        if self.subspace is not None:
            self.subspace.reset_gradient_()

    @torch.no_grad()
    def rebase_(self, new_basis: Tensor, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Switch to ``new_basis`` (identical on every rank), re-expressing confined weights and optimizer moments.

        Every confined matrix is replaced by its projection onto the new span: reparam ``Z <- R Z`` and
        ``E_k <- E_k R^T`` with ``R = U_new^T U_old``; projected ``W <- P_new W``, ``E <- E P_new``. First moments
        (``exp_avg``, ``momentum_buffer``) get the same linear map; reparam second moments get ``(R*R) v`` (exact only
        for diagonal R: an approximation), projected ones (shared along the constrained axis) are kept. The function
        changes by the part of the old weights outside the new span (zero when the spans agree); reconstruction at the
        boundaries stays exact because every writer lies in span(U_new) afterwards. The statistic is reset.
        """
        if self.subspace is None:
            raise ValueError("rebase_ needs a compressed model (config.compress=True).")
        old = self.subspace.basis
        if new_basis.shape != old.shape:
            raise ValueError(f"new basis has shape {tuple(new_basis.shape)}, expected {tuple(old.shape)}.")
        wide = wide_dtype(old.device)
        u_new = new_basis.to(device=old.device, dtype=wide)
        rotation = u_new.T @ old.to(wide)  # k x k: new coordinates = R @ old coordinates
        for module in self.modules():
            if isinstance(module, SubspaceLinear):
                rotate_parameter_(module.weight_coords, rotation, 0, optimizer)
                if module.bias_coords is not None:
                    rotate_parameter_(module.bias_coords, rotation, 0, optimizer)
            elif isinstance(module, SubspaceEmbedding) and module.mode == "reparam":
                rotate_parameter_(module.weight_coords, rotation, 1, optimizer)
        for parameter, axis in self.constrained_parameters().items():
            reproject_parameter_(parameter, u_new, axis, optimizer)
        old.copy_(new_basis.to(old))
        self.subspace.reset_gradient_()
