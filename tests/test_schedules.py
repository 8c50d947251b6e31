"""Learning-rate schedules against hand-computed values, and their config errors."""
import math

import pytest

from wse_core.optim import Chained, Constant, CosineDecay, Linear, Sequential, make_schedule


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
    (-1.0, r"learning_rate: expected a number >= 0, got -1.0"),
    ([], r"learning_rate: expected at least one scheduler"),
    ({"initial_learning_rate": 1.0}, r"learning_rate.scheduler: missing"),
    ({"scheduler": "Frobnicate"}, r"learning_rate.scheduler: unknown scheduler 'Frobnicate'"),
    ({"scheduler": "LambdaLR", "initial_learning_rate": 1.0}, r"needs a Python function"),
    ({"scheduler": "Exponential", "initial_learning_rate": 1.0, "total_iters": 5},
     r"learning_rate.decay_rate: missing for Exponential"),
    ([{"scheduler": "Exponential", "initial_learning_rate": 1.0, "total_iters": 5, "decay_rate": 0.5},
      {"scheduler": "Step", "initial_learning_rate": 1.0, "step_size": 2, "gamma": 0.5},
      {"scheduler": "Constant", "learning_rate": 0.1}],
     r"learning_rate\[1\]: Step has no end, so it can only be the last of a sequence"),
    ({"scheduler": "PiecewiseConstant", "values": [1.0, 0.5], "boundaries": [3, 5]},
     r"learning_rate.learning_rates: expected one more value than milestones \(2\), got 2"),
    ({"scheduler": "MultiStepLR", "initial_learning_rate": 1.0, "gamma": 0.1, "milestones": [5, 3]},
     r"learning_rate.milestones: expected increasing steps"),
    ({"scheduler": "CosineAnnealingWarmRestarts", "initial_learning_rate": 1.0, "T_0": 4, "T_mult": 2},
     r"learning_rate.T_mult: only 1 is supported"),
    ({"scheduler": "CyclicLR", "base_lr": 0.1, "max_lr": 1.0, "mode": "sine"},
     r"learning_rate.mode: expected one of triangular, triangular2, exp_range, got 'sine'"),
    ({"scheduler": "Linear", "initial_learning_rate": 1.0, "learning_rate": 2.0, "end_learning_rate": 0.0,
      "total_iters": 3}, r"learning_rate.learning_rate: given twice"),
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


def lr(spec, steps):
    s = make_schedule(spec)
    return [s(t) for t in steps]


def test_model_zoo_schedulers_by_both_spellings():
    """Each of Model Zoo's schedulers against its formula written out here (torch's and Keras'
    documented closed forms), under its 1.x name and its 2.x class name."""
    for name in ("Polynomial", "PolynomialLR"):
        got = lr({"scheduler": name, "initial_learning_rate": 1.0, "end_learning_rate": 0.1, "total_iters": 4,
                  "power": 2.0}, [0, 1, 3, 4, 9])
        assert got == pytest.approx([1.0, 0.1 + 0.9 * 0.75 ** 2, 0.1 + 0.9 * 0.25 ** 2, 0.1, 0.1])
    for name in ("Exponential", "ExponentialLR"):
        assert lr({"scheduler": name, "initial_learning_rate": 2.0, "total_iters": 4, "decay_rate": 0.5},
                  [0, 2, 8]) == pytest.approx([2.0, 2.0 * 0.5 ** 0.5, 0.5])
    assert lr({"scheduler": "exponentiallr", "initial_learning_rate": 2.0, "total_iters": 4, "decay_rate": 0.5,
               "staircase": True}, [3, 4, 9]) == pytest.approx([2.0, 1.0, 0.5])
    assert lr({"scheduler": "InverseExponentialTimeDecayLR", "initial_learning_rate": 1.0, "step_exponent": 2,
               "total_iters": 10, "decay_rate": 0.5}, [0, 2, 10]) == pytest.approx([1.0, 1 / 1.2, 1 / 6.0])
    assert lr({"scheduler": "InverseSquareRootDecay", "initial_learning_rate": 0.5, "scale": 2.0, "warmup_steps": 4},
              [0, 4, 16]) == pytest.approx([0.5, 0.5, 0.25])
    assert lr({"scheduler": "PiecewiseConstantLR", "learning_rates": [1.0, 0.5, 0.1], "milestones": [3, 5]},
              [0, 2, 3, 4, 5, 99]) == [1.0, 1.0, 0.5, 0.5, 0.1, 0.1]
    assert lr({"scheduler": "PiecewiseConstant", "values": [1.0, 0.5], "boundaries": [3]}, [2, 3]) == [1.0, 0.5]
    assert lr({"scheduler": "MultiStep", "initial_learning_rate": 1.0, "gamma": 0.1, "milestones": [2, 5]},
              [1, 2, 5]) == pytest.approx([1.0, 0.1, 0.01])
    assert lr({"scheduler": "StepLR", "initial_learning_rate": 1.0, "step_size": 3, "gamma": 0.5},
              [2, 3, 6]) == pytest.approx([1.0, 0.5, 0.25])
    assert lr({"scheduler": "CosineAnnealing", "initial_learning_rate": 1.0, "t_max": 4, "eta_min": 0.2},
              [0, 2, 4, 8]) == pytest.approx([1.0, 0.6, 0.2, 1.0])
    assert lr({"scheduler": "CosineAnnealingWarmRestarts", "initial_learning_rate": 1.0, "T_0": 4},
              [0, 2, 4, 6]) == pytest.approx([1.0, 0.5, 1.0, 0.5])
    assert lr({"scheduler": "MultiplicativeLR", "initial_learning_rate": 1.0, "coefficient": 0.9},
              [0, 3]) == pytest.approx([1.0, 0.729])


