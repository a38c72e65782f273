"""The invariants a stored hybrid DP x CP plan must hold before anyone trains from it, checked
with clear errors (never ``assert``, which ``python -O`` removes): the same rules the planner
guarantees (:func:`packing.hybrid_cp.check_plan`), against the manifest and, when the job's
lengths are known, against every sample's tokens."""
from __future__ import annotations

from typing import Optional

import numpy as np

from packing.hybrid_cp import HybridPlan


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _structure(p: HybridPlan, summ: dict) -> Optional[str]:
    """What is wrong with the CSR structure and the groups, or None."""
    have = {"steps": p.step_rounds.shape[0] - 1, "rounds": p.round_groups.shape[0] - 1,
            "groups": p.group_size.shape[0], "entries": p.entry_item.shape[0],
            "items": p.item_doc.shape[0]}
    for k, v in have.items():
        if summ[k] != v:
            return f"manifest summary.{k} {summ[k]} but the arrays hold {v}"
    P, G, E, n_items = p.n_ranks, have["groups"], have["entries"], have["items"]
    sr, rg, ge = p.step_rounds, p.round_groups, p.group_entries
    if sr.shape[0] < 1 or sr[0] != 0 or sr[-1] != have["rounds"] or (np.diff(sr) < 1).any():
        return "step_rounds does not cut the rounds into non-empty steps"
    if rg.shape[0] < 1 or rg[0] != 0 or rg[-1] != G or (np.diff(rg) < 1).any():
        return "round_groups does not cut the groups into non-empty rounds"
    if ge.shape[0] != G + 1 or ge[0] != 0 or ge[-1] != E or (np.diff(ge) < 0).any():
        return "group_entries does not span the entries"
    if any(x.shape[0] != n_items for x in (p.item_start, p.item_length)) or \
            p.entry_owner.shape[0] != E:
        return "item or entry arrays differ in length"
    off, size = p.group_offset, p.group_size
    if G and ((size < 1) | (size & (size - 1) != 0) | (off % np.maximum(size, 1) != 0)).any():
        g = _first((size < 1) | (size & (size - 1) != 0) | (off % np.maximum(size, 1) != 0))
        return f"group {g} (ranks {int(off[g])}+{int(size[g])}) is not an aligned power of two"
    if G:
        first = np.zeros(G, bool)
        first[rg[:-1]] = True
        last = np.zeros(G, bool)
        last[rg[1:] - 1] = True
        end = off + size
        # every round starts at rank 0, each group starts where the one before it ends, the
        # round's last group ends at the pool's last rank
        bad = (first & (off != 0)) | (last & (end != P))
        bad[1:] |= ~first[1:] & (off[1:] != end[:-1])
        if bad.any():
            g = _first(bad)
            return f"the groups of a round do not tile the pool of {P} ranks (group {g})"
    ei = p.entry_item
    if E != n_items or ((ei < 0) | (ei >= n_items)).any() or \
            (np.bincount(ei, minlength=n_items) != 1).any():
        return "entry_item does not hold every item exactly once"
    gsz = np.repeat(size, np.diff(ge))
    own = p.entry_owner
    if ((own < -1) | (own >= gsz)).any():
        k = _first((own < -1) | (own >= gsz))
        return f"entry {k}: owner {int(own[k])} is outside its group of {int(gsz[k])} ranks"
    return None


