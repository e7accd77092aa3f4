"""A 16-lane float32 vector type for numba kernels, with the few operations our kernels need.

Why not let LLVM vectorise plain loops: with `fastmath`, LLVM chooses the order in which a reduction
is summed, and it may choose differently for two loops that look alike (a 1-row and a 4-row product),
so the same row can round differently depending on how many rows share a call. Kernels written with
this type spell the order out — which lanes exist, which partial sums are added in which order — so
a result depends only on its own inputs: batch invariance by construction, not by luck.

`F32x16` values live in registers (LLVM ``<16 x float>``). Loads widen half-size weights on the fly:
bfloat16 is the top half of a float32 (widening is a shift), float16 converts with F16C; arithmetic
is always float32. Half-size weights travel as 16-bit integer arrays (int16: bfloat16, uint16: float16).
`I32x16` (16 int32 lanes) carries 8-bit dot products (`vdot4`) for int8 and int4 weights. Unaligned loads are used throughout (numpy gives 16-byte alignment at best).
"""

from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

LANES = 16
# Products at least this many 16-wide blocks (1024 outputs) use 4-block tiles: 16+ tiles, even for 4 threads.
WIDE_PRODUCT_BLOCKS = 64


def tile_blocks(num_blocks: int) -> int:
    """Blocks of 16 outputs per tile (the unit of work one thread computes, stored as one stream): 4 keep
    4 FMA chains busy for a single row; narrow products use 2 so threads get even shares. A fixed cut, not
    the thread count: a packed weight must not depend on how many threads run it."""
    return 4 if num_blocks >= WIDE_PRODUCT_BLOCKS else 2


def tiled_rows(out_features: int, tile_blocks: int) -> tuple[int, int]:
    """(rows, tiles): outputs padded to whole tiles of `tile_blocks` blocks of 16."""
    tiles = -(-out_features // (LANES * tile_blocks))
    return tiles * LANES * tile_blocks, tiles


_VEC = ir.VectorType(ir.FloatType(), LANES)
_I32 = ir.IntType(32)


class F32x16Type(types.Type):
    def __init__(self) -> None:
        super().__init__(name="F32x16")


F32x16 = F32x16Type()


@register_model(F32x16Type)
class _F32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VEC)


def _item_pointer(context, builder, arrty, arr, index):
    array = context.make_array(arrty)(context, builder, arr)
    return cgutils.get_item_pointer(context, builder, arrty, array, [index], wraparound=False)


@intrinsic
def vzero(typingctx):
    """A vector of zeros."""

    def codegen(context, builder, signature, args):
        return ir.Constant(_VEC, [0.0] * LANES)

    return F32x16(), codegen


@intrinsic
def vbroadcast(typingctx, value):
    """value (float32) in every lane."""

    def codegen(context, builder, signature, args):
        x = context.cast(builder, args[0], signature.args[0], types.float32)
        v = builder.insert_element(ir.Constant(_VEC, ir.Undefined), x, ir.Constant(_I32, 0))
        return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES))

    return F32x16(value), codegen


@intrinsic
def vload(typingctx, array, index):
    """array[index : index + 16] as float32 lanes. array is 1-D contiguous: float32, or half-size weights
    kept as 16-bit integers — int16 holds bfloat16 bits (widened by a shift), uint16 holds float16 bits
    (converted with F16C). numba has no float16 arithmetic, so the dtype itself says how to widen."""
    if not isinstance(array, types.Array) or array.ndim != 1 or array.dtype not in (
            types.float32, types.int16, types.uint16):
        return None

    def codegen(context, builder, signature, args):
        arrty = signature.args[0]
        ptr = _item_pointer(context, builder, arrty, args[0], args[1])
        if arrty.dtype == types.float32:
            return builder.load(builder.bitcast(ptr, _VEC.as_pointer()), align=4)
        bits = ir.VectorType(ir.IntType(16), LANES)
        raw = builder.load(builder.bitcast(ptr, bits.as_pointer()), align=2)
        if arrty.dtype == types.uint16:  # float16
            return builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), LANES)), _VEC)
        wide = builder.zext(raw, ir.VectorType(_I32, LANES))  # bfloat16: the top half of a float32
        shifted = builder.shl(wide, ir.Constant(ir.VectorType(_I32, LANES), [16] * LANES))
        return builder.bitcast(shifted, _VEC)

    return F32x16(array, index), codegen


