"""The token-first step's exchanges for its holes (packing.hole_swap): equal to the plain
reference, one exchange a microbatch at most, each one larger by at most the room, never an item
at its deadline given back, never an item ahead taken twice."""
import numpy as np
import pytest

from packing.hole_swap import _hole_swaps
from tests.naive.balanced import hole_swaps as naive_hole_swaps


def _case(seed):
    rng = np.random.default_rng(seed)
    cap = int(rng.choice([1000, 4096]))
    nb = int(rng.integers(1, 12))
    n = 600
    sizes = rng.integers(1, cap + 1, n).astype(np.int64)
    costs = sizes + sizes.astype(float) ** 2 / 4096
    w = sizes.copy()
    cpt, thr = 1.0, float(rng.choice([cap / 8, cap / 2]))
    is_lump = costs - sizes * cpt > thr
    taken = rng.random(n) < 0.1
    pos = int(rng.integers(40, 80))
    # candidates: stream items before pos, one or two a bin, leaving some room
    cand = np.arange(pos - 2 * nb, pos, dtype=np.int64)
    bo = np.full(cand.shape[0], -1, dtype=np.int64)
    bt = np.zeros(nb, dtype=np.int64)
    for t in range(cand.shape[0]):
        b = t % nb
        if bt[b] + sizes[cand[t]] <= cap - int(rng.integers(0, cap // 8)):
            bo[t] = b
            bt[b] += sizes[cand[t]]
    cls = rng.integers(0, 4, cand.shape[0]).astype(np.int64)
    limit = int(rng.integers(4, 40))
    nfill = int(rng.integers(0, 3))  # items the fill read ahead (placed nowhere here)
    fill = [int(i) for i in np.flatnonzero(~taken[pos:])[:nfill] + pos]
    return dict(sizes=sizes, costs=costs, w=w, cpt=cpt, thr=thr, is_lump=is_lump, taken=taken,
                pos=pos, cand=cand, bo=bo, bt=bt, cls=cls, cap=cap, limit=limit, fill=fill,
                budget=int(rng.integers(cap // 2, 4 * cap)), adv=int(rng.integers(1, 4)))


def _swaps(c):
    """The kernel on case ``c``, the fill's items first: (bo, bt, fi, fe, fb, items the fill
    read, items after the exchanges)."""
    limit = c["limit"]
    fi = np.zeros(limit, dtype=np.int64)
    fe = np.zeros(limit, dtype=np.int64)
    fb = np.zeros(limit, dtype=np.int64)
    na0 = min(len(c["fill"]), limit)
    fi[:na0] = c["fill"][:na0]
    fe[:na0] = 1
    bo, bt = c["bo"].copy(), c["bt"].copy()
    na = _hole_swaps(c["cand"], c["cls"] == 0, bo, c["sizes"], c["costs"], c["w"], c["taken"],
                     c["cpt"], c["thr"], c["pos"], c["budget"], c["adv"], c["cap"], bt, fi, fe,
                     fb, na0)
    return bo, bt, fi, fe, fb, na0, na


@pytest.mark.parametrize("seed", range(60))
def test_hole_swaps_equal_reference_and_keep_the_rules(seed):
    c = _case(seed)
    nb, cap, limit = c["bt"].shape[0], c["cap"], c["limit"]
    bo, bt, fi, fe, fb, na0, na = _swaps(c)
    # the reference on lists: candidates' bins then the fill's, rooms, fill, est
    ref_bo = [int(b) for b in c["bo"]] + [0] * na0
    room = [cap - int(x) for x in c["bt"]]
    ref_fill, ref_est = list(fi[:na0]), [1] * na0
    naive_hole_swaps(c["cand"], list(c["cls"] == 0), ref_bo, room, ref_fill, ref_est,
                     c["sizes"], c["w"], c["taken"], c["is_lump"], c["pos"], c["budget"],
                     c["adv"], limit)
    nc = c["cand"].shape[0]
    assert bo.tolist() == ref_bo[:nc]
    assert fi[:na].tolist() == ref_fill and fe[:na].tolist() == ref_est
    assert fb[na0:na].tolist() == ref_bo[nc + na0:]
    assert (cap - bt).tolist() == room
    # the rules
    assert (bt <= cap).all()
    given_back = np.flatnonzero((c["bo"] >= 0) & (bo < 0))
    assert given_back.shape[0] == na - na0
    assert (c["cls"][given_back] != 0).all()  # never an item at its deadline
    assert np.unique(fb[na0:na]).shape[0] == na - na0  # one exchange a microbatch at most
    assert np.unique(fi[:na]).shape[0] == na and not c["taken"][fi[:na]].any()
    back_of = {int(c["bo"][t]): t for t in given_back}  # one a bin: exchanges are in bin order
    for i, b in zip(fi[na0:na], fb[na0:na]):
        assert c["sizes"][i] > c["sizes"][c["cand"][back_of[int(b)]]]
    placed = c["bo"] >= 0
    tokens = (np.bincount(c["bo"][placed], weights=c["sizes"][c["cand"][placed]], minlength=nb)
              + np.bincount(fb[na0:na], weights=c["sizes"][fi[na0:na]], minlength=nb)
              - np.bincount(c["bo"][given_back], weights=c["sizes"][c["cand"][given_back]],
                            minlength=nb))
    assert np.array_equal(tokens, bt)


def test_the_exchanges_happen_on_these_cases():
    # the equality above is not vacuous
    made = 0
    for seed in range(60):
        _, _, _, _, _, na0, na = _swaps(_case(seed))
        made += na - na0
    assert made > 30
