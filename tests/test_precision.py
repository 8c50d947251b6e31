"""16-bit formats at the bit level, against references written independently of wse_core.nn.precision."""
import bisect
import math

import numpy as np
import pytest

from wse_core.nn.precision import FORMATS, Precision


def value_of(bits, exp_bits, man_bits):
    """A pattern's value from its fields, in plain Python (IEEE 754 rules, bias 2^(e-1) - 1)."""
    sign = -1.0 if bits >> 15 else 1.0
    e = (bits >> man_bits) & ((1 << exp_bits) - 1)
    m = bits & ((1 << man_bits) - 1)
    bias = (1 << (exp_bits - 1)) - 1
    if e == (1 << exp_bits) - 1:
        return sign * math.inf if m == 0 else math.nan
    if e == 0:
        return sign * math.ldexp(m, 1 - bias - man_bits)
    return sign * math.ldexp((1 << man_bits) + m, e - bias - man_bits)


def hard_inputs(rng, fmt):
    """float32 values around the format's grid: ties, subnormals, the overflow edge, and at random."""
    grid = np.array(sorted({value_of(b, fmt.exp_bits, fmt.man_bits) for b in range(1 << 15)} - {math.inf}))
    grid = grid[np.isfinite(grid)]
    picks = rng.choice(grid[:-1].size, 3000)
    lo, hi = grid[picks], grid[picks + 1]
    mids = (lo + hi) / 2                                  # exact ties (float64) where float32 can hold them
    near = np.concatenate([mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf), lo])
    edge = np.array([fmt.max, fmt.max * (1 + 2.0 ** -(fmt.man_bits + 1)), fmt.max * 1.0001, 2 * fmt.max, 1e-40, 0.0])
    rand = rng.standard_normal(3000) * np.exp2(rng.uniform(-30, 30, 3000))
    with np.errstate(over="ignore"):  # 2 * bfloat16's max is beyond float32's: +inf, an input too
        x = np.concatenate([near, edge, rand]).astype(np.float32)
    return np.concatenate([x, -x])


@pytest.mark.parametrize("name", FORMATS)
def test_every_pattern_decodes_and_encodes_back(name):
    fmt = FORMATS[name]
    bits = np.arange(1 << 16, dtype=np.uint16)
    values = fmt.decode(bits)
    ref = np.array([value_of(int(b), fmt.exp_bits, fmt.man_bits) for b in bits], np.float64)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(values), nan)
    assert np.array_equal(values[~nan].astype(np.float64), ref[~nan])  # every value is a float32 as well
    assert np.array_equal(fmt.encode(values[~nan]), bits[~nan])
    assert np.array_equal(fmt.round(values[~nan]), values[~nan])      # the grid rounds to itself
    assert fmt.max == ref[np.isfinite(ref)].max()


@pytest.mark.parametrize("name", FORMATS)
def test_rounding_is_to_the_nearest_with_ties_to_even(name, rng):
    """Against a search of the whole grid: the nearest value, on a tie the one with an even
    pattern, and beyond max + half a step infinity."""
    fmt = FORMATS[name]
    table = sorted((value_of(b, fmt.exp_bits, fmt.man_bits), b) for b in range(1 << 15))
    table = [(v, b) for v, b in table if math.isfinite(v)]
    values = [v for v, _ in table]
    step_at_max = math.ldexp(1, int(math.floor(math.log2(fmt.max))) - fmt.man_bits)
    x = hard_inputs(rng, fmt)
    got = fmt.round(x)
    for xi, gi in zip(x.tolist(), got.tolist()):
        a = abs(xi)
        if a >= fmt.max + step_at_max / 2:
            want = math.inf  # RNE overflow (the tie at max + step/2 goes to the even side: infinity)
        else:
            i = bisect.bisect_left(values, a)
            cands = [table[j] for j in (i - 1, i) if 0 <= j < len(table)]
            best = min(abs(v - a) for v, _ in cands)
            ties = [(v, b) for v, b in cands if abs(v - a) == best]
            want = ties[0][0] if len(ties) == 1 else next(v for v, b in ties if b % 2 == 0)
        assert gi == math.copysign(want, xi), (name, xi, gi, want)


