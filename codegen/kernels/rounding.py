"""Token rounding on the device in four Triton kernels (the launcher is `codegen.token_rounding`).

The state is one int8 matrix `assign` [E, T], expert-major: 0 = token t is not routed to expert e,
j + 1 = it is, as its top-k pair j (the first j where a token lists e twice), -1 = it is, added by
rounding up. `probs_t` [E, T] fp32 holds the router probabilities in the same layout, so a program
owning one expert reads both rows contiguously.

    _transpose_kernel   probs [T, E], ids [T, K] -> probs_t, assign (the plain top-k)
    _select_kernel      per expert: pick the n smallest candidates by (key, token) and flip them
    _token_pass_kernel  per token: its expert count; keep_every_token's return of orphans
    _emit_slots_kernel  assign -> the token-major slot form (ids, weights, tokens)

In order: transpose, select (the rounding), then with keep_every_token a token pass, a select that
swaps out spare members, a second token pass; without it one token pass; a cumsum; emit.

The selection is a radix select on an order-preserving 32-bit key of the probability (descending
selections flip it): eight passes, each counting the candidates of every value of the next four bits
under the prefix found so far, fix the n-th smallest key v; the last pass takes every candidate
below v and the first n - #(below v) candidates equal to v in token order. No sort, no host sync.
"""
import triton
import triton.language as tl

ADDED = tl.constexpr(-1)  # `assign` value of a pair added by rounding up

# _select_kernel MODE: how an expert's n and candidates are found (MODES: the launcher's codes)
DOWN = tl.constexpr(0)
UP = tl.constexpr(1)
NEAREST = tl.constexpr(2)
SWAP = tl.constexpr(3)
MODES = {"down": 0, "up": 1, "nearest": 2, "swap": 3}


@triton.jit(do_not_specialize=["T"])
def _transpose_kernel(probs_ptr, ids_ptr, probs_t_ptr, assign_ptr, T, E, stride_pt, stride_pe,
                      stride_it, stride_ik, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    live = (t[:, None] < T) & (e[None, :] < E)
    p = tl.load(probs_ptr + t[:, None] * stride_pt + e[None, :] * stride_pe, mask=live, other=0.0)
    slot = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int32)
    for jj in tl.static_range(K):  # last j first, so a duplicated expert keeps its first pair
        j = K - 1 - jj
        ids = tl.load(ids_ptr + t * stride_it + j * stride_ik, mask=t < T, other=-1)
        slot = tl.where(ids[:, None] == e[None, :], j + 1, slot)
    out = e[None, :].to(tl.int64) * T + t[:, None]
    tl.store(probs_t_ptr + out, p.to(tl.float32), mask=live)
    tl.store(assign_ptr + out, slot.to(tl.int8), mask=live)


@triton.jit
def _ordered_key(p, candidates_are_members):
    """uint32 keys whose unsigned order is the float order of p, reversed for outsiders (an expert
    adds its most probable outsiders: the smallest keys of the reversed order)."""
    bits = p.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) == 1, ~bits, bits | 0x80000000)
    return tl.where(candidates_are_members, key, ~key)


@triton.jit
def _candidates(probs_t_ptr, assign_ptr, token_count_ptr, row, t, T, members, MODE: tl.constexpr):
    """(candidate flags, keys) of tokens t in one expert's row."""
    live = t < T
    a = tl.load(assign_ptr + row + t, mask=live, other=0)
    cand = live & ((a != 0) == members)
    if MODE == SWAP:
        cand = cand & (tl.load(token_count_ptr + t, mask=live, other=0) >= 2)
    key = _ordered_key(tl.load(probs_t_ptr + row + t, mask=live, other=0.0), members)
    return cand, key


@triton.jit
def _digit_counts(acc, cand, key, prefix, shift):
    """acc [BLOCK, 16] += one-hot of the 4-bit digit at `shift` of the candidates whose higher bits
    equal prefix's (two shifts, so shift = 28 never shifts by 32)."""
    ks = key >> shift
    cand = cand & ((ks >> 4) == ((prefix >> shift) >> 4))
    digit = (ks & 15).to(tl.int32)
    return acc + ((digit[:, None] == tl.arange(0, 16)[None, :]) & cand[:, None]).to(tl.int32)