def _rank_tokens(p: HybridPlan, per_document: bool = False) -> np.ndarray:
    """int64[R, P]: tokens every rank holds in every round (zigzag shards padded to 2 x g);
    ``per_document``: the most any one document puts on the rank instead of the sum."""
    E = p.entry_item.shape[0]
    g_of = np.repeat(np.arange(p.group_size.shape[0]), np.diff(p.group_entries))
    rnd = np.repeat(np.arange(p.round_groups.shape[0] - 1), np.diff(p.round_groups))[g_of]
    gsz, first = p.group_size[g_of], p.group_offset[g_of]
    L = p.item_length[p.entry_item]
    sh = (p.entry_owner < 0) & (gsz > 1)
    per = np.where(sh, -(-L // (2 * gsz)) * 2, L)
    out = np.zeros((p.round_groups.shape[0] - 1, p.n_ranks), np.int64)
    if per_document:
        # every member of a group holds (a share of) each of its documents in turn
        np.maximum.at(out, (rnd, first + np.maximum(p.entry_owner, 0) * ~sh), per)
        grp = np.zeros(p.group_size.shape[0], np.int64)
        np.maximum.at(grp, g_of, per)
        g_rnd = np.repeat(np.arange(out.shape[0]), np.diff(p.round_groups))
        for g in np.flatnonzero(p.group_size > 1):
            sl = slice(p.group_offset[g], p.group_offset[g] + p.group_size[g])
            out[g_rnd[g], sl] = np.maximum(out[g_rnd[g], sl], grp[g])
        return out
    whole = ~sh
    np.add.at(out, (rnd[whole], first[whole] + np.maximum(p.entry_owner[whole], 0)), per[whole])
    # a sharded entry adds its shard to every member: a difference array over the rank axis
    if sh.any() and E:
        diff = np.zeros((out.shape[0], p.n_ranks + 1), np.int64)
        np.add.at(diff, (rnd[sh], first[sh]), per[sh])
        np.add.at(diff, (rnd[sh], first[sh] + gsz[sh]), -per[sh])
        out += np.cumsum(diff, axis=1)[:, :-1]
    return out


def _coverage(p: HybridPlan, n: int, lengths: Optional[np.ndarray]) -> Optional[str]:
    doc, start, L = p.item_doc, p.item_start, p.item_length
    bad = (doc < 0) | (doc >= n) | (start < 0) | (L <= 0)
    if bad.any():
        k = _first(bad)
        return (f"item {k} (sample {int(doc[k])} start {int(start[k])} length {int(L[k])}) is "
                f"out of range (samples 0..{n - 1})")
    seen = np.bincount(doc, minlength=n)
    if n and (seen == 0).any():
        return (f"{int((seen == 0).sum())} samples of the dataset's {n} are not in the plan "
                f"(first: sample {_first(seen == 0)}); nothing may be lost")
    if lengths is None:
        return None
    order = np.lexsort((start, doc))
    d, s, ln = doc[order], start[order], L[order]
    # where each piece must start: 0, or where the sample's previous piece ended
    want = np.where(np.r_[True, d[1:] != d[:-1]], 0, np.r_[0, (s + ln)[:-1]])
    nxt = s == want
    if not nxt.all():
        k = order[_first(~nxt)]
        return (f"sample {int(doc[k])}: its pieces do not tile it (item {int(k)} starts at "
                f"{int(start[k])}); every token must be trained exactly once")
    tot = np.bincount(doc, weights=L, minlength=n).astype(np.int64)
    if not np.array_equal(tot, lengths):
        k = _first(tot != lengths)
        return (f"sample {k}: the plan holds {int(tot[k])} of its tokens, the dataset has "
                f"{int(lengths[k])}")
    return None


def check_stored_hybrid(p: HybridPlan, manifest: dict, summ: dict, epoch: int,
                        lengths: Optional[np.ndarray]) -> None:
    """Raise ValueError naming the first broken invariant of a stored hybrid plan epoch."""
    lay = manifest["layout"]
    P, rc = int(lay["dp"]) * int(lay["cp"]), int(lay["rank_capacity"])
    bad = None
    if p.n_ranks != P or p.rank_capacity != rc:
        bad = (f"summary n_ranks {p.n_ranks} / rank_capacity {p.rank_capacity}, the layout "
               f"has {P} / {rc}")
    bad = bad or _structure(p, summ)
    if bad is None and int(p.item_length.sum()) != summ["tokens"]:
        bad = f"manifest summary.tokens {summ['tokens']} but the items hold " \
              f"{int(p.item_length.sum())}"
    n = int(manifest["dataset"]["n_samples"])
    if lengths is not None and np.asarray(lengths).shape[0] != n:
        raise ValueError(f"the job has {np.asarray(lengths).shape[0]} samples, the plan "
                         f"{n}")
    bad = bad or _coverage(p, n, None if lengths is None else np.asarray(lengths, np.int64))
    if bad is None and p.round_groups.shape[0] > 1:
        # Megatron's rule runs every document of a group as its own forward/backward, so its
        # memory bound is per document (balancer.planning.hybrid.plan_megatron_hybrid)
        tok = _rank_tokens(p, per_document=manifest["strategy"] == "megatron_hybrid")
        if tok.max() > rc:
            r, q = np.unravel_index(int(tok.argmax()), tok.shape)
            bad = (f"rank {int(q)} holds {int(tok.max())} tokens in round {int(r)}, over the "
                   f"rank capacity {rc}")
    if bad:
        raise ValueError(f"hybrid plan epoch {epoch} is inconsistent: {bad}")


__all__ = ["check_stored_hybrid"]
