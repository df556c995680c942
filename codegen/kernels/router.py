"""The fused router: scores -> top-k selection -> weights, and the analytic gradient of the logits.

One program per block of BLOCK_T tokens (grid: cdiv(T, BLOCK_T)); each row's E scores live in
registers ([BLOCK_T, BLOCK_E], E padded to a power of two), top-k is K rounds of "take the largest
not yet taken" over integer keys that rank values as torch.topk does (-0.0 below +0.0, NaN above
every number; equal values: the lowest expert index first): int32 keys where every ranked value is
a bf16 or fp16 (the model ranks 16-bit tensors), int64 keys otherwise. Arithmetic is fp32; with ROUND (a
compute dtype narrower than fp32) every value the eager model would store in that dtype is rounded
to it, so ranks and ties are those of the model's own tensors. See codegen/router.py for the
semantics.
"""
import triton
import triton.language as tl

_TAKEN = tl.constexpr(-9223372036854775807)  # below every int64 `_order_keys` key: an expert already picked
_TAKEN32 = tl.constexpr(-2147483647)  # the same for int32 keys (-2**31 would read as an int64 literal)

# `_order_keys`' KEYS: what the ranked values are, which sets the keys' width
KEYS_FP32 = tl.constexpr(0)  # any fp32 value: int64 keys
KEYS_BF16 = tl.constexpr(1)  # every value exactly a bf16: int32 keys (a reduction over them is ~2x cheaper)
KEYS_FP16 = tl.constexpr(2)  # every value exactly an fp16: int32 keys


@triton.jit
def _rnd(x, COMPUTE: tl.constexpr, ROUND: tl.constexpr):
    """x as the compute dtype would hold it (a no-op in fp32)."""
    if ROUND:
        return x.to(COMPUTE).to(tl.float32)
    return x


@triton.jit
def _scores(x, cmask, COMPUTE: tl.constexpr, ROUND: tl.constexpr, SOFTMAX: tl.constexpr):
    """softmax over the valid columns, or sigmoid; x already in the compute dtype's values."""
    if SOFTMAX:
        xm = tl.where(cmask[None, :], x, float("-inf"))
        ex = tl.exp(xm - tl.max(xm, 1)[:, None])
        s = ex / tl.sum(ex, 1)[:, None]
    else:
        s = tl.sigmoid(x)
    return _rnd(s, COMPUTE, ROUND)


@triton.jit
def _order_keys(v, cols, E, BLOCK_E: tl.constexpr, KEYS: tl.constexpr):
    """Integer keys of a [BLOCK_T, BLOCK_E] fp32 tile, larger for a value top-k takes first: by value
    as torch.topk ranks values (-0.0 below +0.0, NaN above every number), equal values by the
    lowest column; columns >= E get the taken key (`_take`). A pick is then one max over the keys.

    KEYS_FP32: int64 keys, the value's fp32 order bits above, BLOCK_E - 1 - column in the low 32 bits.
    KEYS_BF16 / KEYS_FP16 (every value exactly representable in that dtype, which the caller
    guarantees): int32 keys, the value's 16-bit order bits above, BLOCK_E - 1 - column in the low
    16 bits (BLOCK_E <= 2**15). The same order, in half the width."""
    if KEYS == KEYS_FP32:
        bits = v.to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # the float order as signed integers
        key = tl.where(v != v, 2147483647, key)  # NaN of either sign: above +inf's key
        keys = (key.to(tl.int64) << 32) | (BLOCK_E - 1 - cols)[None, :].to(tl.int64)
    else:
        if KEYS == KEYS_BF16:  # a bf16 is its fp32's high half: the fp32 order's high half, no conversion
            bits = v.to(tl.int32, bitcast=True)
            key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)) >> 16
        else:
            bits = v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)  # exact: v is an fp16 value
            key = bits ^ ((bits >> 15) & 0x7FFF)
        key = tl.where(v != v, 32767, key)  # NaN of either sign: above +inf's key
        keys = (key << 16) | (BLOCK_E - 1 - cols)[None, :]
    return _take(keys, cols[None, :] >= E, KEYS)


@triton.jit
def _take(keys, taken, KEYS: tl.constexpr):
    """keys with those where `taken` holds set below every `_order_keys` key of their width."""
    if KEYS == KEYS_FP32:
        return tl.where(taken, _TAKEN, keys)
    return tl.where(taken, _TAKEN32, keys)


@triton.jit
def _key_column(key, BLOCK: tl.constexpr, KEYS: tl.constexpr):
    """The column an `_order_keys` key was made for."""
    low = (key & 0xFFFFFFFF) if KEYS == KEYS_FP32 else (key & 0xFFFF)
    return (BLOCK - 1) - low.to(tl.int32)


