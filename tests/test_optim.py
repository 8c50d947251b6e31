"""Fused optimizers against float64 numpy references of the documented torch.optim formulas."""
import numpy as np
import pytest

from conftest import RTOL
from wse_core.optim import SGD, Adam, AdamW, make_optimizer

DTYPES = [np.float32, np.float64]
STEPS = 6


def ref_sgd(theta, grads, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
    """torch.optim.SGD as documented, in float64."""
    theta = theta.astype(np.float64)
    b = None
    for t, g in enumerate(grads, start=1):
        g = g.astype(np.float64)
        if weight_decay:
            g = g + weight_decay * theta
        if momentum:
            b = g if t == 1 else momentum * b + (1 - dampening) * g
            g = g + momentum * b if nesterov else b
        theta = theta - lr * g
    return theta


def ref_adam(theta, grads, lr, betas, eps, weight_decay, decoupled):
    """torch.optim.Adam (decoupled=False) / AdamW (decoupled=True) as documented, in float64."""
    theta = theta.astype(np.float64)
    m = np.zeros_like(theta)
    v = np.zeros_like(theta)
    b1, b2 = betas
    for t, g in enumerate(grads, start=1):
        g = g.astype(np.float64)
        if decoupled:
            theta = theta - lr * weight_decay * theta
        elif weight_decay:
            g = g + weight_decay * theta
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat = m / (1 - b1**t)
        v_hat = v / (1 - b2**t)
        theta = theta - lr * m_hat / (np.sqrt(v_hat) + eps)
    return theta, m, v


def run(opt, theta, grads, **kw):
    w = theta.copy()
    state = opt.init_state(w)
    for t, g in enumerate(grads, start=1):
        opt.update(w, g, state, step=t, **kw)
    return w, state


def problem(rng, dtype, shape=(37, 129)):
    """A parameter and STEPS gradients; 37*129 elements is not a multiple of any block size."""
    theta = rng.standard_normal(shape).astype(dtype)
    grads = [rng.standard_normal(shape).astype(dtype) for _ in range(STEPS)]
    return theta, grads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hp", [
    {},
    {"weight_decay": 0.1},
    {"momentum": 0.9},
    {"momentum": 0.9, "dampening": 0.3, "weight_decay": 0.05},
    {"momentum": 0.8, "nesterov": True, "weight_decay": 0.01},
])
def test_sgd_matches_reference(rng, dtype, hp):
    """SGD, with momentum, dampening and Nesterov, equals the documented formula."""
    theta, grads = problem(rng, dtype)
    w, _ = run(SGD(lr=0.05, **hp), theta, grads)
    assert w.dtype == dtype
    np.testing.assert_allclose(w, ref_sgd(theta, grads, 0.05, **hp), rtol=RTOL[dtype], atol=RTOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls,decoupled", [(Adam, False), (AdamW, True)])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_matches_reference(rng, dtype, cls, decoupled, weight_decay):
    """Adam and AdamW, with bias correction and weight decay, equal the documented formulas."""
    theta, grads = problem(rng, dtype)
    hp = {"lr": 0.01, "betas": (0.85, 0.995), "eps": 1e-7, "weight_decay": weight_decay}
    w, state = run(cls(**hp), theta, grads)
    ref_w, ref_m, ref_v = ref_adam(theta, grads, hp["lr"], hp["betas"], hp["eps"], weight_decay, decoupled)
    tol = RTOL[dtype]
    np.testing.assert_allclose(w, ref_w, rtol=tol, atol=tol)
    np.testing.assert_allclose(state["exp_avg"], ref_m, rtol=tol, atol=tol)
    np.testing.assert_allclose(state["exp_avg_sq"], ref_v, rtol=tol, atol=tol)


def test_adam_and_adamw_differ_with_weight_decay(rng):
    """L2 (Adam) and decoupled (AdamW) weight decay are different updates."""
    theta, grads = problem(rng, np.float64)
    wa, _ = run(Adam(lr=0.01, weight_decay=0.1), theta, grads)
    ww, _ = run(AdamW(lr=0.01, weight_decay=0.1), theta, grads)
    assert np.abs(wa - ww).max() > 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("opt", [SGD(lr=0.1, momentum=0.9), AdamW(lr=0.01)], ids=["sgd", "adamw"])
def test_grad_scale_equals_scaled_gradient(rng, dtype, opt):
    """grad_scale=c inside the fused pass equals an update with c * grad."""
    theta, grads = problem(rng, dtype)
    c = dtype(0.37)
    w1, _ = run(opt, theta, grads, grad_scale=float(c))
    w2, _ = run(opt, theta, [g * c for g in grads])
    np.testing.assert_array_equal(w1, w2)


def test_lr_override_per_step(rng):
    """An explicit lr replaces the constructor's for that update only."""
    theta, grads = problem(rng, np.float64)
    w = theta.copy()
    opt = SGD(lr=123.0)
    opt.update(w, grads[0], {}, step=1, lr=0.5)
    np.testing.assert_allclose(w, theta - 0.5 * grads[0], rtol=1e-15)


def test_large_array_threads_match_reference(rng):
    """An array large enough to use every OpenMP thread gives the same result as the reference."""
    theta = rng.standard_normal(300_001).astype(np.float32)
    grads = [rng.standard_normal(300_001).astype(np.float32) for _ in range(3)]
    w, _ = run(AdamW(lr=1e-3, weight_decay=0.1), theta, grads)
    ref, _, _ = ref_adam(theta, grads, 1e-3, (0.9, 0.999), 1e-8, 0.1, True)
    np.testing.assert_allclose(w, ref, rtol=2e-5, atol=2e-5)


def test_same_inputs_same_bits(rng):
    """Two runs of the same update give bit-identical results."""
    theta, grads = problem(rng, np.float32, shape=(100_000,))
    w1, s1 = run(AdamW(lr=1e-3), theta, grads)
    w2, s2 = run(AdamW(lr=1e-3), theta, grads)
    assert w1.tobytes() == w2.tobytes() and s1["exp_avg_sq"].tobytes() == s2["exp_avg_sq"].tobytes()


@pytest.mark.parametrize("name", ["SGD", "SGD-momentum-dampening", "SGD-nesterov", "Adam-L2", "AdamW"])
def test_matches_torch_optim(rng, name):
    """Each optimizer, in float32, against torch.optim with the same hyperparameters, for 20 steps."""
    torch = pytest.importorskip("torch")
    hp = {"SGD": ("SGD", {"lr": 0.05, "weight_decay": 0.01}),
          "SGD-momentum-dampening": ("SGD", {"lr": 0.05, "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.01}),
          "SGD-nesterov": ("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
          "Adam-L2": ("Adam", {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1}),
          "AdamW": ("AdamW", {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1})}[name]
    theta, grads = problem(rng, np.float32)
    w, _ = run(make_optimizer(hp[0], **hp[1]), theta, grads)
    p = torch.nn.Parameter(torch.from_numpy(theta.copy()))
    theirs = getattr(torch.optim, hp[0])([p], **hp[1])
    for g in grads:
        p.grad = torch.from_numpy(g.copy())
        theirs.step()
    np.testing.assert_allclose(w, p.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["Linear", "CosineAnnealing", "Step", "MultiStep", "Exponential",
                                  "CosineAnnealingWarmRestarts", "Cyclic", "Sequential"])
def test_schedules_match_torch_lr_scheduler(name):
    """Model Zoo's scheduler next to the torch.optim.lr_scheduler it corresponds to, over 40 steps."""
    torch = pytest.importorskip("torch")
    from wse_core.optim import make_schedule

    base = 0.1
    ours, theirs = {
        "Linear": ({"scheduler": "LinearLR", "initial_learning_rate": 0.02, "end_learning_rate": 0.08, "total_iters": 30},
                   lambda o: torch.optim.lr_scheduler.LinearLR(o, 0.2, 0.8, 30)),
        "CosineAnnealing": ({"scheduler": "CosineAnnealingLR", "initial_learning_rate": base, "T_max": 15, "eta_min": 0.01},
                            lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 15, 0.01)),
        "Step": ({"scheduler": "StepLR", "initial_learning_rate": base, "step_size": 7, "gamma": 0.5},
                 lambda o: torch.optim.lr_scheduler.StepLR(o, 7, 0.5)),
        "MultiStep": ({"scheduler": "MultiStepLR", "initial_learning_rate": base, "gamma": 0.3, "milestones": [5, 12, 30]},
                      lambda o: torch.optim.lr_scheduler.MultiStepLR(o, [5, 12, 30], 0.3)),
        "Exponential": ({"scheduler": "ExponentialLR", "initial_learning_rate": base, "total_iters": 1, "decay_rate": 0.9},
                        lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.9)),
        "CosineAnnealingWarmRestarts": (
            {"scheduler": "CosineAnnealingWarmRestarts", "initial_learning_rate": base, "T_0": 9, "eta_min": 0.005},
            lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, 9, 1, 0.005)),
        "Cyclic": ({"scheduler": "CyclicLR", "base_lr": 0.01, "max_lr": base, "step_size_up": 4, "step_size_down": 6,
                    "mode": "triangular2"},
                   lambda o: torch.optim.lr_scheduler.CyclicLR(o, 0.01, base, 4, 6, "triangular2", cycle_momentum=False)),
        "Sequential": ([{"scheduler": "Constant", "learning_rate": 0.05, "total_iters": 5},
                        {"scheduler": "StepLR", "initial_learning_rate": base, "step_size": 4, "gamma": 0.5}],
                       lambda o: torch.optim.lr_scheduler.SequentialLR(o, [
                           torch.optim.lr_scheduler.ConstantLR(o, 0.5, 5), torch.optim.lr_scheduler.StepLR(o, 4, 0.5)], [5])),
    }[name]
    schedule = make_schedule(ours)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    sched = theirs(opt)
    got, want = [], []
    for step in range(40):
        got.append(schedule(step))
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


# --- bad input -------------------------------------------------------------------------------

def test_rejects_shape_mismatch():
    w = np.zeros((3, 4), np.float32)
    with pytest.raises(ValueError, match=r"grad of param: expected shape \(3, 4\) like param, got \(4, 3\)"):
        SGD(lr=0.1).update(w, np.zeros((4, 3), np.float32), {}, step=1)


def test_rejects_dtype_mismatch():
    w = np.zeros(4, np.float32)
    with pytest.raises(TypeError, match="grad of param: expected float32 like param, got float64"):
        SGD(lr=0.1).update(w, np.zeros(4, np.float64), {}, step=1)


def test_rejects_non_float_and_non_array():
    with pytest.raises(TypeError, match="param: expected float32 or float64, got int64"):
        SGD(lr=0.1).update(np.zeros(4, np.int64), np.zeros(4, np.int64), {}, step=1)
    with pytest.raises(TypeError, match="param: expected a numpy array, got list"):
        SGD(lr=0.1).update([0.0], np.zeros(1), {}, step=1)


def test_rejects_non_contiguous():
    w = np.zeros((4, 4), np.float32)
    with pytest.raises(ValueError, match="param: expected a C-contiguous array"):
        SGD(lr=0.1).update(w[:, ::2], np.zeros((4, 2), np.float32), {}, step=1)
    with pytest.raises(ValueError, match="grad of param: expected a C-contiguous array"):
        SGD(lr=0.1).update(w[:2].copy(), w[::2], {}, step=1)


def test_rejects_read_only_param():
    w = np.zeros(4, np.float32)
    w.flags.writeable = False
    with pytest.raises(ValueError, match="param: array is read-only"):
        SGD(lr=0.1).update(w, np.zeros(4, np.float32), {}, step=1)


def test_rejects_wrong_state():
    w, g = np.zeros(4, np.float32), np.zeros(4, np.float32)
    opt = AdamW()
    with pytest.raises(ValueError, match=r"state of param: expected keys \['exp_avg', 'exp_avg_sq'\]"):
        opt.update(w, g, {"exp_avg": np.zeros(4, np.float32)}, step=1)
    with pytest.raises(ValueError, match=r"state\['exp_avg_sq'\] of w: expected shape \(4,\)"):
        opt.update(w, g, {"exp_avg": np.zeros(4, np.float32), "exp_avg_sq": np.zeros(5, np.float32)},
                   step=1, name="w")


@pytest.mark.parametrize("kwargs,match", [
    ({"lr": -0.1}, r"lr: expected a number >= 0, got -0.1"),
    ({"lr": "fast"}, r"lr: expected a number, got 'fast'"),
    ({"lr": float("nan")}, r"lr: expected a number >= 0, got nan"),
    ({"betas": (0.9, 1.0)}, r"betas\[1\]: expected a number in \[0, 1\), got 1.0"),
    ({"betas": 0.9}, r"betas: expected two numbers"),
    ({"eps": -1e-8}, r"eps: expected a number >= 0"),
    ({"weight_decay": -0.1}, r"weight_decay: expected a number >= 0"),
])
def test_rejects_bad_hyperparameters(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        AdamW(**kwargs)


def test_rejects_bad_step_and_lr_override():
    w, g = np.zeros(4), np.zeros(4)
    with pytest.raises(ValueError, match="step: expected an integer >= 1"):
        SGD(lr=0.1).update(w, g, {}, step=0)
    with pytest.raises(ValueError, match="lr: expected a number >= 0, got -1.0"):
        SGD(lr=0.1).update(w, g, {}, step=1, lr=-1.0)


def test_rejects_nesterov_without_momentum():
    with pytest.raises(ValueError, match="nesterov: requires momentum > 0 and dampening = 0"):
        SGD(lr=0.1, nesterov=True)


def test_make_optimizer():
    """Names are case-insensitive; unknown names and hyperparameters are named in the error."""
    opt = make_optimizer("adamw", lr=0.1, weight_decay=0.0)
    assert isinstance(opt, AdamW) and opt.hparams()["lr"] == 0.1
    assert isinstance(make_optimizer("SGD", momentum=0.9), SGD)
    with pytest.raises(ValueError, match="optimizer_type: unknown optimizer 'Lion'"):
        make_optimizer("Lion")
    with pytest.raises(ValueError, match="momentum: not a AdamW hyperparameter"):
        make_optimizer("AdamW", momentum=0.9)


@pytest.mark.parametrize("kind", ["SGD", "Adam", "AdamW"])
def test_decay_false_is_the_update_without_weight_decay(kind):
    """Biases and norm weights (ParamSpec.decay False) take the update of weight_decay 0, bit for bit."""
    rng = np.random.default_rng(3)
    w, g = rng.normal(size=(2, 5)).astype(np.float32), rng.normal(size=(2, 5)).astype(np.float32)
    kw = {"momentum": 0.9} if kind == "SGD" else {}
    with_wd, without = make_optimizer(kind, lr=0.1, weight_decay=0.5, **kw), make_optimizer(kind, lr=0.1, weight_decay=0.0, **kw)
    a, b = w.copy(), w.copy()
    sa, sb = with_wd.init_state(a), without.init_state(b)
    for t in (1, 2, 3):
        with_wd.update(a, g, sa, step=t, decay=False)
        without.update(b, g, sb, step=t)
    assert a.tobytes() == b.tobytes()
    with_wd.update(a, g, sa, step=4)
    without.update(b, g, sb, step=4)
    assert a.tobytes() != b.tobytes()
