"""Shared fixtures: per-dtype tolerances and a seeded random generator."""
import numpy as np
import pytest

# Tolerances of a float32 or float64 kernel against a float64 reference of the same formula.
RTOL = {np.float32: 2e-5, np.float64: 1e-12}


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