@triton.jit
def _next_digit(acc, rank):
    """(digit, rank within it, candidates with it) of the rank-th smallest key, from a pass's counts."""
    hist = tl.sum(acc, 0)
    bins = tl.arange(0, 16)
    d = tl.minimum(tl.sum((tl.cumsum(hist, 0) < rank).to(tl.int32), 0), 15)
    return d, rank - tl.sum(tl.where(bins < d, hist, 0), 0), tl.sum(tl.where(bins == d, hist, 0), 0)


@triton.jit
def _pick(ptrs, new, cand, key, prefix, rank, taken):
    """Write `new` at the candidates with key below `prefix`, and at those equal to it whose rank
    among all ties so far (`taken` of them in earlier chunks) is below `rank`; -> `taken` plus this
    chunk's ties."""
    tie = cand & (key == prefix)
    tie_rank = taken + tl.cumsum(tie.to(tl.int32), 0) - tie.to(tl.int32)
    tl.store(ptrs, new, mask=cand & ((key < prefix) | (tie & (tie_rank < rank))))
    return taken + tl.sum(tie.to(tl.int32), 0)


@triton.jit(do_not_specialize=["T"])
def _select_kernel(probs_t_ptr, assign_ptr, n_ptr, token_count_ptr, scratch_ptr, T, tile, cap,
                   MODE: tl.constexpr, BLOCK_T: tl.constexpr):
    """One program per expert. DOWN/UP/NEAREST: the expert moves from its plain top-k count to its
    rounded count by dropping its weakest members or adding its most probable outsiders. SWAP:
    n_ptr holds how many of its weakest spare members (tokens routed to another expert too, per
    token_count_ptr) the expert drops.

    The radix passes scan the whole row only while more than `cap` candidates share the prefix
    found so far; then one scan takes the candidates below it and writes the tokens of those on it
    to the expert's row of `scratch_ptr` ([E, cap] int32, token order), and the remaining passes and
    the pick read those few. A pass counts per element ([BLOCK_T, 16]) and reduces once at its end;
    a whole-row scan issues each chunk's loads one chunk ahead."""
    expert = tl.program_id(0)
    row = expert.to(tl.int64) * T
    lanes = tl.arange(0, BLOCK_T)
    if MODE == SWAP:
        n = tl.load(n_ptr + expert)
        members = n >= 0  # candidates are members (that keep another expert)
        n_cand = tl.zeros((), dtype=tl.int32)
        if n > 0:
            for start in range(0, T, BLOCK_T):
                cand, _ = _candidates(probs_t_ptr, assign_ptr, token_count_ptr, row, start + lanes, T, members, MODE)
                n_cand += tl.sum(cand.to(tl.int32), 0)
    else:
        count = tl.zeros((), dtype=tl.int32)
        for start in range(0, T, BLOCK_T):
            t = start + lanes
            count += tl.sum((tl.load(assign_ptr + row + t, mask=t < T, other=0) != 0).to(tl.int32), 0)
        down = (count // tile) * tile
        up = tl.minimum(down + tl.where(count > down, tile, 0), T)
        if MODE == DOWN:
            target = down
        elif MODE == UP:
            target = up
        else:
            target = tl.where(2 * (count - down) >= tile, up, down)
        members = count > target
        n = tl.where(members, count - target, target - count)
        n_cand = tl.where(members, count, T - count)
    new = tl.where(members, 0, ADDED).to(tl.int8)
    if (n > 0) & (n >= n_cand):  # every candidate goes
        for start in range(0, T, BLOCK_T):
            t = start + lanes
            cand, _ = _candidates(probs_t_ptr, assign_ptr, token_count_ptr, row, t, T, members, MODE)
            tl.store(assign_ptr + row + t, new, mask=cand)
    if (n > 0) & (n < n_cand):
        prefix = tl.zeros((), dtype=tl.uint32)
        rank = n  # the rank (from 1) of the wanted key among the candidates on `prefix`
        on_prefix = n_cand
        p = tl.zeros((), dtype=tl.int32)  # passes done: the top 4p bits of `prefix` are fixed
        while (p < 8) & (on_prefix > cap):
            shift = (28 - 4 * p).to(tl.uint32)
            acc = tl.zeros((BLOCK_T, 16), dtype=tl.int32)
            cand, key = _candidates(probs_t_ptr, assign_ptr, token_count_ptr, row, lanes, T, members, MODE)
            for start in range(0, T, BLOCK_T):
                next_cand, next_key = _candidates(probs_t_ptr, assign_ptr, token_count_ptr, row,
                                                  start + BLOCK_T + lanes, T, members, MODE)
                acc = _digit_counts(acc, cand, key, prefix, shift)
                cand, key = next_cand, next_key
            d, rank, on_prefix = _next_digit(acc, rank)
            prefix = prefix | (d.to(tl.uint32) << shift)
            p += 1
        if p < 8:
            # take the candidates below the prefix; list those on it (on_prefix <= cap of them)
            shift = (28 - 4 * p).to(tl.uint32)
            base = scratch_ptr + expert.to(tl.int64) * cap
            listed = tl.zeros((), dtype=tl.int32)
            for start in range(0, T, BLOCK_T):
                t = start + lanes
                cand, key = _candidates(probs_t_ptr, assign_ptr, token_count_ptr, row, t, T, members, MODE)
                high, prefix_high = (key >> shift) >> 4, (prefix >> shift) >> 4
                tl.store(assign_ptr + row + t, new, mask=cand & (high < prefix_high))
                on = cand & (high == prefix_high)
                tl.store(base + listed + tl.cumsum(on.to(tl.int32), 0) - on.to(tl.int32), t, mask=on)
                listed += tl.sum(on.to(tl.int32), 0)
            tl.debug_barrier()  # the list's stores before its loads, by other threads
            while p < 8:
                shift = (28 - 4 * p).to(tl.uint32)
                acc = tl.zeros((BLOCK_T, 16), dtype=tl.int32)
                for start in range(0, listed, BLOCK_T):
                    i = start + lanes
                    on = i < listed
                    t = tl.load(base + i, mask=on, other=0)
                    key = _ordered_key(tl.load(probs_t_ptr + row + t, mask=on, other=0.0), members)
                    acc = _digit_counts(acc, on, key, prefix, shift)
                d, rank, on_prefix = _next_digit(acc, rank)
                prefix = prefix | (d.to(tl.uint32) << shift)
                p += 1
            # the listed keys below the prefix, and the first `rank` equal to it
            taken = tl.zeros((), dtype=tl.int32)
            for start in range(0, listed, BLOCK_T):
                i = start + lanes
                on = i < listed
                t = tl.load(base + i, mask=on, other=0)
                key = _ordered_key(tl.load(probs_t_ptr + row + t, mask=on, other=0.0), members)
                taken = _pick(assign_ptr + row + t, new, on, key, prefix, rank, taken)
        else:
            # more than `cap` candidates on the full key: the whole row, ties in token order
            taken = tl.zeros((), dtype=tl.int32)
            for start in range(0, T, BLOCK_T):
                t = start + lanes
                cand, key = _candidates(probs_t_ptr, assign_ptr, token_count_ptr, row, t, T, members, MODE)
                taken = _pick(assign_ptr + row + t, new, cand, key, prefix, rank, taken)


@triton.jit(do_not_specialize=["T"])
def _token_pass_kernel(assign_ptr, ids_ptr, weights_ptr, per_token_ptr, n_swap_ptr, T, E, stride_it, stride_ik,
                       stride_wt, stride_wk, K, KEEP: tl.constexpr, FIRST: tl.constexpr, K_POW2: tl.constexpr,
                       BLOCK_T: tl.constexpr, E_POW2: tl.constexpr):
    """Per token: how many experts it has (per_token). KEEP: a token with none goes back to its best
    top-k expert (largest weight, first pair listing it). FIRST (after the rounding): per_token keeps
    the count before that, and n_swap counts each expert's returning tokens (the members it swaps
    out next); the second pass (after the swap) catches a token swapped out by two experts."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, E_POW2)
    live = t < T
    a = tl.load(assign_ptr + e[:, None].to(tl.int64) * T + t[None, :], mask=(e[:, None] < E) & live[None, :],
                other=0)
    count = tl.sum((a != 0).to(tl.int32), 0)
    if KEEP:
        j = tl.arange(0, K_POW2)
        pair = live[:, None] & (j[None, :] < K)
        w = tl.load(weights_ptr + t[:, None] * stride_wt + j[None, :] * stride_wk, mask=pair, other=float("-inf"))
        ids = tl.load(ids_ptr + t[:, None] * stride_it + j[None, :] * stride_ik, mask=pair, other=-1)
        top = tl.argmax(w.to(tl.float32), 1, tie_break_left=True)
        best = tl.sum(tl.where(j[None, :] == top[:, None], ids, 0), 1)
        best_pair = tl.min(tl.where(ids == best[:, None], j[None, :], K_POW2), 1)
        orphan = live & (count == 0)
        tl.store(assign_ptr + best.to(tl.int64) * T + t, (best_pair + 1).to(tl.int8), mask=orphan)
        if FIRST:
            tl.atomic_add(n_swap_ptr + best, tl.full((BLOCK_T,), 1, tl.int32), mask=orphan)
        else:
            count = tl.where(orphan, 1, count)
    tl.store(per_token_ptr + t, count, mask=live)


@triton.jit(do_not_specialize=["T", "S"])
def _emit_slots_kernel(assign_ptr, probs_ptr, ids_ptr, weights_ptr, slot_end_ptr, per_token_ptr, slot_ids_ptr,
                       slot_w_ptr, slot_token_ptr, T, E, S, K, stride_pt, stride_pe, stride_it, stride_ik, stride_wt,
                       stride_wk, BLOCK_T: tl.constexpr, E_POW2: tl.constexpr, BLOCK_PAD: tl.constexpr):
    """The slots of BLOCK_T tokens: each token's experts in ascending order from its first slot
    (slot_end: the inclusive cumsum of per_token); weight = the top-k weight of a top-k pair; of an
    added pair, its router probability times the token's W / P (`added_pair_scale`, summed over k
    in order and divided with IEEE rounding, as the reference). The programs also write the padding
    slots past the last routed one (id -1, weight 0, token T), so the outputs need no fill beforehand."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, E_POW2)
    live = (e[:, None] < E) & (t[None, :] < T)
    a = tl.load(assign_ptr + e[:, None].to(tl.int64) * T + t[None, :], mask=live, other=0).to(tl.int32)
    routed = a != 0
    rank = tl.cumsum(routed.to(tl.int32), 0) - routed.to(tl.int32)
    first = tl.load(slot_end_ptr + t, mask=t < T, other=0) - tl.load(per_token_ptr + t, mask=t < T, other=0)
    slot = first[None, :] + rank
    keep = routed & (slot < S)
    topk = a > 0
    w_topk = tl.load(weights_ptr + t[None, :] * stride_wt + (a - 1) * stride_wk, mask=keep & topk, other=0.0)
    w_added = tl.load(probs_ptr + t[None, :] * stride_pt + e[:, None] * stride_pe, mask=keep & ~topk, other=0.0)
    sum_w = tl.zeros((BLOCK_T,), dtype=tl.float32)
    sum_p = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for k in range(0, K):
        expert = tl.load(ids_ptr + t * stride_it + k * stride_ik, mask=t < T, other=0)
        sum_w += tl.load(weights_ptr + t * stride_wt + k * stride_wk, mask=t < T, other=0.0).to(tl.float32)
        sum_p += tl.load(probs_ptr + t * stride_pt + expert * stride_pe, mask=t < T, other=0.0).to(tl.float32)
    scale = tl.where(sum_p > 0, tl.math.div_rn(sum_w, tl.where(sum_p > 0, sum_p, 1.0)), 1.0)
    w = tl.where(topk, w_topk, (w_added.to(tl.float32) * scale[None, :]).to(w_topk.dtype))
    tl.store(slot_ids_ptr + slot, tl.broadcast_to(e[:, None], (E_POW2, BLOCK_T)), mask=keep)
    tl.store(slot_token_ptr + slot, tl.broadcast_to(t[None, :], (E_POW2, BLOCK_T)), mask=keep)
    tl.store(slot_w_ptr + slot, w, mask=keep)
    # padding: slots [routed total, S), strided over the programs
    total = tl.load(slot_end_ptr + T - 1)
    for start in range(total + tl.program_id(0) * BLOCK_PAD, S, tl.num_programs(0) * BLOCK_PAD):
        pad = start + tl.arange(0, BLOCK_PAD)
        fill = pad < S
        tl.store(slot_ids_ptr + pad, tl.full((BLOCK_PAD,), -1, tl.int32), mask=fill)
        tl.store(slot_token_ptr + pad, tl.full((BLOCK_PAD,), 0, tl.int32) + T, mask=fill)
        tl.store(slot_w_ptr + pad, tl.zeros((BLOCK_PAD,), dtype=slot_w_ptr.dtype.element_ty), mask=fill)
