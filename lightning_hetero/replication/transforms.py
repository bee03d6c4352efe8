"""Chunked orthonormal DCT-II (and the identity chunker TopK uses) on local parameter shards.

A local shard is first viewed as a matrix (see :func:`matrix_view`): a vector of ``n`` elements is ``(1, n)``, a
matrix stays as it is, ``>= 3``-D tensors keep dim 0 and flatten the rest, a scalar is ``(1, 1)``. The matrix is cut
into blocks of ``block_rows x block_cols`` with ``block_rows = min(chunk, rows)`` and ``block_cols = min(chunk,
cols)``; each dimension is zero-padded up to a multiple of its block side (no divisor search, so a prime size costs
at most one partial block of padding instead of turning compression off). For a vector that is exactly 1-D chunking
with chunks of ``min(chunk, n)`` elements (a DCT of size 1 is the identity). A block side shrinks to the dimension
when the dimension is smaller than ``chunk``, so a ``(3, 8)`` shard is one ``3 x 8`` block, not a ``64 x 64`` block of
mostly padding.

:class:`ChunkedDCT` applies the separable orthonormal DCT-II ``Y = D_r X D_c^T`` per block (``D_n[k, i] =
sqrt(2/n) c_k cos(pi (2i + 1) k / (2n))``, ``c_0 = 1/sqrt(2)``, ``c_k = 1`` otherwise; the same as
``scipy.fft.dctn(block, norm="ortho")``) and returns coefficients shaped ``(n_blocks, block_rows * block_cols)``,
blocks in row-major block order and coefficients row-major inside a block. :meth:`ChunkedDCT.decode` inverts
(``X = D_r^T Y D_c``), un-pads and restores the original shape. Bases are float64-computed, stored float32 and cached
per ``(size, device)``; inputs of any floating dtype (bf16 included) are transformed in float32, so the error feedback
built on top stays exact to fp32 round-off.

:class:`FlatChunks` is the same interface without a transform: the flattened tensor cut into 1-D chunks of
``min(block, numel)`` elements (TopK uses ``block = chunk * chunk``). Empty shards have zero blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["BlockLayout", "ChunkedDCT", "FlatChunks", "dct_basis", "matrix_view"]


def matrix_view(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """The ``(rows, cols)`` matrix a tensor of ``shape`` is chunked as (dim 0 kept, trailing dims flattened)."""
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], math.prod(shape[1:])


@dataclass(frozen=True)
class BlockLayout:
    """How one tensor shape is cut into blocks."""

    shape: tuple[int, ...]
    """The original (local) shape."""
    rows: int
    """Matrix rows before padding (see :func:`matrix_view`)."""
    cols: int
    """Matrix columns before padding."""
    block_rows: int
    """Block height (``min(chunk, rows)``; 1 for vectors)."""
    block_cols: int
    """Block width (``min(chunk, cols)``)."""

    @property
    def numel(self) -> int:
        """Elements of the original tensor."""
        return self.rows * self.cols

    @property
    def padded_rows(self) -> int:
        """Rows after zero padding to a multiple of :attr:`block_rows`."""
        return -(-self.rows // self.block_rows) * self.block_rows if self.numel else 0

    @property
    def padded_cols(self) -> int:
        """Columns after zero padding to a multiple of :attr:`block_cols`."""
        return -(-self.cols // self.block_cols) * self.block_cols if self.numel else 0

    @property
    def grid(self) -> tuple[int, int]:
        """Blocks along rows and along columns."""
        if not self.numel:
            return 0, 0
        return self.padded_rows // self.block_rows, self.padded_cols // self.block_cols

    @property
    def n_blocks(self) -> int:
        """Number of blocks (0 for an empty tensor)."""
        grid_rows, grid_cols = self.grid
        return grid_rows * grid_cols

    @property
    def block_numel(self) -> int:
        """Coefficients per block."""
        return self.block_rows * self.block_cols if self.numel else 0


def _layout(shape: tuple[int, ...], max_rows: int, max_cols: int, flat: bool) -> BlockLayout:
    rows, cols = (1, math.prod(shape)) if flat else matrix_view(shape)
    if rows * cols == 0:
        return BlockLayout(shape, rows, cols, 0, 0)
    return BlockLayout(shape, rows, cols, min(max_rows, rows), min(max_cols, cols))


def _to_blocks(x: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """``(n_blocks, block_rows, block_cols)`` float32 blocks of ``x`` (zero padded)."""
    matrix = x.reshape(layout.rows, layout.cols).float()
    pad_rows, pad_cols = layout.padded_rows - layout.rows, layout.padded_cols - layout.cols
    if pad_rows or pad_cols:
        matrix = F.pad(matrix, (0, pad_cols, 0, pad_rows))
    grid_rows, grid_cols = layout.grid
    blocks = matrix.reshape(grid_rows, layout.block_rows, grid_cols, layout.block_cols).permute(0, 2, 1, 3)
    return blocks.reshape(layout.n_blocks, layout.block_rows, layout.block_cols)


def _from_blocks(blocks: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Inverse of :func:`_to_blocks`: crop the padding and restore ``layout.shape``."""
    grid_rows, grid_cols = layout.grid
    matrix = blocks.reshape(grid_rows, grid_cols, layout.block_rows, layout.block_cols).permute(0, 2, 1, 3)
    matrix = matrix.reshape(layout.padded_rows, layout.padded_cols)[: layout.rows, : layout.cols]
    return matrix.reshape(layout.shape)