@intrinsic
def store_float(typingctx, array, index, value):
    """array[index] = value, a float32 scalar, into a 1-D contiguous float32 array — or a uint16 one holding float16
    bits (a half-size KV cache), rounded to the nearest float16 (F16C's conversion): what `vload` widens back."""
    if not isinstance(array, types.Array) or array.ndim != 1 or array.dtype not in (types.float32, types.uint16):
        return None

    def codegen(context, builder, signature, args):
        ptr = _item_pointer(context, builder, signature.args[0], args[0], args[1])
        x = context.cast(builder, args[2], signature.args[2], types.float32)
        if signature.args[0].dtype == types.uint16:
            x = builder.bitcast(builder.fptrunc(x, ir.HalfType()), ir.IntType(16))
        builder.store(x, ptr)
        return context.get_dummy_value()

    return types.void(array, index, value), codegen


@intrinsic
def vstore(typingctx, array, index, value):
    """array[index : index + 16] = value (array: 1-D contiguous float32)."""
    if not isinstance(array, types.Array) or array.ndim != 1 or array.dtype != types.float32:
        return None

    def codegen(context, builder, signature, args):
        ptr = _item_pointer(context, builder, signature.args[0], args[0], args[1])
        builder.store(args[2], builder.bitcast(ptr, _VEC.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(array, index, value), codegen


@intrinsic
def vfma(typingctx, a, b, c):
    """a * b + c, fused (one rounding), lane by lane."""

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC] * 3), "llvm.fma.v16f32")
        return builder.call(fn, args)

    return F32x16(a, b, c), codegen


def _binary(op):
    @intrinsic
    def binary(typingctx, a, b):
        def codegen(context, builder, signature, args):
            return getattr(builder, op)(args[0], args[1])

        return F32x16(a, b), codegen

    return binary


vadd = _binary("fadd")
vsub = _binary("fsub")
vmul = _binary("fmul")


@intrinsic
def vmax(typingctx, a, b):
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC] * 2), "llvm.maxnum.v16f32")
        return builder.call(fn, args)

    return F32x16(a, b), codegen


@intrinsic
def vsum(typingctx, a):
    """The sum of the lanes in one fixed order: halves added pairwise (lanes 0-7 + 8-15, then 4, 2, 1)."""

    def codegen(context, builder, signature, args):
        v, n = args[0], LANES
        while n > 1:
            half = n // 2
            lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half), list(range(half))))
            hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half), list(range(half, n))))
            v, n = builder.fadd(lo, hi), half
        return builder.extract_element(v, ir.Constant(_I32, 0))

    return types.float32(a), codegen


@intrinsic
def vmax_lanes(typingctx, a):
    """The largest lane of a vector as a float32 (a maximum has no order to vary: the same as any scalar loop's)."""

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.FloatType(), [_VEC]),
                                            "llvm.vector.reduce.fmax.v16f32")
        return builder.call(fn, args)

    return types.float32(a), codegen


@intrinsic
def vlane(typingctx, a, lane):
    """One lane of a vector as a float32."""

    def codegen(context, builder, signature, args):
        index = context.cast(builder, args[1], signature.args[1], types.int32)
        return builder.extract_element(args[0], index)

    return types.float32(a, lane), codegen


vdiv = _binary("fdiv")


def _vconst(value: float):
    return ir.Constant(_VEC, [value] * LANES)


def _call(builder, name: str, args, arity: int):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC] * arity), name)
    return builder.call(fn, args)


