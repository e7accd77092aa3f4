"""`PackedLinear` / `linear_rows`: the documented arithmetic, exactly, and agreement with torch.

- Spec (float32 / bfloat16 / float16 weights): every output element is ONE fused multiply-add chain over
  k = 0 .. in-1 starting from zero, then + bias (then + the old value when accumulating). Checked bitwise
  against an exact emulation (rational arithmetic, one round-to-nearest-even to float32 per FMA).
- Spec (int8 / int4, `linear_quant`): each row of x quantized per run of 32 (float32 scale dx = max|x| / 127,
  q = round half away from zero), the integer sum S_j of each run exact, then one FMA chain over the runs,
  acc = fma(S_j, round(d_j · dx_j), acc), + bias (+ old). Checked bitwise against the same emulation fed
  by llama.cpp's reference quantizers written in numpy (tests/quant_reference.py: quantize_row_q8_0_ref for
  activations and int8 weights, quantize_row_q4_0_ref for int4 weights), integer sums in numpy int64.
- Spec (q4_1, llama.cpp's Q4_1, w = q · d + m): S_j = Σ q · qx and Σ qx exact, then per run, in this order,
  acc = fma(S_j, round(d_j · dx_j), acc) and acc = fma(m_j, round(dx_j · Σ qx_j), acc); checked the same way,
  with weights from quantize_row_q4_1_ref (in numpy) and with arbitrary blocks packed by `from_blocks`.
- Against torch `F.linear` and a float64 reference for odd shapes (out not a multiple of 16, in not a
  multiple of anything, bias or not) and every weight storage. Tolerance: the standard forward-error
  bound of an n-term dot product in float32, |err| <= gamma_{n+1} * (|x| @ |W|^T + |b|) with
  gamma_m = m u / (1 - m u), u = 2^-24 — it holds for any summation order, so for torch too (twice
  that bound between the two). A wrong packing, lane mask or bf16/fp16 widening misses it by orders of
  magnitude. Half-size storage is compared with the weights as stored (rounded to nearest even); int8 and
  int4 with the weights and the activations as Q8_0 / Q4_0 hold them (the integer sums are exact, so the
  bound holds); q4_1 likewise, its weights q · d + m in float64 and its magnitude Σ (|q · d| + |m|) |x| (the d and
  m terms are two terms of the chain: 2 · runs + 1 of them).
- int8, int4: the packing round-trips (re-quantizing what Q8_0 / Q4_0 holds gives back the same weights),
  every weight is within the format's error bound of the original, and scales follow runs of 32 inputs; q4_1:
  blocks unpack to what was packed, and quantizing equals the reference.
- `PackedLinear.from_blocks`: the reference quantizers' blocks pack to the very arrays quantizing the float
  weight gives (q8_0, q4_0, q4_1); malformed blocks are refused.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from quant_reference import q4_0_reference, q4_1_reference, q8_0_reference
from specserve.kernels import PackedLinear, linear_rows
from specserve.kernels.quant_packing import pack_q4_1_blocks, unpack_q4_1

STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
U = 2.0 ** -24
STORAGES = ["float32", "bfloat16", "float16", "int8", "int4", "q4_1"]
QUANTIZED = ("int8", "int4", "q4_1")


def round_f32(v: Fraction) -> Fraction:
    """v rounded to the nearest float32 (ties to even); normal range only."""
    if v == 0:
        return Fraction(0)
    a = abs(v)
    e = a.numerator.bit_length() - a.denominator.bit_length()  # 2^e <= a < 2^(e+2)
    if Fraction(2) ** (e + 1) <= a:
        e += 1
    elif Fraction(2) ** e > a:
        e -= 1
    assert e >= -126, "subnormal results are not emulated"
    ulp = Fraction(2) ** (e - 23)
    q = a / ulp
    n, r = divmod(q.numerator, q.denominator)
    r = Fraction(r, q.denominator)
    if r > Fraction(1, 2) or (r == Fraction(1, 2) and n % 2):
        n += 1
    return (n * ulp) if v > 0 else -(n * ulp)


def emulate(x: np.ndarray, w: np.ndarray, b: np.ndarray, init: np.ndarray | None = None) -> np.ndarray:
    """The documented arithmetic: per element, acc = fma(x[k], w[o, k], acc) for k = 0, 1, ... from 0,
    then acc + b[o] (then init + that). float32 in, float32 out, exact emulation."""
    out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    xf = [[Fraction(float(v)) for v in row] for row in x]
    wf = [[Fraction(float(v)) for v in row] for row in w]
    for m in range(x.shape[0]):
        for o in range(w.shape[0]):
            acc = Fraction(0)
            for k in range(x.shape[1]):
                acc = round_f32(xf[m][k] * wf[o][k] + acc)
            acc = round_f32(acc + Fraction(float(b[o])))
            if init is not None:
                acc = round_f32(Fraction(float(init[m, o])) + acc)
            out[m, o] = float(acc)
    return out


def dequantized(q: np.ndarray, d16: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * np.repeat(d16.astype(np.float32), 32, axis=1)[:, :q.shape[1]]


def signed_weights(w: np.ndarray, storage: str) -> tuple[np.ndarray, np.ndarray]:
    """(q int64 [out, in] signed, d float16 [out, runs]) of the int8 or int4 weights, from the reference."""
    if storage == "int8":
        q, d = q8_0_reference(w)
        return q.astype(np.int64), d
    q, d = q4_0_reference(w)
    return q.astype(np.int64) - 8, d


def q4_1_weights(q: np.ndarray, d16: np.ndarray, m16: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q · d + m, |q · d| + |m|) float64 [out, in] of Q4_1 blocks (exact in float64)."""
    runs = lambda s: np.repeat(s.astype(np.float64), 32, axis=1)[:, :q.shape[1]]  # noqa: E731
    qd = q.astype(np.float64) * runs(d16)
    return qd + runs(m16), np.abs(qd) + np.abs(runs(m16))


