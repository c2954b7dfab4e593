"""hybridflow.utils.model: verl's create_random_mask and compute_position_id_with_mask."""

import numpy as np
import pytest
import torch

from hybridflow.utils.model import compute_position_id_with_mask, create_random_mask


def test_random_mask_is_padding_ones_padding_within_the_ratios():
    np.random.seed(0)
    mask = create_random_mask(torch.zeros(50, 20, dtype=torch.long), 0.5, 0.25, min_ratio_of_valid_token=0.2)
    assert mask.dtype == torch.int64 and mask.shape == (50, 20)
    for row in mask.tolist():
        first = row.index(1)
        ones = sum(row)
        assert first <= 5 and 4 <= ones <= 10  # left pad <= int(20 * 0.25); 4 <= valid <= 10
        assert row[first : first + ones] == [1] * ones  # one contiguous run of ones
    np.random.seed(0)
    again = create_random_mask(torch.zeros(50, 20, dtype=torch.long), 0.5, 0.25, min_ratio_of_valid_token=0.2)
    assert torch.equal(mask, again)  # numpy's global seed decides, as in verl
    with pytest.raises(ValueError):
        create_random_mask(torch.zeros(2, 10), 0.9, 0.5)  # 9 valid + 5 padding > 10


def test_position_ids_count_real_tokens():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    assert compute_position_id_with_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2]]