@intrinsic
def vexp(typingctx, a):
    """exp of each lane (Cephes' expf: range reduction by ln 2, a degree-5 polynomial, then 2^n through the
    exponent bits) — about 1 ulp, in registers, 16 lanes at once; exactly 0 below exp's float32 range
    (so -inf lanes, e.g. padding, contribute nothing)."""

    def codegen(context, builder, signature, args):
        x0 = args[0]
        x = _call(builder, "llvm.maxnum.v16f32", [x0, _vconst(-87.33654)], 2)
        x = _call(builder, "llvm.minnum.v16f32", [x, _vconst(88.72283)], 2)
        fma = lambda a, b, c: _call(builder, "llvm.fma.v16f32", [a, b, c], 3)  # noqa: E731
        fx = _call(builder, "llvm.floor.v16f32", [fma(x, _vconst(1.44269504088896341), _vconst(0.5))], 1)
        x = fma(fx, _vconst(-0.693359375), x)
        x = fma(fx, _vconst(2.12194440e-4), x)
        z = builder.fmul(x, x)
        y = _vconst(1.9875691500e-4)
        for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
            y = fma(y, x, _vconst(c))
        y = builder.fadd(fma(y, z, x), _vconst(1.0))
        ivec = ir.VectorType(_I32, LANES)
        n = builder.fptosi(fx, ivec)
        bits = builder.shl(builder.add(n, ir.Constant(ivec, [127] * LANES)), ir.Constant(ivec, [23] * LANES))
        y = builder.fmul(y, builder.bitcast(bits, _VEC))
        below = builder.fcmp_ordered("<", x0, _vconst(-87.33654))
        return builder.select(below, _vconst(0.0), y)

    return F32x16(a), codegen


# ---- 16 int32 lanes: 8-bit dot products (the int8 and int4 weights' products) ----------------------------
#
# An int8 (or int4) product multiplies 8-bit (4-bit) weights by 8-bit activations and sums in int32 — exact, so no order
# question arises inside a run of inputs. `vdot4` is the one operation: per int32 lane, four unsigned bytes
# of `a` times four signed bytes of `b`, summed into the lane. CPUs with AVX-512 VNNI do it in one
# instruction (vpdpbusd); elsewhere the same exact sum is spelled out in generic vector code.

_IVEC = ir.VectorType(_I32, LANES)
_BYTES = ir.VectorType(ir.IntType(8), 4 * LANES)


def _host_has_vnni() -> bool:
    """Whether numba's target CPU has AVX-512 VNNI (numba compiles for the host unless told otherwise)."""
    import llvmlite.binding as llvm
    from numba.core import config

    if config.CPU_FEATURES is not None:
        return "+avx512vnni" in config.CPU_FEATURES.split(",")
    if config.CPU_NAME not in (None, "host"):
        return False  # a named, portable target (e.g. "generic" for a shared cache): don't assume it
    return bool(llvm.get_host_cpu_features().get("avx512vnni", False))


HAS_VNNI = _host_has_vnni()


class I32x16Type(types.Type):
    def __init__(self) -> None:
        super().__init__(name="I32x16")


I32x16 = I32x16Type()


@register_model(I32x16Type)
class _I32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _IVEC)


@intrinsic
def vizero(typingctx):
    """16 int32 zeros."""

    def codegen(context, builder, signature, args):
        return ir.Constant(_IVEC, [0] * LANES)

    return I32x16(), codegen


@intrinsic
def vload_bytes(typingctx, array, index):
    """array[index : index + 64] (1-D contiguous uint8 or int8) as 16 int32 lanes of 4 bytes each."""
    if not isinstance(array, types.Array) or array.ndim != 1 or array.dtype not in (types.uint8, types.int8):
        return None

    def codegen(context, builder, signature, args):
        ptr = _item_pointer(context, builder, signature.args[0], args[0], args[1])
        return builder.load(builder.bitcast(ptr, _IVEC.as_pointer()), align=1)

    return I32x16(array, index), codegen