@triton.jit
def _pick(keys, BLOCK: tl.constexpr, KEYS: tl.constexpr):
    """Per row, the column whose `_order_keys` key is largest."""
    return _key_column(tl.max(keys, 1), BLOCK, KEYS)


@triton.jit
def _key_value(key, KEYS: tl.constexpr):
    """The fp32 value an `_order_keys` key was made from (NaN for a NaN's key): its order bits
    through the same sign-dependent flip, which is its own inverse."""
    if KEYS == KEYS_FP32:
        hi = (key >> 32).to(tl.int32)
        value = (hi ^ ((hi >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    else:
        hi = key >> 16
        half = hi ^ ((hi >> 15) & 0x7FFF)  # the 16-bit pattern, sign-extended
        if KEYS == KEYS_BF16:
            value = (half << 16).to(tl.float32, bitcast=True)
        else:
            value = half.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return value


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _group_keep(choice, cols, cmask, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
                N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, COMPUTE: tl.constexpr,
                ROUND: tl.constexpr):
    """[BLOCK_T, BLOCK_E] mask of the experts in each row's TOPK_GROUP best groups, a group scoring
    the sum of its two largest choice values, both selections ranked as torch.topk ranks: a NaN
    choice makes its group's score NaN, and NaN scores come first (the groups by `_order_keys`).
    Per group, float reductions over the row (int64 keys there were 2.5x slower at E = 256); which
    groups hold a NaN, one OR-reduction for all of them (a reduction per group cost 16 us more at
    T = 16384, E = 256, 8 groups: 139 against 123 us on the H100, the NaN-blind original 110)."""
    gcols = tl.arange(0, BLOCK_G)
    group = cols // GROUP_SIZE
    nan = choice != choice
    clean = tl.where(nan, float("-inf"), choice)
    if N_GROUP <= 32:  # which groups hold a NaN: one OR-reduction of a bit per group for all of them
        bit = tl.where(cmask, 1 << tl.minimum(group, 31), 0)
        nan_groups = tl.reduce(tl.where(nan, bit[None, :], 0), 1, _bit_or)
    gscore = tl.zeros([BLOCK_T, BLOCK_G], tl.float32)
    for g in tl.static_range(N_GROUP):
        in_g = ((group == g) & cmask)[None, :]
        cg = tl.where(in_g, clean, float("-inf"))
        m1 = tl.max(cg, 1)
        first = tl.min(tl.where(cg == m1[:, None], cols[None, :], BLOCK_E), 1)
        m2 = tl.max(tl.where(cols[None, :] == first[:, None], float("-inf"), cg), 1)
        if N_GROUP <= 32:
            has_nan = ((nan_groups >> g) & 1) != 0
        else:
            has_nan = tl.max((in_g & nan).to(tl.int32), 1) > 0
        top2 = tl.where(has_nan, float("nan"), _rnd(m1 + m2, COMPUTE, ROUND))
        gscore = tl.where(gcols[None, :] == g, top2[:, None], gscore)
    gkeys = _order_keys(gscore, gcols, N_GROUP, BLOCK_G, KEYS_FP32)  # group sums: fp32
    gkeep = tl.zeros([BLOCK_T, BLOCK_G], tl.int32)
    for _ in tl.static_range(TOPK_GROUP):
        hit = gcols[None, :] == _pick(gkeys, BLOCK_G, KEYS_FP32)[:, None]
        gkeys = _take(gkeys, hit, KEYS_FP32)
        gkeep = gkeep | hit.to(tl.int32)
    keep = tl.zeros([BLOCK_T, BLOCK_E], tl.int32)
    for g in tl.static_range(N_GROUP):
        kept = tl.sum(tl.where(gcols[None, :] == g, gkeep, 0), 1) > 0
        keep = keep | (((group == g)[None, :]) & kept[:, None]).to(tl.int32)
    return keep != 0


@triton.jit(do_not_specialize=["T"])
def _route_fwd_kernel(
    logits_ptr,  # [T, E] fp32/fp16/bf16, rows contiguous
    bias_ptr,  # [E] selection bias (read only with HAS_BIAS)
    w_ptr,  # [T, K] compute dtype: topk_weights
    ids_ptr,  # [T, K] int64: topk_ids
    T, E,
    stride_l_t, stride_w_t, stride_i_t,
    eps, scale, fill,
    renorm_min,  # CLAMP: the renormalisation's denominator is at least this (in the compute dtype)
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    SOFTMAX: tl.constexpr, TOPK_FIRST: tl.constexpr, RENORM: tl.constexpr, CLAMP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_G: tl.constexpr,
    COMPUTE: tl.constexpr, ROUND: tl.constexpr, KEYS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    kcols = tl.arange(0, BLOCK_K)
    rmask, cmask, kmask = rows < T, cols < E, kcols < K
    rows64 = rows.to(tl.int64)
    x = tl.load(logits_ptr + rows64[:, None] * stride_l_t + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                other=0.0).to(tl.float32)
    if TOPK_FIRST:
        choice = x  # the logits as they are: top-k ranks them in their own dtype
        s = x
    else:
        s = _scores(_rnd(x, COMPUTE, ROUND), cmask, COMPUTE, ROUND, SOFTMAX)
        choice = s
        if HAS_BIAS:
            b = tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            choice = _rnd(choice + b[None, :], COMPUTE, ROUND)
        if N_GROUP > 1:
            keep = _group_keep(choice, cols, cmask, BLOCK_T, BLOCK_E, BLOCK_G, N_GROUP, TOPK_GROUP, GROUP_SIZE, COMPUTE, ROUND)
            choice = tl.where(keep, choice, fill)

    # the picked value is the key's own where the keys rank s itself: one reduction a pick, not two
    VALUE_IN_KEY: tl.constexpr = TOPK_FIRST or (not HAS_BIAS and N_GROUP == 1)
    keys = _order_keys(choice, cols, E, BLOCK_E, KEYS)
    top_v = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    top_i = tl.zeros([BLOCK_T, BLOCK_K], tl.int64)
    for j in range(K):
        best = tl.max(keys, 1)
        pick = _key_column(best, BLOCK_E, KEYS)
        hit = cols[None, :] == pick[:, None]
        keys = _take(keys, hit, KEYS)
        if VALUE_IN_KEY:
            value = _key_value(best, KEYS)
        else:
            value = tl.sum(tl.where(hit, s, 0.0), 1)
        top_v = tl.where(kcols[None, :] == j, value[:, None], top_v)
        top_i = tl.where(kcols[None, :] == j, pick[:, None].to(tl.int64), top_i)

    if TOPK_FIRST:  # softmax over the K selected logits, in the compute dtype
        v = tl.where(kmask[None, :], _rnd(top_v, COMPUTE, ROUND), float("-inf"))
        ev = tl.exp(v - tl.max(v, 1)[:, None])
        w = _rnd(ev / tl.sum(ev, 1)[:, None], COMPUTE, ROUND)
    else:
        w = top_v
    w = tl.where(kmask[None, :], w, 0.0)
    if RENORM:  # w / (sum(w) + eps), each step as the model rounds it; CLAMP: w / clamp(sum + eps, min)
        den = _rnd(_rnd(tl.sum(w, 1), COMPUTE, ROUND) + eps, COMPUTE, ROUND)
        if CLAMP:  # NaN stays NaN, as torch.clamp keeps it
            den = tl.maximum(den, renorm_min, propagate_nan=tl.PropagateNan.ALL)
        w = _rnd(w / den[:, None], COMPUTE, ROUND)
    w = _rnd(w * scale, COMPUTE, ROUND)
    out = rmask[:, None] & kmask[None, :]
    tl.store(w_ptr + rows64[:, None] * stride_w_t + kcols[None, :], w.to(w_ptr.dtype.element_ty), mask=out)
    tl.store(ids_ptr + rows64[:, None] * stride_i_t + kcols[None, :], top_i, mask=out)


@triton.jit(do_not_specialize=["T"])
def _route_bwd_kernel(
    grad_w_ptr,  # [T, K] any float: d loss / d topk_weights
    logits_ptr,  # [T, E] fp32/fp16/bf16, rows contiguous (the forward's input)
    ids_ptr,  # [T, K] int64: the forward's topk_ids (K distinct experts a row)
    dlogits_ptr,  # [T, E] logits dtype: d loss / d logits
    T, E,
    stride_g_t, stride_l_t, stride_i_t, stride_d_t,
    eps, scale, renorm_min,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    SOFTMAX: tl.constexpr, TOPK_FIRST: tl.constexpr, RENORM: tl.constexpr, CLAMP: tl.constexpr,
    COMPUTE: tl.constexpr, ROUND: tl.constexpr,
):
    """dlogits from d topk_weights, with b the selected scores (the weights before renorm/scale):
        g_b = c g                                    (scale c)
        renorm, S = sum(b) + eps, w = b / S:  g_b = (g_b - <g_b, w>) / S
        CLAMP, S = max(sum(b) + eps, m):     g_b = (g_b - [sum(b) + eps >= m] <g_b, w>) / S
        softmax -> topk: G = scatter(g_b) [E],  dl = p * (G - <G, p>) = p * (G - <g_b, b>)
        sigmoid -> topk: G = scatter(g_b),      dl = G * s * (1 - s)
        topk -> softmax: dv = b * (g_b - <g_b, b>), dl = scatter(dv)

    Everything but softmax -> topk's p is a [BLOCK_T, K] tile: the K selected logits are gathered
    by their ids (b_j is the score at column ids[j], computed as the forward computes it there), so
    no reduction runs over E to find them. The [BLOCK_T, E] result is stored in two passes: every
    column's value for an unselected expert (0, -p <g_b, b> after softmax -> topk, NaN where sigmoid
    -> topk has a NaN logit), then, after a barrier that orders the two stores of one address, the K
    selected columns' own values. (Before, a reduction over E per pick found each b_j and another
    scattered g_b: 18.4 us of a 7b-256 step on the H100, T = 24576, E = 128, K = 8.)"""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    kcols = tl.arange(0, BLOCK_K)
    rmask, cmask, kmask = rows < T, cols < E, kcols < K
    rows64 = rows.to(tl.int64)
    full = rmask[:, None] & cmask[None, :]
    tile_k = rmask[:, None] & kmask[None, :]
    ids = tl.load(ids_ptr + rows64[:, None] * stride_i_t + kcols[None, :], mask=tile_k, other=0)
    l_rows = logits_ptr + rows64[:, None] * stride_l_t
    x_sel = _rnd(tl.load(l_rows + ids, mask=tile_k, other=0.0).to(tl.float32), COMPUTE, ROUND)
    g = tl.load(grad_w_ptr + rows64[:, None] * stride_g_t + kcols[None, :], mask=tile_k, other=0.0).to(tl.float32)
    if TOPK_FIRST:
        v = tl.where(kmask[None, :], x_sel, float("-inf"))
        ev = tl.exp(v - tl.max(v, 1)[:, None])
        b = _rnd(ev / tl.sum(ev, 1)[:, None], COMPUTE, ROUND)
    elif SOFTMAX:  # the whole row's softmax: p at every column, its max and sum for the selected ones
        x = _rnd(tl.load(l_rows + cols[None, :], mask=full, other=0.0).to(tl.float32), COMPUTE, ROUND)
        xm = tl.where(cmask[None, :], x, float("-inf"))
        row_max = tl.max(xm, 1)
        ex = tl.exp(xm - row_max[:, None])
        row_sum = tl.sum(ex, 1)
        p = _rnd(ex / row_sum[:, None], COMPUTE, ROUND)
        b = _rnd(tl.exp(x_sel - row_max[:, None]) / row_sum[:, None], COMPUTE, ROUND)  # p at the ids, as computed there
    else:
        b = _rnd(tl.sigmoid(x_sel), COMPUTE, ROUND)
    b = tl.where(kmask[None, :], b, 0.0)
    g = g * scale
    if RENORM:
        den = tl.where(rmask, tl.sum(b, 1) + eps, 1.0)  # rows past T hold no selection
        if CLAMP:  # the sum's own gradient passes where the clamp does (den >= min, as torch.clamp's)
            through = den >= renorm_min
            den = tl.maximum(den, renorm_min, propagate_nan=tl.PropagateNan.ALL)
            w = b / den[:, None]
            g = (g - tl.where(through, tl.sum(g * w, 1), 0.0)[:, None]) / den[:, None]
        else:
            w = b / den[:, None]
            g = (g - tl.sum(g * w, 1)[:, None]) / den[:, None]
    out_dtype = dlogits_ptr.dtype.element_ty
    d_rows = dlogits_ptr + rows64[:, None] * stride_d_t
    if TOPK_FIRST:
        sel = b * (g - tl.sum(g * b, 1)[:, None])
        rest = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    elif SOFTMAX:
        dot = tl.sum(tl.where(kmask[None, :], g * b, 0.0), 1)[:, None]  # <G, p>: G is g_b at the ids, 0 elsewhere
        sel = b * (g - dot)
        rest = p * (0.0 - dot)
    else:  # 0 * s (1 - s) at an unselected column: 0, or NaN where its logit is NaN, as eager gives
        sel = g * b * (1.0 - b)
        x = tl.load(l_rows + cols[None, :], mask=full, other=0.0)
        rest = tl.where(x != x, float("nan"), 0.0)
    tl.store(d_rows + cols[None, :], _rnd(rest, COMPUTE, ROUND).to(out_dtype), mask=full)
    tl.debug_barrier()  # this program's stores of the unselected values land before the selected ones
    tl.store(d_rows + ids, _rnd(sel, COMPUTE, ROUND).to(out_dtype), mask=tile_k)
