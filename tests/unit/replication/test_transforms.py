"""Chunked DCT-II against scipy.fft (norm="ortho"): 1-D and 2-D blocks, padding, >= 3-D, empty, bf16 inputs."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.fft
import torch

from lightning_hetero.replication.transforms import ChunkedDCT, FlatChunks, dct_basis


def _reference_blocks(x: np.ndarray, chunk: int) -> np.ndarray:
    """Independent reference: pad to block multiples, scipy dctn per block, blocks in row-major order."""
    matrix = x.reshape(1, -1) if x.ndim == 1 else x.reshape(x.shape[0], -1)
    rows, cols = matrix.shape
    block_rows, block_cols = min(chunk, rows), min(chunk, cols)
    padded = np.zeros((-(-rows // block_rows) * block_rows, -(-cols // block_cols) * block_cols))
    padded[:rows, :cols] = matrix
    out = []
    for r in range(0, padded.shape[0], block_rows):
        for c in range(0, padded.shape[1], block_cols):
            out.append(scipy.fft.dctn(padded[r : r + block_rows, c : c + block_cols], norm="ortho").reshape(-1))
    return np.stack(out)


def test_basis_matches_scipy(device: torch.device) -> None:
    for size in (1, 2, 7, 64):
        reference = scipy.fft.dct(np.eye(size), norm="ortho", axis=0)
        basis = dct_basis(size, device)
        assert basis.device == device
        assert np.allclose(basis.double().cpu().numpy(), reference, atol=1e-6)


@pytest.mark.parametrize(
    ("shape", "chunk", "blocks", "block_numel"),
    [
        ((128,), 64, 2, 64),  # 1-D exact multiple
        ((100,), 64, 2, 64),  # 1-D padded
        ((5,), 64, 1, 5),  # short vector: one chunk of its length
        ((64, 128), 64, 2, 4096),  # 2-D exact
        ((70, 33), 16, 15, 256),  # 2-D padded both ways (5 x 3 blocks)
        ((3, 8), 64, 1, 24),  # small shard: one 3 x 8 block
        ((6, 2, 5), 4, 6, 16),  # 3-D flattened to 6 x 10, padded to 8 x 12
        ((), 4, 1, 1),  # scalar
    ],
)
def test_encode_matches_scipy_and_round_trips(
    shape: tuple[int, ...], chunk: int, blocks: int, block_numel: int, device: torch.device
) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape) + chunk)).to(device)
    dct = ChunkedDCT(chunk)
    coefficients = dct.encode(x)
    assert coefficients.shape == (blocks, block_numel) and coefficients.dtype == torch.float32
    assert coefficients.device == x.device
    reference = _reference_blocks(x.double().cpu().numpy().reshape(shape if shape else (1,)), chunk)
    assert np.allclose(coefficients.double().cpu().numpy(), reference, atol=1e-5)
    decoded = dct.decode(coefficients, shape)
    assert decoded.shape == x.shape and decoded.device == x.device
    assert torch.allclose(decoded, x, atol=1e-5)


def test_empty_shards_have_no_blocks(device: torch.device) -> None:
    dct = ChunkedDCT(64)
    for shape in ((0,), (0, 16), (16, 0), (0, 3, 4)):
        coefficients = dct.encode(torch.zeros(shape, device=device))
        assert coefficients.numel() == 0 and dct.layout(shape).n_blocks == 0
        decoded = dct.decode(coefficients, shape)
        assert decoded.shape == shape and decoded.device == device


def test_bf16_input_uses_fp32_bases(device: torch.device) -> None:
    x = torch.randn(96, 80, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=torch.bfloat16)
    dct = ChunkedDCT(32)
    coefficients = dct.encode(x)
    assert coefficients.dtype == torch.float32
    error = (dct.decode(coefficients, x.shape) - x.float()).abs().max().item()
    assert error < 1e-5  # the anchors' bf16 bases give ~5e-3
    assert all(basis.dtype == torch.float32 for basis in dct._bases.values())
    assert set(dct._bases) == {(32, str(x.device))}  # cached per (size, device)
    assert all(basis.device == x.device for basis in dct._bases.values())


def test_flat_chunks_are_identity_blocks(device: torch.device) -> None:
    x = torch.arange(10.0, device=device).reshape(2, 5)
    chunks = FlatChunks(4)
    encoded = chunks.encode(x)
    assert encoded.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 0]]
    assert torch.equal(chunks.decode(encoded, x.shape), x)


@pytest.mark.parametrize("chunk", [0, -3, 2.5, True, "64"])
def test_bad_chunk(chunk: object) -> None:
    with pytest.raises(ValueError, match="chunk must be a positive integer"):
        ChunkedDCT(chunk)  # type: ignore[arg-type]