@intrinsic
def vbroadcast_bytes(typingctx, array, index):
    """array[index : index + 4] (1-D contiguous int8 or uint8) as one int32, in every lane."""
    if not isinstance(array, types.Array) or array.ndim != 1 or array.dtype not in (types.uint8, types.int8):
        return None

    def codegen(context, builder, signature, args):
        ptr = _item_pointer(context, builder, signature.args[0], args[0], args[1])
        word = builder.load(builder.bitcast(ptr, _I32.as_pointer()), align=1)
        v = builder.insert_element(ir.Constant(_IVEC, ir.Undefined), word, ir.Constant(_I32, 0))
        return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES))

    return I32x16(array, index), codegen


def _host_has(feature: str) -> bool:
    """Whether numba's target CPU has `feature` (an LLVM feature name such as "avx2")."""
    import llvmlite.binding as llvm
    from numba.core import config

    if config.CPU_FEATURES is not None:
        return f"+{feature}" in config.CPU_FEATURES.split(",")
    if config.CPU_NAME not in (None, "host"):
        return False
    return bool(llvm.get_host_cpu_features().get(feature, False))


HAS_AVX2 = _host_has("avx2")
# 16 vector registers (AVX2; no AVX-512): a 16-lane float32 vector takes two of them, so a float tile of 4 rows x 2
# blocks (8 accumulators, 16 registers) spills; `linear.linear_rows_float` then takes 4 rows x 1 block.
FEW_REGISTERS = not _host_has("avx512f")
_HALF_BYTES = ir.VectorType(ir.IntType(8), 2 * LANES)  # one 256-bit register of bytes
_HALF_WORDS = ir.VectorType(ir.IntType(16), LANES)
_HALF_INTS = ir.VectorType(_I32, LANES // 2)


def _dot4_generic(builder, acc_v, a_v, b_v):
    """acc + Σ of 4 products per lane, widened to int32 (any target; slow)."""
    wide = ir.VectorType(_I32, 4 * LANES)
    products = builder.mul(builder.zext(builder.bitcast(a_v, _BYTES), wide),
                           builder.sext(builder.bitcast(b_v, _BYTES), wide))
    total = acc_v
    for j in range(4):  # byte j of every lane
        part = builder.shuffle_vector(products, products,
                                      ir.Constant(ir.VectorType(_I32, LANES), [4 * l + j for l in range(LANES)]))
        total = builder.add(total, part)
    return total


@intrinsic
def vdot4(typingctx, acc, a, b):
    """acc + (per lane) sum of 4 products of a's unsigned bytes by b's signed bytes (b in [-127, 127], as quantized
    activations are), in int32 (exact: |255 · 127 · 4| fits many times over): one vpdpbusd with AVX-512 VNNI, else
    generic vector code. AVX2 hosts spell the kernels' sums their own way (`PAIR_SUMS`, below)."""

    def codegen(context, builder, signature, args):
        acc_v, a_v, b_v = args
        if HAS_VNNI:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_IVEC, [_IVEC] * 3),
                                                "llvm.x86.avx512.vpdpbusd.512")
            return builder.call(fn, [acc_v, a_v, b_v])
        return _dot4_generic(builder, acc_v, a_v, b_v)

    return I32x16(acc, a, b), codegen


# ---- AVX2 without VNNI: cheaper spellings of the same exact integer sums -----------------------------------
#
# AVX2 has no 4-byte dot product: vpmaddubsw multiplies byte pairs and sums each pair in int16, vpmaddwd sums
# int16 pairs in int32. Two exact shortcuts, used by the quantized kernels when the host
# has AVX2 but not VNNI (`PAIR_SUMS`):
# - 4-bit weights (nibbles, <= 15) times activations in [-127, 127]: a pair sums to at most 2 * 15 * 127 = 3810, so
#   eight vpmaddubsw results add in int16 without overflow (8 * 3810 = 30480 < 2^15) — a run of 32 inputs is
#   exactly eight calls — and one vpmaddwd per run widens them (`vpairs_zero`, `vdot2_pairs`, `vpairs_widen`).
# - 8-bit weights: signed q times x as |q| (unsigned, <= 128) times x · sign(q) (vpsignb), a pair at most
#   2 * 128 * 127 = 32512 < 2^15: one vpmaddubsw / vpmaddwd pair per half instead of two (`vdot4_signed`), and no
#   offset to subtract.

