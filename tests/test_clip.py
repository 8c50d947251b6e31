"""Global gradient norm and clipping against hand-computed values."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from wse_core.optim import clip_coefficient, clip_grad_norm_, global_norm


def test_global_norm_hand_computed():
    """|(3, 4)| and |(12,)| together: sqrt(9 + 16 + 144) = 13."""
    assert global_norm([np.array([3.0, 4.0], np.float32), np.array([12.0])]) == 13.0
    assert global_norm({"a": np.array([[1.0, 2.0], [2.0, 4.0]])}) == 5.0
    assert global_norm([]) == 0.0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_global_norm_large_matches_fsum(rng, dtype):
    """Arrays spanning many blocks and threads agree with an exactly rounded sum."""
    arrays = [rng.standard_normal(n).astype(dtype) for n in (1, 4095, 4097, 1_000_003)]
    exact = math.sqrt(math.fsum(float(v) ** 2 for a in arrays for v in a.astype(np.float64)))
    assert global_norm(arrays) == pytest.approx(exact, rel=1e-13)


def test_global_norm_same_bits_for_any_thread_count():
    """The norm is bit-identical with 1 and 2 OpenMP threads (fixed blocks, fixed order)."""
    code = ("import numpy as np; from wse_core.optim import global_norm; "
            "x = np.random.default_rng(7).standard_normal(3_000_001).astype(np.float32); "
            "print(global_norm([x]).hex())")
    out = set()
    for threads in ("1", "2"):
        env = dict(os.environ, OMP_NUM_THREADS=threads)
        out.add(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                               capture_output=True, text=True).stdout.strip())
    assert len(out) == 1, out


def test_clip_scales_to_max_norm():
    """Norm 13 clipped to 6.5 halves every gradient (up to the 1e-6 guard) and returns 13."""
    grads = [np.array([3.0, 4.0]), np.array([12.0], np.float32)]
    norm = clip_grad_norm_(grads, 6.5)
    assert norm == 13.0
    coef = 6.5 / (13.0 + 1e-6)
    np.testing.assert_allclose(grads[0], [3.0 * coef, 4.0 * coef], rtol=1e-15)
    np.testing.assert_allclose(grads[1], [np.float32(12.0) * np.float32(coef)], rtol=1e-7)
    assert global_norm(grads) == pytest.approx(6.5, rel=1e-6)


def test_clip_leaves_small_gradients_alone():
    grads = {"w": np.array([0.3, 0.4])}
    assert clip_grad_norm_(grads, 1.0) == pytest.approx(0.5)
    np.testing.assert_array_equal(grads["w"], [0.3, 0.4])


def test_clip_coefficient():
    assert clip_coefficient(13.0, 6.5) == 6.5 / (13.0 + 1e-6)
    assert clip_coefficient(0.0, 1.0) == 1.0
    with pytest.raises(ValueError, match="max_norm: expected a number >= 0, got -1.0"):
        clip_coefficient(1.0, -1.0)


def test_clip_rejects_bad_arrays():
    with pytest.raises(TypeError, match=r"arrays\[1\]: expected float32 or float64, got int64"):
        clip_grad_norm_([np.zeros(2), np.zeros(2, np.int64)], 1.0)
    with pytest.raises(ValueError, match=r"arrays\['b'\]: expected a C-contiguous array"):
        global_norm({"a": np.zeros(2), "b": np.zeros((3, 3))[:, 0]})