def test_float16_is_numpys_and_bfloat16_the_classic_bit_formula(rng):
    x = np.concatenate([hard_inputs(rng, FORMATS["float16"]), hard_inputs(rng, FORMATS["bfloat16"])])
    f16 = FORMATS["float16"]
    with np.errstate(over="ignore"):
        half = x.astype(np.float16)
    assert np.array_equal(f16.round(x), half.astype(np.float32))
    assert np.array_equal(f16.encode(f16.round(x)), half.view(np.uint16))
    u = x.view(np.uint32).astype(np.uint64)
    bf = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # round the top half of float32, ties to even
    b16 = FORMATS["bfloat16"]
    assert np.array_equal(b16.encode(b16.round(x)), bf)


def test_precision_sums_round_every_addition():
    p = Precision("bfloat16")
    a, b = np.float32([1.0, 256.0]), np.float32([2.0 ** -8, 1.0])
    assert p.add(a, b).tolist() == [1.0, 256.0]  # 1 + 2^-8 and 257 are between bfloat16 neighbours: ties to even
    wire = [p.to_wire(np.float32([v])) for v in (1.0, 2.0 ** -8, 2.0 ** -8, 2.0 ** -8)]
    assert wire[0].dtype == np.uint16 and p.from_wire(p.wire_sum(wire)).tolist() == [1.0078125]  # (1+e)+(e+e)
    assert Precision().wire_sum([np.float32([1.0]), np.float32([2.0 ** -8])]).tolist() == [1.00390625]


def test_dynamic_loss_scaling_halves_on_overflow_and_doubles_after_good_steps():
    from wse_core.optim.loss_scale import LossScaler

    s = LossScaler(scale=8.0, dynamic=True, max_scale=16.0, min_scale=2.0, steps_per_increase=2)
    seen = []
    for norm in (math.inf, math.nan, 1.0, 1.0, 1.0, 1.0, math.inf, math.inf, math.inf):
        seen.append((s.scale, s.update(norm)))
    assert seen == [(8.0, True), (4.0, True), (2.0, False), (2.0, False), (4.0, False), (4.0, False),
                    (8.0, True), (4.0, True), (2.0, True)]
    assert s.scale == 2.0  # never below min_loss_scale
    t = LossScaler(dynamic=True)
    t.load(s.state())
    assert (t.scale, t.good_steps) == (2.0, 0)
    static = LossScaler(scale=128.0)
    assert not static.update(math.inf) and static.scale == 128.0  # a static scale never skips


def test_mixed_precision_params():
    from pyapi.params import ParamsError, validate

    base = {"train_input": {"data_dir": "d", "batch_size": 4}, "optimizer": {"learning_rate": 1e-3},
            "runconfig": {"max_steps": 1},
            "model": {"name": "gpt2", "vocab_size": 50, "hidden_size": 8, "num_hidden_layers": 1, "num_heads": 2,
                      "max_position_embeddings": 8, "mixed_precision": True}}
    spec = validate(base)
    assert spec.model["fp16_type"] == "float16" and spec.optimizer.loss_scaling_factor == 1.0
    cb = dict(base, model=dict(base["model"], fp16_type="cbfloat16"))
    with pytest.raises(ParamsError, match="cbfloat16 needs dynamic loss scaling"):
        validate(cb)
    assert validate(dict(cb, optimizer={"learning_rate": 1e-3, "loss_scaling_factor": "dynamic"}))
    with pytest.raises(ParamsError, match=r"model.fp16_type: expected one of float16, bfloat16, cbfloat16, got 'fp8'"):
        validate(dict(base, model=dict(base["model"], fp16_type="fp8")))
    with pytest.raises(ParamsError, match="optimizer.loss_scaling_factor: expected a number > 0 or dynamic"):
        validate(dict(base, optimizer={"learning_rate": 1e-3, "loss_scaling_factor": "auto"}))