PAIR_SUMS = HAS_AVX2 and not HAS_VNNI
_PAIRS = ir.VectorType(ir.IntType(16), 2 * LANES)  # 32 int16 lanes: two 256-bit registers


class I16x32Type(types.Type):
    def __init__(self) -> None:
        super().__init__(name="I16x32")


I16x32 = I16x32Type()


@register_model(I16x32Type)
class _I16x32Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _PAIRS)


def _halves(builder, v, width: int):
    """The two 256-bit halves of a 512-bit vector of `width` lanes."""
    return [builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, width // 2),
                                                     [width // 2 * h + i for i in range(width // 2)]))
            for h in range(2)]


def _join(builder, lo, hi, width: int):
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, width), list(range(width))))


def _x86(builder, name: str, ret, *args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, list(args))


def _maddubs(builder, a_bytes, b_bytes):
    """vpmaddubsw of each 256-bit half of two 64-byte vectors (a's bytes unsigned, b's signed): per half 16 int16 pair
    sums, saturating (callers keep them in range)."""
    return [_x86(builder, "llvm.x86.avx2.pmadd.ub.sw", _HALF_WORDS, x, y)
            for x, y in zip(_halves(builder, a_bytes, 4 * LANES), _halves(builder, b_bytes, 4 * LANES))]


def _widen(builder, halves):
    """Two halves of int16 pair sums as 16 int32 lanes: vpmaddwd by ones sums lanes 2 l and 2 l + 1 (exact)."""
    ones = ir.Constant(_HALF_WORDS, [1] * LANES)
    parts = [_x86(builder, "llvm.x86.avx2.pmadd.wd", _HALF_INTS, h, ones) for h in halves]
    return _join(builder, parts[0], parts[1], LANES)


@intrinsic
def prefetch(typingctx, array, index):
    """Ask for array[index]'s cache line ahead of use (1-D contiguous array; never faults). A few-row product computes
    long enough per tile that the hardware prefetchers stop running ahead of it: the kernel fetches the next tile's
    lines itself, one per step, so the stream overlaps the arithmetic."""
    if not isinstance(array, types.Array) or array.ndim != 1:
        return None

    def codegen(context, builder, signature, args):
        ptr = _item_pointer(context, builder, signature.args[0], args[0], args[1])
        i8p = ir.IntType(8).as_pointer()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return types.none(array, index), codegen


#: Products of up to this many rows (a verify, a decode batch) `prefetch` the next tile, float and quantized alike.
#: More rows (a prompt's chunk) compute long enough per tile for the hardware prefetchers: 400 rows ran 7 % slower
#: prefetching.
PREFETCH_ROWS = 32


@intrinsic
def vpairs_zero(typingctx):
    """32 int16 zeros: a run's pair sums before its first `vdot2_pairs`."""

    def codegen(context, builder, signature, args):
        return ir.Constant(_PAIRS, [0] * 2 * LANES)

    return I16x32(), codegen


@intrinsic
def vdot2_pairs(typingctx, acc, a, b):
    """acc + vpmaddubsw(a, b): int16 lane 2 l + i of the result adds bytes 4 l + 2 i and 4 l + 2 i + 1 of a (unsigned,
    < 16) times those of b (signed, in [-127, 127]); `vpairs_widen` sums lanes 2 l and 2 l + 1 into int32 lane l.
    At most eight calls per accumulator (see above)."""
    if not PAIR_SUMS:
        return None

    def codegen(context, builder, signature, args):
        acc_v, a_v, b_v = args
        parts = _maddubs(builder, builder.bitcast(a_v, _BYTES), builder.bitcast(b_v, _BYTES))
        return builder.add(acc_v, _join(builder, parts[0], parts[1], 2 * LANES))

    return I16x32(acc, a, b), codegen