def stored(w: torch.Tensor, storage: str) -> torch.Tensor:
    """The weights as the packed storage holds them, widened back to float32 (q4_1: float64, exact)."""
    if storage == "q4_1":
        return torch.from_numpy(q4_1_weights(*q4_1_reference(w.numpy()))[0])
    if storage in ("int8", "int4"):
        return torch.from_numpy(dequantized(*signed_weights(w.numpy(), storage)))
    return w.to(STORAGE[storage]).float()


def activations(x: torch.Tensor, storage: str) -> torch.Tensor:
    """The activations the product multiplies: x itself, or for int8 / int4 x as Q8_0 holds it (float32 scales;
    q * dx exact in float64, not in float32)."""
    if storage in QUANTIZED:
        q, dx = q8_0_reference(x.numpy(), np.float32)
        return torch.from_numpy(q.astype(np.float64) * np.repeat(dx.astype(np.float64), 32, axis=1)[:, :q.shape[1]])
    return x


def emulate_quantized(x: np.ndarray, w: np.ndarray, b: np.ndarray, storage: str,
                      init: np.ndarray | None = None) -> np.ndarray:
    """int8's / int4's documented arithmetic: x quantized per run of 32 (`q8_0_reference`, float32 scales), w by
    the format's reference, S_j = the run's integer dot product (int64: exact), then per element
    acc = fma(S_j, round_f32(dw_j * dx_j), acc) over j = 0, 1, ... from 0, then acc + b[o] (then init + that);
    exact emulation."""
    qw, dw = signed_weights(w, storage)
    qx, dx = q8_0_reference(x, np.float32)
    runs = dw.shape[1]
    out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    for m in range(x.shape[0]):
        for o in range(w.shape[0]):
            acc = Fraction(0)
            for j in range(runs):
                s = int(np.dot(qw[o, 32 * j:32 * j + 32].astype(np.int64), qx[m, 32 * j:32 * j + 32].astype(np.int64)))
                scale = round_f32(Fraction(float(dw[o, j])) * Fraction(float(dx[m, j])))
                acc = round_f32(s * scale + acc)
            acc = round_f32(acc + Fraction(float(b[o])))
            if init is not None:
                acc = round_f32(Fraction(float(init[m, o])) + acc)
            out[m, o] = float(acc)
    return out


