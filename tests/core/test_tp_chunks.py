"""The chunk arithmetic of tensor-parallel matrices agrees with torch.chunk (DTensor's Shard)."""

import pytest
import torch

from dmuon.tp import chunk_bounds


@pytest.mark.parametrize("length", [1, 2, 5, 7, 8, 30, 37, 52])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_chunk_bounds_are_torch_chunks_with_empty_tails(length, parts):
    chunks = torch.arange(length).chunk(parts)
    for index in range(parts):
        start, stop = chunk_bounds(length, parts, index)
        expected = chunks[index].tolist() if index < len(chunks) else []
        assert list(range(start, stop)) == expected