@intrinsic
def vpairs_widen(typingctx, acc):
    """The pair sums as 16 int32 lanes, lane l = int16 lanes 2 l + 2 l + 1 (vpmaddwd by ones; exact)."""

    def codegen(context, builder, signature, args):
        return _widen(builder, _halves(builder, args[0], 2 * LANES))

    return I32x16(acc), codegen


@intrinsic
def vdot4_signed(typingctx, acc, a, b):
    """acc + (per int32 lane) Σ of 4 products (a_byte - 128) · b_byte: a's bytes stored offset by 128 (as Q8_0 weights
    are, for vpdpbusd), b's signed in [-127, 127] — the offset already taken out, with AVX2's vpsignb trick (above)."""
    if not PAIR_SUMS:
        return None

    def codegen(context, builder, signature, args):
        acc_v, a_v, b_v = args
        q = builder.xor(builder.bitcast(a_v, _BYTES), ir.Constant(_BYTES, [0x80] * 4 * LANES))  # signed weights
        # |q| (vpabsb); |-128| wraps to the byte 0x80, which vpmaddubsw reads unsigned: 128
        size = builder.select(builder.icmp_signed("<", q, ir.Constant(_BYTES, [0] * 4 * LANES)), builder.neg(q), q)
        signs = [_x86(builder, "llvm.x86.avx2.psign.b", _HALF_BYTES, x, y)  # x · sign(q), half by half
                 for x, y in zip(_halves(builder, builder.bitcast(b_v, _BYTES), 4 * LANES), _halves(builder, q, 4 * LANES))]
        return builder.add(acc_v, _widen(builder, _maddubs(builder, size, _join(builder, *signs, 4 * LANES))))

    return I32x16(acc, a, b), codegen


@intrinsic
def visub_scalar(typingctx, a, value):
    """a - value (an int32 scalar) in every lane."""

    def codegen(context, builder, signature, args):
        x = context.cast(builder, args[1], signature.args[1], types.int32)
        v = builder.insert_element(ir.Constant(_IVEC, ir.Undefined), x, ir.Constant(_I32, 0))
        v = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES))
        return builder.sub(args[0], v)

    return I32x16(a, value), codegen


@intrinsic
def vtofloat(typingctx, a):
    """int32 lanes converted to float32 (exact below 2^24)."""

    def codegen(context, builder, signature, args):
        return builder.sitofp(args[0], _VEC)

    return F32x16(a), codegen


@numba.njit(inline="always")
def store_lanes(out, m, base, acc, bias, accumulate):
    """out[m, base : base + 16] (+)= acc + bias[base : base + 16] — a product's 16 outputs, bias added last
    (then the old value when accumulating into a residual); only the lanes inside `out` are written."""
    result = vadd(acc, vload(bias, base))
    row = out[m]
    if base + LANES <= out.shape[1]:
        if accumulate:
            result = vadd(vload(row, base), result)
        vstore(row, base, result)
    else:
        for lane in range(out.shape[1] - base):
            value = vlane(result, lane)
            row[base + lane] = row[base + lane] + value if accumulate else value


# ---- quantizing activations to 8 bits (`linear_quant.quantize_activations`) -----------------------------------


@intrinsic
def vmax_abs(typingctx, a):
    """max |a[lane]| over the 16 lanes (a max is exact: the order of comparison does not matter)."""

    def codegen(context, builder, signature, args):
        v, n = _call(builder, "llvm.fabs.v16f32", [args[0]], 1), LANES
        while n > 1:  # halves compared pairwise, as vsum adds them
            half = n // 2
            vec = ir.VectorType(ir.FloatType(), half)
            lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half), list(range(half))))
            hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, half), list(range(half, n))))
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec, vec]), f"llvm.maxnum.v{half}f32")
            v, n = builder.call(fn, [lo, hi]), half
        return builder.extract_element(v, ir.Constant(_I32, 0))

    return types.float32(a), codegen


