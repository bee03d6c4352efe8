"""SubspacePipelineStrategy argument errors, raised before training starts (no processes are spawned)."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch

from lightning_hetero.pipeline.settings import PipelineSettings
from lightning_hetero.strategies.subspace_pipeline.fabric import (
    SubspacePipelineStrategy as FabricSubspacePipelineStrategy,
)
from lightning_hetero.strategies.subspace_pipeline.trainer import SubspacePipelineStrategy
from lightning_hetero.subspace_pipeline import checkpoint as ckpt
from lightning_hetero.subspace_pipeline.pipeline import split_batch
from lightning_hetero.subspace_pipeline.settings import SubspacePipelineSettings


@pytest.mark.parametrize("cls", [SubspacePipelineStrategy, FabricSubspacePipelineStrategy])
def test_bad_arguments_name_the_argument(cls):
    with pytest.raises(ValueError, match=r"schedule='zigzag' is not a known schedule"):
        cls(settings=SubspacePipelineSettings(subspace_dim=8, schedule="zigzag"))
    with pytest.raises(ValueError, match="interleaved schedules need several stages per rank"):
        cls(settings=SubspacePipelineSettings(subspace_dim=8, schedule="interleaved"))
    with pytest.raises(ValueError, match="subspace_dim"):
        cls(settings=SubspacePipelineSettings(subspace_dim=8, dim_ratio=4.0))  # exclusive
    assert cls().runtime.config.dim_ratio == 16.0  # the default when neither is given
    with pytest.raises(ValueError, match=r"num_stages=0: use an int >= 1"):
        cls(settings=SubspacePipelineSettings(pipeline=PipelineSettings(num_stages=0), subspace_dim=8))
    with pytest.raises(ValueError, match=r"n_microbatches=0: use an int >= 1"):
        cls(settings=SubspacePipelineSettings(subspace_dim=8, n_microbatches=0))
    with pytest.raises(ValueError, match=r"update_every=5 with .*compress=False: there is no subspace"):
        cls(settings=SubspacePipelineSettings(compress=False, update_every=5))
    with pytest.raises(ValueError, match="mode"):
        cls(settings=SubspacePipelineSettings(subspace_dim=8, mode="sideways"))
    cls(settings=SubspacePipelineSettings(compress=False))  # the plain pipeline needs no subspace_dim


def test_world_size_must_be_stages_times_replicas():
    settings = SubspacePipelineSettings(pipeline=PipelineSettings(data_parallel_size=2), subspace_dim=8)
    strategy = SubspacePipelineStrategy(settings=settings, start_method="spawn")
    with pytest.raises(ValueError, match=r"world has 3 processes but num_stages=2 x data_parallel_size=2 needs 4"):
        L.Trainer(accelerator="cpu", devices=3, strategy=strategy, logger=False)


def test_gradient_accumulation_is_refused_with_the_fix():
    strategy = SubspacePipelineStrategy(settings=SubspacePipelineSettings(subspace_dim=8))
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=4.*Raise n_microbatches"):
        strategy._check_trainer(SimpleNamespace(accumulate_grad_batches=4))
    strategy._check_trainer(SimpleNamespace(accumulate_grad_batches=1))


def test_batches_must_split_into_equal_microbatches():
    ids = torch.zeros(6, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"n_microbatches=4\): the batch has 6 sequences"):
        split_batch({"input_ids": ids}, 4)
    chunks = split_batch({"input_ids": ids, "attention_mask": torch.ones(6, 4)}, 3)
    assert [c["input_ids"].shape[0] for c in chunks] == [2, 2, 2]
    assert all(torch.equal(c["labels"], c["input_ids"]) for c in chunks)  # labels default to the ids
    with pytest.raises(TypeError, match="dict with 'input_ids'"):
        split_batch([1, 2, 3], 1)


def test_checkpoint_of_another_pipeline_is_refused(tmp_path):
    ckpt.write_meta(tmp_path, {"num_stages": 4, "rank": 8, "compress": True, "layer_ranges": [[0, 1], [1, 2]]})
    meta = ckpt.read_meta(tmp_path)
    with pytest.raises(ValueError, match=r"num_stages: saved 4, now 2.*rank: saved 8, now 16"):
        ckpt.check_meta(meta, {"num_stages": 2, "rank": 16, "compress": True}, tmp_path)
    ckpt.check_meta(meta, {"num_stages": 4, "rank": 8, "layer_ranges": [(0, 1), (1, 2)]}, tmp_path)
    with pytest.raises(FileNotFoundError, match="not a SubspacePipelineStrategy checkpoint"):
        ckpt.read_meta(tmp_path / "elsewhere.ckpt")
