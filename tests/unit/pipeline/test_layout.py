"""The pipeline's rank layout and balanced layer split."""

from __future__ import annotations

import pytest

from lightning_hetero.pipeline.layout import PipelineGroups, PipelineLayout, split_layers


def test_split_layers_is_balanced_and_contiguous() -> None:
    assert split_layers(4, 2) == [(0, 2), (2, 4)]
    assert split_layers(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert split_layers(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="num_stages=5 exceeds the model's 4 decoder layers"):
        split_layers(4, 5)
    with pytest.raises(ValueError, match="positive integer"):
        split_layers(4, 0)


def test_layout_is_stage_major_and_groups_without_a_process_group() -> None:
    layout = PipelineLayout(num_stages=3, data_parallel_size=2)
    assert layout.world_size == 6
    assert [layout.stage_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert layout.pipeline_ranks(1) == [1, 3, 5] and layout.replica_ranks(2) == [4, 5]
    groups = PipelineGroups(layout, rank=3)  # no torch.distributed: neighbours only, no groups created
    assert (groups.stage, groups.dp_rank, groups.prev_rank, groups.next_rank) == (1, 1, 1, 5)
    assert groups.pipeline_group is None and groups.dp_group is None
    with pytest.raises(ValueError, match="the world has 4 processes but num_stages=3 x data_parallel_size=2 needs 6"):
        layout.check_world(4)