def emulate_q4_1(x: np.ndarray, q: np.ndarray, d16: np.ndarray, m16: np.ndarray, b: np.ndarray,
                 init: np.ndarray | None = None, m_first: bool = False) -> np.ndarray:
    """q4_1's documented arithmetic for blocks (q uint8 [out, in] in 0..15, d, m float16 [out, runs]): x quantized per
    run of 32 (`q8_0_reference`, float32 scales), S_j = Σ q · qx and T_j = Σ qx over run j (int64: exact), then per
    element acc = fma(S_j, round_f32(d_j * dx_j), acc), acc = fma(m_j, round_f32(dx_j * T_j), acc) over j = 0, 1, ...
    from 0, then acc + b[o] (then init + that); exact emulation. m_first: the two terms of a run swapped (not the
    documented order: to show the inputs tell the orders apart)."""
    qx, dx = q8_0_reference(x, np.float32)
    runs = d16.shape[1]
    out = np.empty((x.shape[0], q.shape[0]), dtype=np.float32)
    for m in range(x.shape[0]):
        for o in range(q.shape[0]):
            acc = Fraction(0)
            for j in range(runs):
                xs = qx[m, 32 * j:32 * j + 32].astype(np.int64)
                s = int(np.dot(q[o, 32 * j:32 * j + 32].astype(np.int64), xs))
                total = int(xs.sum())
                d_term = s * round_f32(Fraction(float(d16[o, j])) * Fraction(float(dx[m, j])))
                m_term = Fraction(float(m16[o, j])) * round_f32(Fraction(float(dx[m, j])) * total)
                for term in ((m_term, d_term) if m_first else (d_term, m_term)):
                    acc = round_f32(term + acc)
            acc = round_f32(acc + Fraction(float(b[o])))
            if init is not None:
                acc = round_f32(Fraction(float(init[m, o])) + acc)
            out[m, o] = float(acc)
    return out


def _data(out_features: int, in_features: int, rows: int, bias: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(rows, in_features, generator=gen)
    return w, b, x


@pytest.mark.parametrize("storage", STORAGES)
def test_every_element_is_one_fma_chain_in_k_order(storage):
    # 21 outputs: one full block and a partial one; 5 rows: the 4-row tile and the 1-row tail.
    w, b, x = _data(21, 37, 5, True, seed=1)
    packed = PackedLinear(w, b, storage)
    xs = x.numpy()
    init = np.random.default_rng(0).standard_normal((5, 21)).astype(np.float32)
    for accumulate in (False, True):
        out = init.copy() if accumulate else np.full((5, 21), np.nan, dtype=np.float32)
        linear_rows(xs, packed.weight, packed.scales, packed.bias, out, accumulate)
        if storage == "q4_1":
            expected = emulate_q4_1(xs, *q4_1_reference(w.numpy()), b.numpy(), init if accumulate else None)
        elif storage in ("int8", "int4"):
            expected = emulate_quantized(xs, w.numpy(), b.numpy(), storage, init if accumulate else None)
        else:
            expected = emulate(xs, stored(w, storage).numpy(), b.numpy(), init if accumulate else None)
        np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32), err_msg=f"accumulate={accumulate}")


# (out, in); 1,060 outputs: wide products' tiles of 4 blocks (and a last one of 3)
SHAPES = [(1, 1), (5, 3), (16, 16), (17, 31), (33, 64), (70, 129), (200, 7), (1060, 45)]


