"""layout.files_a_rank_reads: which files of a checkpoint a rank reads to restore it (what its pod's memory must hold
for a restore that reads no storage)."""

from __future__ import annotations

import pytest

from trainingrun_trainer.checkpoint.layout import files_a_rank_reads


@pytest.mark.parametrize(
    "saved_by, rank, reads",
    [
        (3, 1, {".metadata", "__1_0.distcp", "__0_replicated.distcp"}),  # its own shards and what every rank holds
        (3, 0, {".metadata", "__0_0.distcp", "__0_replicated.distcp"}),
        (2, 1, "all"),  # saved by another world size: resharded, from any file
    ],
)
def test_a_rank_of_a_sharded_state_saved_by_as_many_ranks_reads_its_own_files_and_the_replicated_items(
    saved_by, rank, reads
):
    files = [".metadata", "__0_0.distcp", "__0_replicated.distcp", "__1_0.distcp", "__2_0.distcp"]
    assert files_a_rank_reads(files, saved_by, 3, rank) == (set(files) if reads == "all" else reads)


def test_a_checkpoint_without_its_replicated_items_apart_is_read_whole():
    """DDP, or a sharded state on one or two pods: DCP spreads the replicated items over every rank's file."""
    files = [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    assert files_a_rank_reads(files, 3, 3, 1) == set(files)


def test_each_file_names_the_rank_that_wrote_it_and_the_rest_are_rank_0s():
    from trainingrun_trainer.checkpoint.layout import writing_rank

    assert [writing_rank(n) for n in ("__3_0.distcp", "__12_replicated.distcp", ".metadata", "__x_0.distcp")] == [
        3,
        12,
        0,
        0,
    ]
