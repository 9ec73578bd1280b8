"""The demo's data: the digits read from scikit-learn's file without importing scikit-learn are its own."""

from __future__ import annotations

import torch

from stalwart.launch.digits import digits_dataset


def test_the_digits_are_load_digits_scaled_to_the_unit_interval() -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    features, labels = digits_dataset().tensors
    assert torch.equal(features, torch.tensor(digits.data / 16.0, dtype=torch.float32))
    assert torch.equal(labels, torch.tensor(digits.target, dtype=torch.int64))
    assert features.shape == (1797, 64) and float(features.max()) == 1.0