@intrinsic
def vround_to_int(typingctx, a):
    """Each lane rounded half away from zero as copysign(floor(|a| + 0.5), a) with the + 0.5 in float32 (C's
    roundf but for values within an ulp below a half, which it rounds up), as int32 lanes."""

    def codegen(context, builder, signature, args):
        magnitude = _call(builder, "llvm.fabs.v16f32", [args[0]], 1)
        rounded = _call(builder, "llvm.floor.v16f32", [builder.fadd(magnitude, _vconst(0.5))], 1)
        return builder.fptosi(_call(builder, "llvm.copysign.v16f32", [rounded, args[0]], 2), _IVEC)

    return I32x16(a), codegen


@intrinsic
def vstore_int8(typingctx, array, index, value):
    """array[index : index + 16] = value's lanes truncated to 8 bits (array: 1-D contiguous int8)."""
    if not isinstance(array, types.Array) or array.ndim != 1 or array.dtype != types.int8:
        return None

    def codegen(context, builder, signature, args):
        ptr = _item_pointer(context, builder, signature.args[0], args[0], args[1])
        small = ir.VectorType(ir.IntType(8), LANES)
        builder.store(builder.trunc(args[2], small), builder.bitcast(ptr, small.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(array, index, value), codegen


@intrinsic
def visum(typingctx, a):
    """The sum of the 16 int32 lanes (integers: exact in any order)."""

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [_IVEC]), "llvm.vector.reduce.add.v16i32")
        return builder.call(fn, [args[0]])

    return types.int32(a), codegen


@intrinsic
def vsum4(typingctx, a, b, c, d):
    """`vsum` of four vectors at once: lanes 0-3 of the result are vsum(a), vsum(b), vsum(c), vsum(d) bit for
    bit — the same halves added in the same pairs (lanes 0-7 + 8-15, then 4, 2, 1), interleaved so each step
    is one vector add for all four (lanes 4-15 are 0)."""

    def codegen(context, builder, signature, args):
        def pick(x, y, idx):
            return builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(_I32, len(idx)), idx))

        va, vb, vc, vd = args
        # [a0-7 | b0-7] + [a8-15 | b8-15]: per 8 lanes, one vector's first halving step
        ab = builder.fadd(pick(va, vb, list(range(8)) + list(range(16, 24))),
                          pick(va, vb, list(range(8, 16)) + list(range(24, 32))))
        cd = builder.fadd(pick(vc, vd, list(range(8)) + list(range(16, 24))),
                          pick(vc, vd, list(range(8, 16)) + list(range(24, 32))))
        # 4 lanes per vector: lanes 0-3 + 4-7 of each 8
        lo = [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27]
        s4 = builder.fadd(pick(ab, cd, lo), pick(ab, cd, [i + 4 for i in lo]))
        # 2 lanes per vector: lanes 0-1 + 2-3 of each 4
        s2 = builder.fadd(pick(s4, s4, [0, 1, 4, 5, 8, 9, 12, 13]), pick(s4, s4, [2, 3, 6, 7, 10, 11, 14, 15]))
        # 1 lane per vector: lane 0 + 1 of each 2
        s1 = builder.fadd(pick(s2, s2, [0, 2, 4, 6]), pick(s2, s2, [1, 3, 5, 7]))
        return pick(s1, ir.Constant(ir.VectorType(ir.FloatType(), 4), [0.0] * 4), list(range(4)) + [4] * 12)

    return F32x16(a, b, c, d), codegen