def test_cyclic_modes():
    base = {"scheduler": "CyclicLR", "base_lr": 0.1, "max_lr": 1.1, "step_size_up": 2, "step_size_down": 2}
    assert lr(base, [0, 1, 2, 3, 4, 6]) == pytest.approx([0.1, 0.6, 1.1, 0.6, 0.1, 1.1])
    assert lr(dict(base, mode="triangular2"), [2, 6, 10]) == pytest.approx([1.1, 0.6, 0.35])
    assert lr(dict(base, mode="exp_range", gamma=0.5), [2, 6]) == pytest.approx([0.1 + 1.0 * 0.25, 0.1 + 0.5 ** 6])


def test_one_cycle():
    # The peak at step pct_start * total_steps - 1 = 4, the end (0.1 / final_div_factor) at step 10.
    spec = {"scheduler": "OneCycleLR", "initial_learning_rate": 0.1, "max_lr": 1.0, "total_steps": 11,
            "pct_start": 5 / 11, "anneal_strategy": "linear"}
    got = lr(spec, [0, 2, 4, 7, 10])
    assert got == pytest.approx([0.1, 0.55, 1.0, 1.0 + (1e-5 - 1.0) / 2, 1e-5])
    cos = lr(dict(spec, anneal_strategy="cos"), [0, 2, 4])
    assert cos == pytest.approx([0.1, 0.55, 1.0])


def test_sequential_milestones_and_chained():
    warm = {"scheduler": "LinearLR", "initial_learning_rate": 0.0, "end_learning_rate": 1.0, "total_iters": 4}
    decay = {"scheduler": "StepLR", "initial_learning_rate": 1.0, "step_size": 2, "gamma": 0.5}
    seq = make_schedule({"scheduler": "SequentialLR", "schedulers": [warm, decay], "milestones": [4]})
    assert [seq(t) for t in (0, 2, 4, 6, 8)] == pytest.approx([0.0, 0.5, 1.0, 0.5, 0.25])
    assert [make_schedule([warm, decay])(t) for t in (0, 6)] == pytest.approx([0.0, 0.5])   # milestones implied
    # Chained: the product, each scheduler after the first relative to its start.
    chain = make_schedule([dict(warm, main_scheduler="chained"),
                           {"scheduler": "Exponential", "initial_learning_rate": 3.0, "total_iters": 1,
                            "decay_rate": 0.5}])
    assert isinstance(chain, Chained)
    assert [chain(t) for t in (0, 2, 4)] == pytest.approx([0.0, 0.5 * 0.25, 1.0 * 0.0625])


def test_old_aliases_and_ignored_alpha():
    """1.x files: ``steps``/``decay_steps`` for total_iters, ``learning_rate`` for the initial rate, and
    ``alpha`` (which Model Zoo's PyTorch schedulers never read)."""
    s = make_schedule([{"scheduler": "Linear", "learning_rate": 0.0, "end_learning_rate": 1.0, "steps": 2},
                       {"scheduler": "CosineDecay", "initial_learning_rate": 1.0, "end_learning_rate": 0.0,
                        "decay_steps": 4, "alpha": 0.1}])
    assert [s(t) for t in (0, 1, 2, 4, 6, 9)] == pytest.approx([0.0, 0.5, 1.0, 0.5, 0.0, 0.0], abs=1e-15)
    assert make_schedule({"scheduler": "Constant", "initial_learning_rate": 0.3})(5) == 0.3