@pytest.mark.parametrize("storage", STORAGES)
def test_packed_linear_matches_torch_within_the_dot_product_error_bound(storage):
    for (out_features, in_features), bias, rows in itertools.product(SHAPES, (False, True), (1, 3, 4, 9)):
        case = dict(out=out_features, inp=in_features, bias=bias, rows=rows)
        w, b, x = _data(out_features, in_features, rows, bias, seed=out_features * 1000 + in_features + rows)
        got = PackedLinear(w, b, storage)(x)
        assert got.shape == (rows, out_features) and got.dtype == torch.float32
        w_s, x_s = stored(w, storage), activations(x, storage)
        exact = x_s.double() @ w_s.double().T + (b.double() if bias else 0.0)
        n = in_features + 1
        w_abs = w_s.double().abs()
        if storage == "q4_1":  # two terms a run (d's, m's), each m's against |m|, not |q d + m|
            n = max(in_features, 2 * -(-in_features // 32) + 1) + 1
            w_abs = torch.from_numpy(q4_1_weights(*q4_1_reference(w.numpy()))[1])
        gamma = n * U / (1 - n * U)
        magnitude = x_s.double().abs() @ w_abs.T + (b.double().abs() if bias else 0.0)
        bound = gamma * magnitude
        excess = float(((got.double() - exact).abs() - bound).max())
        assert excess <= 0, (case, excess)
        reference = F.linear(x_s.float(), w_s.float(), b)
        assert bool(((got.double() - reference.double()).abs() <= 2 * bound).all()), case


def test_output_lanes_past_out_features_are_never_written():
    # out_features = 35: the last block has 3 real lanes and 13 padding lanes that must stay unwritten.
    w, b, x = _data(35, 20, 6, True, seed=3)
    packed = PackedLinear(w, b)
    buf = np.full(6 * 35 + 64, 7.0, dtype=np.float32)
    out = buf[: 6 * 35].reshape(6, 35)
    linear_rows(x.numpy(), packed.weight, packed.scales, packed.bias, out, False)
    assert (buf[6 * 35:] == 7.0).all()
    torch.testing.assert_close(torch.from_numpy(out.copy()), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_bfloat16_storage_rounds_to_nearest_even():
    # Values halfway between two bfloat16 numbers: truncation would differ from round-to-nearest-even.
    w = torch.tensor([[1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, -(1.0 + 2.0 ** -8), 1.0 + 2.0 ** -9]])
    packed = PackedLinear(w, None, "bfloat16")
    eye = torch.eye(4)
    got = packed(eye)[:, 0]
    assert got.tolist() == w.to(torch.bfloat16).float()[0].tolist() == [1.0, 1.0 + 2.0 ** -6, -1.0, 1.0]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="2-D"):
        PackedLinear(torch.zeros(3))
    with pytest.raises(ValueError, match="storage"):
        PackedLinear(torch.zeros(2, 2), storage="int2")


@pytest.mark.parametrize("shape", [(21, 37), (16, 32), (40, 100), (3, 5)])
def test_int8_and_int4_packing_round_trip_and_stay_within_the_format_bound(shape):
    gen = torch.Generator().manual_seed(shape[0] * 100 + shape[1])
    w = torch.randn(*shape, generator=gen) * torch.logspace(-3, 1, shape[1])  # runs of very different scales
    w[0, :min(32, shape[1])] = 0.0  # an all-zero run: d = 0, q = 0
    packed = PackedLinear(w, None, "int8")
    q_ref, d_ref = q8_0_reference(w.numpy())
    held = packed.dequantized().numpy()
    np.testing.assert_array_equal(held, dequantized(q_ref, d_ref))
    assert (held[0, :min(32, shape[1])] == 0).all()
    # Every weight within half a step of its run, plus what rounding d to float16 moves 127 steps by.
    d = np.repeat(d_ref.astype(np.float64), 32, axis=1)[:, :shape[1]]
    assert (np.abs(held - w.numpy()) <= d / 2 + 127 * d * 2.0 ** -11 + 1e-12).all()
    again = PackedLinear(torch.from_numpy(held), None, "int8")  # quantizing what Q8_0 holds changes nothing
    np.testing.assert_array_equal(again.dequantized().numpy(), held)
    int4 = PackedLinear(w, None, "int4")  # and Q4_0: the reference's weights, within a step (+ float16's d):
    held4 = int4.dequantized().numpy()  # half a step but where a value clamps from 8 to 7 steps
    np.testing.assert_array_equal(held4, dequantized(*signed_weights(w.numpy(), "int4")))
    d4 = np.abs(np.repeat(q4_0_reference(w.numpy())[1].astype(np.float64), 32, axis=1)[:, :shape[1]])
    assert (np.abs(held4 - w.numpy()) <= d4 + 8 * d4 * 2.0 ** -11 + 1e-12).all()
    np.testing.assert_array_equal(PackedLinear(torch.from_numpy(held4), None, "int4").dequantized().numpy(), held4)
    # Inputs padded to whole runs of 32, outputs to whole tiles of 2 blocks of 16 (these products are narrow).
    runs, blocks = -(-shape[1] // 32), -(-shape[0] // 32) * 2
    assert packed.nbytes == packed.weight.nbytes + packed.scales.nbytes == blocks * 16 * runs * (32 + 2)
    assert int4.nbytes == blocks * 16 * runs * (16 + 2)
    if shape[1] % 32 == 0:
        assert int4.nbytes < packed.nbytes < PackedLinear(w, None, "float16").nbytes


def _q4_1_blocks(out_features: int, in_features: int, seed: int):
    """Arbitrary Q4_1 blocks, as a file may hold them: q uniform in 0..15, d and m float16 of either sign, some 0."""
    rng = np.random.default_rng(seed)
    runs = -(-in_features // 32)
    q = rng.integers(0, 16, (out_features, in_features)).astype(np.uint8)
    d = (rng.standard_normal((out_features, runs)) * 0.1).astype(np.float16)
    m = (rng.standard_normal((out_features, runs)) * 0.5).astype(np.float16)
    d[0, 0], m[-1, -1] = 0, 0
    return q, d, m


@pytest.mark.parametrize("out_features, in_features, rows", [(70, 77, 5), (1060, 64, 2)])
def test_q4_1_blocks_are_one_fma_chain_of_the_d_then_the_m_term_per_run(out_features, in_features, rows):
    # 70 outputs: tiles of 2 blocks, the last one single and partial; 5 rows: the 4-row tile and the 1-row tail;
    # 77 inputs: a short last run. 1,060 outputs, 2 rows: 4-block tiles, one row at a time.
    q, d, m = _q4_1_blocks(out_features, in_features, seed=out_features)
    rng = np.random.default_rng(in_features)
    b = rng.standard_normal(out_features).astype(np.float32)
    x = rng.standard_normal((rows, in_features)).astype(np.float32)
    init = rng.standard_normal((rows, out_features)).astype(np.float32)
    packed = PackedLinear.from_blocks("q4_1", torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m),
                                      torch.from_numpy(b))
    assert packed.storage == "q4_1" and packed.scales.dtype == np.uint32
    for accumulate in (False, True):
        out = init.copy() if accumulate else np.full((rows, out_features), np.nan, dtype=np.float32)
        linear_rows(x, packed.weight, packed.scales, packed.bias, out, accumulate)
        expected = emulate_q4_1(x, q, d, m, b, init if accumulate else None)
        np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32), err_msg=f"accumulate={accumulate}")
    if out_features < 100:  # the inputs tell the documented order from the other one
        assert (emulate_q4_1(x, q, d, m, b, m_first=True) != emulate_q4_1(x, q, d, m, b)).any()


@pytest.mark.parametrize("shape", [(21, 37), (16, 32), (40, 100), (3, 5)])
def test_q4_1_quantizes_as_the_reference_round_trips_and_stays_within_the_format_bound(shape):
    gen = torch.Generator().manual_seed(shape[0] * 100 + shape[1])
    w = torch.randn(*shape, generator=gen) * torch.logspace(-3, 1, shape[1])  # runs of very different scales
    w[0, :min(32, shape[1])] = 0.0  # an all-zero run: d = m = 0, q = 0
    packed = PackedLinear(w, None, "q4_1")
    q_ref, d_ref, m_ref = q4_1_reference(w.numpy())
    q, d, m = unpack_q4_1(packed.weight, packed.scales, packed.tile_blocks, *shape)
    np.testing.assert_array_equal(q.numpy(), q_ref)
    np.testing.assert_array_equal(d.numpy().view(np.uint16), d_ref.view(np.uint16))
    np.testing.assert_array_equal(m.numpy().view(np.uint16), m_ref.view(np.uint16))
    exact, _ = q4_1_weights(q_ref, d_ref, m_ref)
    held = packed.dequantized().numpy()
    np.testing.assert_array_equal(held, exact.astype(np.float32))
    assert (held[0, :min(32, shape[1])] == 0).all()
    # Within half a step of the run's grid, plus what rounding d (15 steps) and m to float16 moves.
    runs = lambda s: np.abs(np.repeat(s.astype(np.float64), 32, axis=1)[:, :shape[1]])  # noqa: E731
    bound = runs(d_ref) * (0.5 + 16 * 2.0 ** -10) + runs(m_ref) * 2.0 ** -10 + 2.0 ** -23
    assert (np.abs(exact - w.numpy()) <= bound).all()
    n_runs, blocks = -(-shape[1] // 32), -(-shape[0] // 32) * 2
    assert packed.nbytes == blocks * 16 * n_runs * (16 + 4)  # 4-bit q, float16 d and m
    assert PackedLinear(w, None, "int4").nbytes < packed.nbytes < PackedLinear(w, None, "int8").nbytes


@pytest.mark.parametrize("tile_blocks", [2, 4])
@pytest.mark.parametrize("shape", [(21, 37), (70, 96), (1, 5)])
def test_q4_1_blocks_pack_and_unpack_to_themselves(shape, tile_blocks):
    q, d, m = _q4_1_blocks(*shape, seed=shape[0] + tile_blocks)
    runs = d.shape[1]
    for width in (shape[1], runs * 32):  # q of the inputs, or of whole runs (the padding: anything in 0..15)
        qq = np.random.default_rng(1).integers(0, 16, (shape[0], width)).astype(np.uint8)
        qq[:, :shape[1]] = q
        weight, scales = pack_q4_1_blocks(torch.from_numpy(qq), torch.from_numpy(d), torch.from_numpy(m), tile_blocks)
        blocks = -(-shape[0] // (16 * tile_blocks)) * tile_blocks
        assert weight.dtype == np.int8 and weight.shape == (blocks // tile_blocks, runs * 16 * tile_blocks * 16)
        assert scales.dtype == np.uint32 and scales.shape == (blocks, runs * 16)
        q2, d2, m2 = unpack_q4_1(weight, scales, tile_blocks, *shape)
        np.testing.assert_array_equal(q2.numpy(), q)
        np.testing.assert_array_equal(d2.numpy().view(np.uint16), d.view(np.uint16))
        np.testing.assert_array_equal(m2.numpy().view(np.uint16), m.view(np.uint16))


@pytest.mark.parametrize("shape", [(21, 37), (40, 100), (1060, 45)])
def test_from_blocks_packs_the_reference_blocks_as_quantizing_does(shape):
    gen = torch.Generator().manual_seed(shape[0] + shape[1])
    w, b = torch.randn(*shape, generator=gen), torch.randn(shape[0], generator=gen)
    t = torch.from_numpy
    for fmt, storage, blocks in (("q8_0", "int8", q8_0_reference(w.numpy())), ("q4_0", "int4", q4_0_reference(w.numpy())),
                                 ("q4_1", "q4_1", q4_1_reference(w.numpy()))):
        q, d, *m = (t(a) for a in blocks)
        got, want = PackedLinear.from_blocks(fmt, q, d, *m, bias=b), PackedLinear(w, b, storage)
        assert (got.storage, got.tile_blocks, got.out_features, got.in_features) == \
            (storage, want.tile_blocks, *shape), fmt
        for name in ("weight", "scales", "bias"):
            a, e = getattr(got, name), getattr(want, name)
            assert a.dtype == e.dtype and a.shape == e.shape, (fmt, name)
            np.testing.assert_array_equal(a.view(np.uint8), e.view(np.uint8), err_msg=f"{fmt} {name}")


def test_from_blocks_refuses_malformed_blocks():
    q4, d = torch.zeros(16, 64, dtype=torch.uint8), torch.zeros(16, 2, dtype=torch.float16)
    with pytest.raises(ValueError, match="block format"):
        PackedLinear.from_blocks("q5_0", q4, d)
    with pytest.raises(ValueError, match="minimum m"):
        PackedLinear.from_blocks("q4_1", q4, d)
    with pytest.raises(ValueError, match="minimum m"):
        PackedLinear.from_blocks("q4_0", q4, d, d)
    with pytest.raises(ValueError, match="0..15"):
        PackedLinear.from_blocks("q4_0", torch.full((16, 64), 16, dtype=torch.uint8), d)
    with pytest.raises(ValueError, match="uint8"):
        PackedLinear.from_blocks("q4_1", q4.to(torch.int8), d, d)
    with pytest.raises(ValueError, match="int8"):
        PackedLinear.from_blocks("q8_0", q4, d)
    with pytest.raises(ValueError, match="float16"):
        PackedLinear.from_blocks("q8_0", q4.to(torch.int8), d[:, :1])
    with pytest.raises(ValueError, match="float16"):
        PackedLinear.from_blocks("q4_1", q4, d, d.float())


_STORAGES = ("int8", "int4", "q4_1")
_QUANTIZED_PRODUCTS = """
import sys, numpy as np, torch
from specserve.kernels import PackedLinear, linear_rows


def products(storages):
    # 40 outputs (tiles of 2 blocks: the 2- and 1-block paths) and 1,060 (tiles of 4: the 4-block one, a short last
    # tile); 100 inputs (a short last run); 1-16 rows: every row tile and leftover count, on every path.
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(16, 100, generator=gen).numpy()
    weights = {out_features: torch.randn(out_features, 100, generator=gen) for out_features in (40, 1060)}
    outs = {}
    for out_features, w in weights.items():
        for storage in storages:
            packed = PackedLinear(w, None, storage)
            for rows in (1, 2, 3, 4, 5, 7, 8, 13, 16):
                out = np.zeros((rows, out_features), dtype=np.float32)
                linear_rows(x[:rows], packed.weight, packed.scales, packed.bias, out, False)
                outs[f"{storage}-{out_features}x{rows}"] = out
    return outs


if __name__ == "__main__":  # a child: this CPU less VNNI (or less AVX2 too), one storage
    from specserve.kernels import simd
    assert not simd.HAS_VNNI
    np.savez(sys.argv[1], **products([sys.argv[2]]))
"""


def _child_cache(tmp_path, name: str):
    """A numba cache directory for a child compiling for another CPU: where numba caches this process's kernels
    (the kernels' __pycache__, or $NUMBA_CACHE_DIR) when writable, else the test's own tmp_path."""
    import os
    from pathlib import Path

    from specserve.kernels import simd

    root = Path(os.environ.get("NUMBA_CACHE_DIR") or Path(simd.__file__).parent / "__pycache__")
    try:
        (root / name).mkdir(parents=True, exist_ok=True)
        return root / name if os.access(root / name, os.W_OK) else tmp_path / name
    except OSError:
        return tmp_path / name


@pytest.mark.parametrize("without", ["avx512vnni", "avx2"])
def test_int8_int4_and_q4_1_on_every_dot_product_path_compute_the_same_bits(tmp_path, without):
    # `vdot4` is one VNNI instruction, or on AVX2 vpmaddubsw pair sums (4-bit weights) and signed vpmaddubsw /
    # vpmaddwd pairs (8-bit), with their own row tiles, or generic vector code; integer sums are exact, so every
    # path must give the same bits. The slower path runs in a child compiled for this CPU less the feature (less
    # VNNI: AVX2's; less AVX2 and VNNI: the generic).
    import os
    import subprocess
    import sys

    import llvmlite.binding as llvm

    from specserve.kernels import simd

    has = {"avx512vnni": simd.HAS_VNNI, "avx2": simd.HAS_AVX2}
    if not has[without]:
        pytest.skip(f"this CPU has no {without}: only the slower path runs here")
    features = llvm.get_host_cpu_features().flatten()
    for feature in (["avx512vnni"] if without == "avx512vnni" else ["avx512vnni", "avx2"]):
        features = features.replace(f"+{feature}", f"-{feature}")
    # One child per storage, at once: each compiles `linear_rows` for its weight type (~60 s each for the generic
    # path on a 2-core host; one child compiling all three took 4 minutes of the suite). Each keeps its kernels
    # beside this process's own, in a cache of its own (two processes writing one function's cache index can
    # lose entries): later runs load them, and numba's cache is per version of the sources and CPU features.
    children = {}
    for storage in _STORAGES:
        env = dict(os.environ, NUMBA_CPU_NAME="host", NUMBA_CPU_FEATURES=features,
                   NUMBA_CACHE_DIR=str(_child_cache(tmp_path, f"cpu-without-{without}-{storage}")))
        children[storage] = subprocess.Popen([sys.executable, "-c", _QUANTIZED_PRODUCTS, str(tmp_path / f"{storage}.npz"),
                                              storage], env=env, stderr=subprocess.PIPE, text=True)
    for storage, child in children.items():
        _, err = child.communicate(timeout=900)
        assert child.returncode == 0, f"{storage}: {err[-2000:]}"
    here: dict = {"__name__": "here"}
    exec(_QUANTIZED_PRODUCTS, here)  # the same products on this CPU's fastest path, in this process
    fastest = here["products"](_STORAGES)
    for storage in _STORAGES:
        slower = np.load(tmp_path / f"{storage}.npz")
        assert set(slower.files) == {name for name in fastest if name.startswith(f"{storage}-")}  # every shape and row count
        for name in slower.files:
            np.testing.assert_array_equal(slower[name].view(np.uint32), fastest[name].view(np.uint32), err_msg=name)