@intrinsic
def vsum16(typingctx, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15):
    """`vsum` of sixteen vectors at once: lane i of the result is vsum(a_i) bit for bit — the same halves added in the
    same pairs (lanes 0-7 + 8-15, then 4, 2, 1), each step one vector add for every input (`vsum4`'s scheme carried to
    the end: 15 adds for 16 sums instead of 20, and the sums come out in one vector instead of sixteen scalars)."""
    if any(not isinstance(x, F32x16Type) for x in (a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15)):
        return None

    def codegen(context, builder, signature, args):
        def pick(x, y, idx):
            return builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(_I32, len(idx)), idx))

        # level 1: [x 0-7 | y 0-7] + [x 8-15 | y 8-15]: 8 lanes per input (x's then y's)
        v = [builder.fadd(pick(x, y, list(range(8)) + list(range(16, 24))), pick(x, y, list(range(8, 16)) + list(range(24, 32))))
             for x, y in zip(args[0::2], args[1::2])]
        # level 2: each input's 8 lanes -> 4 (lanes 0-3 + 4-7); two vectors of two inputs -> one of four inputs
        lo = [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27]
        v = [builder.fadd(pick(x, y, lo), pick(x, y, [i + 4 for i in lo])) for x, y in zip(v[0::2], v[1::2])]
        # level 3: 4 lanes -> 2 (0-1 + 2-3); two vectors of four inputs -> one of eight
        lo = [0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29]
        v = [builder.fadd(pick(x, y, lo), pick(x, y, [i + 2 for i in lo])) for x, y in zip(v[0::2], v[1::2])]
        # level 4: 2 lanes -> 1 (0 + 1): lane i is input i's sum
        return builder.fadd(pick(v[0], v[1], list(range(0, 32, 2))), pick(v[0], v[1], list(range(1, 32, 2))))

    sig = F32x16(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15)
    return sig, codegen


@intrinsic
def vstore_quarter(typingctx, array, index, value, quarter):
    """array[index : index + 4] = lanes 4 quarter .. 4 quarter + 3 of value (array: 1-D contiguous float32;
    quarter a constant-folded integer 0-3)."""
    if not isinstance(array, types.Array) or array.ndim != 1 or array.dtype != types.float32:
        return None
    if not isinstance(quarter, types.IntegerLiteral):
        return None
    q = quarter.literal_value

    def codegen(context, builder, signature, args):
        ptr = _item_pointer(context, builder, signature.args[0], args[0], args[1])
        part = builder.shuffle_vector(args[2], args[2], ir.Constant(ir.VectorType(_I32, 4), [4 * q + i for i in range(4)]))
        builder.store(part, builder.bitcast(ptr, ir.VectorType(ir.FloatType(), 4).as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(array, index, value, quarter), codegen


@intrinsic
def vlow_nibbles(typingctx, a):
    """Each byte's low 4 bits (0-15) as a byte: the first of the two 4-bit weights a byte holds."""

    def codegen(context, builder, signature, args):
        return builder.and_(args[0], ir.Constant(_IVEC, [0x0F0F0F0F] * LANES))

    return I32x16(a), codegen


@intrinsic
def vhigh_nibbles(typingctx, a):
    """Each byte's high 4 bits (0-15) as a byte: the second of the two 4-bit weights a byte holds."""

    def codegen(context, builder, signature, args):
        shifted = builder.lshr(args[0], ir.Constant(_IVEC, [4] * LANES))
        return builder.and_(shifted, ir.Constant(_IVEC, [0x0F0F0F0F] * LANES))

    return I32x16(a), codegen


@numba.njit(inline="always")
def store_row_blocks(out, m, base, a0, a1, a2, a3, bias, accumulate):
    """`store_lanes` of four consecutive blocks of row m: out[m, base : base + 64] from a0 .. a3."""
    store_lanes(out, m, base, a0, bias, accumulate)
    store_lanes(out, m, base + LANES, a1, bias, accumulate)
    store_lanes(out, m, base + 2 * LANES, a2, bias, accumulate)
    store_lanes(out, m, base + 3 * LANES, a3, bias, accumulate)


@numba.njit(inline="always")
def store_block_rows(out, m, base, a0, a1, a2, a3, bias, accumulate, count=4):
    """`store_lanes` of one block in `count` (1-4) consecutive rows: out[m .. m + count - 1, base : base + 16] from
    a0 .. a3 (a tile padded past the last row computes rows it does not store)."""
    store_lanes(out, m, base, a0, bias, accumulate)
    if count > 1:
        store_lanes(out, m + 1, base, a1, bias, accumulate)
    if count > 2:
        store_lanes(out, m + 2, base, a2, bias, accumulate)
    if count > 3:
        store_lanes(out, m + 3, base, a3, bias, accumulate)
