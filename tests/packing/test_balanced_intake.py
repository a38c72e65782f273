"""The ``balanced`` planner's stream reads (packing.balanced_intake): called with arrays that
fill up and are grown between calls, as the planner calls them, they read exactly what one
plain scan reads."""
import numpy as np
from hypothesis import given, strategies as st

from packing.balanced_intake import _read_until, _scan_lookahead
from packing.balanced_pool import _grow, _grow_bool


def _stream(seed, n):
    rng = np.random.default_rng(seed)
    sizes = np.where(rng.random(n) < 0.2, rng.integers(500, 1000, n),
                     rng.integers(1, 100, n)).astype(np.int64)
    costs = sizes + sizes.astype(np.float64) ** 2 / 256
    taken = rng.random(n) < 0.1
    return sizes, costs, taken


def _plain_scan(sizes, costs, cpt, thr, lim_cum, pos, cap):
    """The look-ahead's scan as a loop over lists, from the start of the stream."""
    fut, fut_cum, before = [], [], []
    look, look_cum, f0, tok = 0, 0, 0, 0
    while look < len(sizes) and look_cum < lim_cum:
        if costs[look] - sizes[look] * cpt > thr:
            while f0 < len(fut) and fut[f0] < pos:
                f0 += 1
            if f0 < len(fut) and tok - before[f0] >= cap:
                break
            fut.append(look)
            fut_cum.append(look_cum)
            before.append(tok)
            tok += int(sizes[look])
        else:
            look_cum += int(sizes[look])
        look += 1
    return look, look_cum, f0, tok, fut, fut_cum, before


@given(st.integers(0, 2**16), st.integers(1, 3000), st.integers(0, 10**6),
       st.integers(0, 3000), st.integers(1, 10**5))
def test_lookahead_scan_grown_between_calls_equals_one_plain_scan(seed, n, lim_cum, pos, cap):
    sizes, costs, _ = _stream(seed, n)
    cpt, thr = 1.0, 100.0
    want = _plain_scan(sizes, costs, cpt, thr, lim_cum, pos, cap)
    fut = np.empty(1, np.int64)
    fut_cum = np.empty(1, np.int64)
    before = np.empty(1, np.int64)
    look, look_cum, nf, f0, tok = np.int64(0), np.int64(0), np.int64(0), np.int64(0), np.int64(0)
    while True:
        look, look_cum, nf, f0, tok, full = _scan_lookahead(
            sizes, costs, sizes, cpt, thr, look, look_cum, np.int64(lim_cum), np.int64(pos),
            fut, fut_cum, before, nf, f0, tok, np.int64(cap))
        if not full:
            break
        fut, fut_cum, before = _grow(fut, nf + 1), _grow(fut_cum, nf + 1), _grow(before, nf + 1)
    assert (look, look_cum, f0, tok) == want[:4]
    assert fut[:nf].tolist() == want[4]
    assert fut_cum[:nf].tolist() == want[5]
    assert before[:nf].tolist() == want[6]


@given(st.integers(0, 2**16), st.integers(1, 3000), st.integers(1, 64), st.integers(0, 10**5),
       st.integers(0, 40), st.integers(0, 20000), st.booleans(), st.booleans())
def test_pool_read_in_chunks_equals_one_read(seed, n, chunk, need, long_cap, lump_cap, adv,
                                             count_passed):
    sizes, costs, taken = _stream(seed, n)
    if not adv:
        taken = np.zeros(0, np.bool_)
    cpt, thr, capacity = 1.0, 100.0, 1500

    def read(step_room):
        # as the planner calls it: room for a chunk, then a call with the limits left
        pool = np.empty(1, np.int64)
        parr = np.empty(1, np.int64)
        now = np.ones(1, np.bool_)
        ls = np.empty(1, np.int64)
        pos, np_, nls, light, passed, longs, lump_tok = (np.int64(0),) * 7

        def counted():
            return light + (passed if count_passed else 0)

        while pos < n and counted() < need and longs < long_cap and lump_tok < lump_cap:
            lim = np_ + step_room
            pool, parr, ls = _grow(pool, lim), _grow(parr, lim), _grow(ls, nls + step_room)
            now = _grow_bool(now, lim)
            pos, np_, nls, g, gt, gl, glt = _read_until(
                sizes, costs, sizes, taken, cpt, thr, pos, np.int64(need - counted()),
                np.bool_(count_passed), np_, lim, nls, np.int64(7), pool, parr, now, ls,
                np.int64(capacity), np.int64(long_cap - longs), np.int64(lump_cap - lump_tok))
            light += g
            passed += gt
            longs += gl
            lump_tok += glt
        return (int(pos), pool[:np_].tolist(), parr[:np_].tolist(), now[:np_].tolist(),
                ls[:nls].tolist(), int(light), int(passed), int(longs), int(lump_tok))

    one = read(n + 1)
    assert read(chunk) == one
    pos, pool, parr, now, ls, light, passed, longs, lump_tok = one
    lump = costs - sizes * cpt > thr
    # every item before pos read once, in order, unless taken (passed, a light one counted)
    skip = taken[:pos] if adv else np.zeros(pos, np.bool_)
    assert pool == np.flatnonzero(~skip).tolist()
    assert parr == [7] * len(pool) and not any(now)
    assert ls == [k for k, i in enumerate(pool) if lump[i]]
    assert light == int(sizes[pool][~lump[pool]].sum())
    assert passed == int(sizes[:pos][skip & ~lump[:pos]].sum())
    assert longs == int((2 * sizes[pool] > capacity).sum())
    assert lump_tok == int(sizes[pool][lump[pool]].sum())
    # it stopped at the first limit reached (or the stream's end)
    if pos < n:
        assert (light + (passed if count_passed else 0) >= need or longs >= long_cap
                or lump_tok >= lump_cap)
