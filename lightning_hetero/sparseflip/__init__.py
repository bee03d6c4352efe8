"""Low-bit (ternary / binary) training, framework-free: quantizers, layers, flip optimizers, sparse exchange, packing.

After the seed essay "Low-bit training" (issue 14): weights in ``{-1, 0, +1}`` or ``{-1, +1}`` with an fp scale,
trained either through latent fp weights with a straight-through estimator (``mode="ste"``) or held only as int8 codes
and moved by flip optimizers (``mode="flip"``; :class:`BopFlip` with trainable per-row scales trains best, see
`recipes/sparseflip/lowbit_experiments.py`); the flip step can be distributed by exchanging thresholded sparse
gradients through a parameter server or an all-gather (every byte through :mod:`lightning_hetero.comm`). Nothing here
imports Lightning.
"""

from lightning_hetero.sparseflip.bop import BopFlip
from lightning_hetero.sparseflip.convert import DEFAULT_SKIP, SUPPORTED_TYPES, convert_model
from lightning_hetero.sparseflip.flip import (
    AccumulatedFlip,
    CodeLayout,
    FlipOptimizer,
    StochasticFlip,
    TopKFlip,
    apply_moves,
    move_allowed,
    topk_moves,
)
from lightning_hetero.sparseflip.layers import (
    MODES,
    BinaryConv2d,
    BinaryLinear,
    LowBitConv2d,
    LowBitLinear,
    TernaryConv2d,
    TernaryLinear,
    lowbit_layers,
)
from lightning_hetero.sparseflip.packing import (
    load_packed,
    pack_binary,
    pack_ternary_2bit,
    pack_ternary_base3,
    packed_matmul,
    save_packed,
    unpack_binary,
    unpack_ternary_2bit,
    unpack_ternary_base3,
)
from lightning_hetero.sparseflip.quant import (
    binary_quantize,
    dequantize,
    quantize,
    quantize_ste,
    sign_ste,
    ternary_quantize,
)
from lightning_hetero.sparseflip.settings import CodeExchangeSettings, FlipSettings, FpSyncSettings, SparseFlipSettings
from lightning_hetero.sparseflip.sparse import SparseFlipExchange, aggregate_flips, exchange_bytes, select_sparse
from lightning_hetero.sparseflip.wire import decode_flips, decode_sparse, encode_flips, encode_sparse

__all__ = [
    "DEFAULT_SKIP",
    "MODES",
    "SUPPORTED_TYPES",
    "AccumulatedFlip",
    "BinaryConv2d",
    "BinaryLinear",
    "BopFlip",
    "CodeExchangeSettings",
    "CodeLayout",
    "FlipOptimizer",
    "FlipSettings",
    "FpSyncSettings",
    "LowBitConv2d",
    "LowBitLinear",
    "SparseFlipExchange",
    "SparseFlipSettings",
    "StochasticFlip",
    "TernaryConv2d",
    "TernaryLinear",
    "TopKFlip",
    "aggregate_flips",
    "apply_moves",
    "binary_quantize",
    "convert_model",
    "decode_flips",
    "decode_sparse",
    "dequantize",
    "encode_flips",
    "encode_sparse",
    "exchange_bytes",
    "load_packed",
    "lowbit_layers",
    "move_allowed",
    "pack_binary",
    "pack_ternary_2bit",
    "pack_ternary_base3",
    "packed_matmul",
    "quantize",
    "quantize_ste",
    "save_packed",
    "select_sparse",
    "sign_ste",
    "ternary_quantize",
    "topk_moves",
    "unpack_binary",
    "unpack_ternary_2bit",
    "unpack_ternary_base3",
]
