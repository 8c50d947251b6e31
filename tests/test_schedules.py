"""Learning-rate schedules against hand-computed values, and their config errors."""
import math

import pytest

from wse_core.optim import Constant, CosineDecay, Linear, Sequential, make_schedule


def test_constant():
    s = make_schedule(3e-4)
    assert isinstance(s, Constant) and s(0) == s(10**6) == 3e-4


def test_linear_warmup_and_decay():
    warm = Linear(0.0, 1e-3, 10)
    assert [warm(t) for t in (0, 5, 10, 20)] == [0.0, 5e-4, 1e-3, 1e-3]
    decay = Linear(1e-3, 0.0, 4)
    assert [decay(t) for t in (0, 1, 4, 9)] == pytest.approx([1e-3, 7.5e-4, 0.0, 0.0])


def test_cosine_decay():
    s = CosineDecay(1e-3, 1e-5, 100)
    assert s(0) == pytest.approx(1e-3)
    assert s(50) == pytest.approx(1e-5 + (1e-3 - 1e-5) / 2)
    assert s(25) == pytest.approx(1e-5 + (1e-3 - 1e-5) * (1 + math.cos(math.pi / 4)) / 2)
    assert s(100) == pytest.approx(1e-5) and s(1000) == pytest.approx(1e-5)


def test_sequence_from_model_zoo_config():
    """Linear warm-up for 10 steps, then cosine decay over 90 (Model Zoo keys)."""
    s = make_schedule([
        {"scheduler": "Linear", "initial_learning_rate": 0.0, "end_learning_rate": 1e-3, "total_iters": 10},
        {"scheduler": "CosineDecay", "initial_learning_rate": 1e-3, "end_learning_rate": 0.0,
         "total_iters": 90},
    ])
    assert isinstance(s, Sequential)
    assert s(0) == 0.0 and s(5) == pytest.approx(5e-4)
    assert s(10) == pytest.approx(1e-3)          # first step of the cosine
    assert s(55) == pytest.approx(5e-4)          # half-way through the cosine
    assert s(100) == pytest.approx(0.0, abs=1e-18) and s(500) == pytest.approx(0.0, abs=1e-18)


def test_single_mapping_and_names():
    assert make_schedule({"scheduler": "cosinedecaylr", "initial_learning_rate": 1.0,
                          "end_learning_rate": 0.0, "total_iters": 2})(1) == pytest.approx(0.5)


@pytest.mark.parametrize("spec,match", [
    ("fast", r"learning_rate: expected a number or a mapping"),
    (-1.0, r"learning_rate: expected >= 0.0, got -1.0"),
    ([], r"learning_rate: expected at least one scheduler"),
    ({"initial_learning_rate": 1.0}, r"learning_rate.scheduler: missing"),
    ({"scheduler": "Exponential"}, r"learning_rate.scheduler: unknown scheduler 'Exponential'"),
    ({"scheduler": "Linear", "initial_learning_rate": 1.0, "end_learning_rate": 0.0},
     r"learning_rate.total_iters: missing for Linear"),
    ({"scheduler": "Linear", "initial_learning_rate": 1.0, "end_learning_rate": 0.0, "total_iters": 0},
     r"learning_rate.total_iters: expected an integer >= 1, got 0"),
    ({"scheduler": "Linear", "initial_learning_rate": "x", "end_learning_rate": 0.0, "total_iters": 5},
     r"learning_rate.initial_learning_rate: expected a number, got 'x'"),
    ({"scheduler": "Constant", "learning_rate": 1.0, "warmup": 3},
     r"learning_rate.warmup: unknown key for Constant"),
    ([{"scheduler": "Constant", "learning_rate": 1.0}, {"scheduler": "Constant", "learning_rate": 0.1}],
     r"learning_rate\[0\].total_iters: missing for Constant"),
])
def test_bad_specs_name_the_key(spec, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make_schedule(spec)