def dct_basis(size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The orthonormal DCT-II matrix ``D`` (``size x size``, float32): ``D @ x == scipy.fft.dct(x, norm="ortho")``."""
    k = torch.arange(size, dtype=torch.float64)[:, None]
    i = torch.arange(size, dtype=torch.float64)[None, :]
    basis = torch.cos(math.pi * (2 * i + 1) * k / (2 * size)) * math.sqrt(2.0 / size)
    basis[0] /= math.sqrt(2.0)
    return basis.to(device=device, dtype=torch.float32)


class FlatChunks:
    """1-D chunks of the flattened tensor, no transform (the "parameter domain" of the TopK replicator).

    Args:
        block: Maximum chunk length (elements); shorter tensors are one chunk.
    """

    def __init__(self, block: int) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be a positive integer, got {block!r}.")
        self.block = block
        self._layouts: dict[tuple[int, ...], BlockLayout] = {}

    def layout(self, shape: torch.Size | tuple[int, ...]) -> BlockLayout:
        """The (cached) block layout of a tensor of ``shape``."""
        key = tuple(int(s) for s in shape)
        if key not in self._layouts:
            self._layouts[key] = _layout(key, 1, self.block, flat=True)
        return self._layouts[key]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``(n_blocks, block_numel)`` float32 chunks of ``x`` (zero padded)."""
        layout = self.layout(x.shape)
        if not layout.numel:
            return x.new_zeros(0, 0, dtype=torch.float32)
        return _to_blocks(x, layout).reshape(layout.n_blocks, layout.block_numel)

    def decode(self, coefficients: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """Inverse of :meth:`encode`: a float32 tensor of ``shape``."""
        layout = self.layout(shape)
        if not layout.numel:
            return coefficients.new_zeros(layout.shape, dtype=torch.float32)
        blocks = coefficients.float().reshape(layout.n_blocks, layout.block_rows, layout.block_cols)
        return _from_blocks(blocks, layout)


class ChunkedDCT(FlatChunks):
    """Blockwise orthonormal DCT-II on local shards: 2-D ``chunk x chunk`` blocks on matrices, 1-D chunks on vectors.

    Args:
        chunk: Block side (rows and columns of a 2-D block; length of a 1-D chunk).

    Example:
        >>> dct = ChunkedDCT(4)
        >>> coeffs = dct.encode(torch.ones(6, 4))  # padded to 8 x 4: two 4 x 4 blocks
        >>> tuple(coeffs.shape)
        (2, 16)
        >>> torch.allclose(dct.decode(coeffs, (6, 4)), torch.ones(6, 4))
        True
    """

    def __init__(self, chunk: int) -> None:
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be a positive integer (e.g. 64), got {chunk!r}.")
        super().__init__(chunk)
        self.chunk = chunk
        self._bases: dict[tuple[int, str], torch.Tensor] = {}

    def layout(self, shape: torch.Size | tuple[int, ...]) -> BlockLayout:
        """The (cached) block layout of a tensor of ``shape``."""
        key = tuple(int(s) for s in shape)
        if key not in self._layouts:
            self._layouts[key] = _layout(key, self.chunk, self.chunk, flat=False)
        return self._layouts[key]

    def basis(self, size: int, device: torch.device) -> torch.Tensor:
        """The cached float32 DCT-II basis of ``size`` on ``device``."""
        key = (size, str(device))
        basis = self._bases.get(key)
        if basis is None:
            basis = self._bases[key] = dct_basis(size, device)
        return basis

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """DCT coefficients of ``x``, float32, shaped ``(n_blocks, block_rows * block_cols)``."""
        layout = self.layout(x.shape)
        if not layout.numel:
            return x.new_zeros(0, 0, dtype=torch.float32)
        blocks = _to_blocks(x, layout)
        rows_basis = self.basis(layout.block_rows, x.device)
        cols_basis = self.basis(layout.block_cols, x.device)
        coefficients = torch.matmul(torch.matmul(rows_basis, blocks), cols_basis.T)
        return coefficients.reshape(layout.n_blocks, layout.block_numel)

    def decode(self, coefficients: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """Inverse DCT of ``coefficients`` (as returned by :meth:`encode`), cropped to ``shape``, float32."""
        layout = self.layout(shape)
        if not layout.numel:
            return coefficients.new_zeros(layout.shape, dtype=torch.float32)
        blocks = coefficients.float().reshape(layout.n_blocks, layout.block_rows, layout.block_cols)
        rows_basis = self.basis(layout.block_rows, coefficients.device)
        cols_basis = self.basis(layout.block_cols, coefficients.device)
        return _from_blocks(torch.matmul(torch.matmul(rows_basis.T, blocks), cols_basis), layout)
