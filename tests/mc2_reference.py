"""An independent reference of the MC2 dispatch / combine (SPEC-mc2 1.19-1.23), written from
the spec's pseudo-code with plain loops over the whole group (every rank's inputs at once),
never calling the kernels under test. Used by tests/test_moe_distribute.py."""

from __future__ import annotations

import math

import numpy as np


class Group:
    """The group's attributes: W ranks, S shared ranks, E MoE experts, shared experts, specials."""

    def __init__(self, world, experts, shared_ranks=0, shared_num=1, v2=False, special=(0, 0, 0), global_bs=0):
        self.W, self.E, self.S, self.v2 = world, experts, shared_ranks, v2
        self.sn = 0 if shared_ranks == 0 else shared_num  # shared_expert_num'
        self.R = shared_ranks // self.sn if self.sn else 0
        self.L = experts // (world - shared_ranks)
        self.Z, self.C, self.N = special
        self.global_bs = global_bs

    def host(self, g):
        return self.S + g // self.L

    def capacity(self, m, bs, k):
        G = self.global_bs or bs * self.W
        if m >= self.S:
            return G * min(self.L, k)
        if not self.v2:
            return G // self.S
        return (G // self.W) * math.ceil(self.W / self.R)


def active(mask, t, j):
    """Does slot (t, j) take part (1.21 c)?"""
    if mask is None:
        return True
    if mask.ndim == 1:
        return bool(mask[t])
    return bool(mask[t, j])


def token_active(mask, t):
    if mask is None:
        return True
    return bool(mask[t]) if mask.ndim == 1 else bool(mask[t].any())


def quantise_row(v):
    """1.20 (d) for one float32 row: ``(q int8, 1/ds)``."""
    amax = np.float32(0)
    for value in v:
        amax = max(amax, np.float32(abs(value)))
    if amax == 0:
        return np.zeros(len(v), np.int8), np.float32(0)
    ds = np.float32(np.float32(127) / amax)
    q = np.array([np.rint(np.float32(value * ds)) for value in v], np.float32).astype(np.int8)
    return q, np.float32(np.float32(1) / ds)


def moe_onto(group, m, e):
    return (m - group.S) * group.L + e


def shared_rank_of_token(t, r, bs, S):
    """V1 kernel's SendToSharedExpert: ``Ceil((t + 1 + r*BS//S) * S, BS) - 1 - r``."""
    return -(-((t + 1 + r * bs // S) * S) // bs) - 1 - r


def dispatch(group, xs, ids, masks=None, expert_scales=None, quant=False, scales=None, token_type=1):
    """Per rank, the dict of outputs of 1.20 / 1.21."""
    W, S, K = group.W, group.S, ids[0].shape[1]
    masks = masks or [None] * W
    rows_of = [x.shape[0] for x in xs]
    bs_max = max(rows_of)
    actives = [sum(token_active(masks[r], t) for t in range(rows_of[r])) for r in range(W)]

    def payload(r, t, scale_row):
        if not quant:
            return xs[r][t], np.float32(0)
        v = xs[r][t].astype(np.float32)
        if scales is not None:
            v = (v * scales[scale_row]).astype(np.float32)
        return quantise_row(v)

    outs = []
    for m in range(W):
        rows, triples, escales, dyn = [], [], [], []
        if m >= S:
            counts = np.zeros((W, group.L), np.int64)
            for e in range(group.L):
                g = moe_onto(group, m, e)
                for r in range(W):
                    for p in range(rows_of[r] * K):
                        t, j = divmod(p, K)
                        if active(masks[r], t, j) and ids[r][t, j] == g:
                            q, d = payload(r, t, g + (group.sn if group.v2 else int(S > 0)))
                            rows.append(q), dyn.append(d), triples.append((r, t, j))
                            escales.append(0.0 if expert_scales is None else expert_scales[r][t, j])
                            counts[r, e] += 1
            ep_recv = np.cumsum(counts.T.ravel())
            token_nums = counts.sum(axis=0)
        elif not group.v2:
            own = [t for t in range(rows_of[m]) if token_active(masks[m], t)]
            for t in own:
                q, d = payload(m, t, 0)
                rows.append(q), dyn.append(d), triples.append((m, t, K)), escales.append(0.0)
            c = [(i + 1 + m) * len(own) // S - (i + m) * len(own) // S for i in range(S)]
            for r in range(S, W):
                got = 0
                for t in range(actives[r]):
                    if shared_rank_of_token(t, r, actives[r], S) == m:
                        q, d = payload(r, t, 0)
                        rows.append(q), dyn.append(d), triples.append((r, t, K)), escales.append(0.0)
                        got += 1
                c.append(got)
            ep_recv = np.cumsum(c)
            token_nums = np.array([len(rows)])
        else:
            c = []
            for r in range(W):
                got = 0
                if r % group.R == m % group.R:
                    for t in range(rows_of[r]):
                        if token_active(masks[r], t):
                            q, d = payload(r, t, m // group.R)
                            rows.append(q), dyn.append(d), triples.append((r, t, K + m // group.R))
                            escales.append(0.0)
                            got += 1
                c.append(got)
            ep_recv = np.cumsum(c)
            token_nums = np.array([len(rows)])
        A = group.capacity(m, bs_max if group.global_bs else rows_of[m], K)
        H = xs[m].shape[1]
        expand_x = np.zeros((A, H), np.int8 if quant else xs[m].dtype)
        if rows:
            expand_x[: len(rows)] = np.stack(rows)
        pad = lambda values, dtype, size: np.concatenate([np.array(values, dtype), np.zeros(size - len(values), dtype)])  # noqa: E731
        out = {
            "expand_x": expand_x,
            "dynamic_scales": pad(dyn, np.float32, A),
            "expert_token_nums": (np.cumsum(token_nums) if token_type == 0 else token_nums).astype(np.int64),
            "ep_recv_count": ep_recv.astype(np.int32),
            "expand_scales": pad(escales, np.float32, A),
            "n": len(rows),
        }
        if group.v2:
            out["assist_info_for_combine"] = pad([v for tri in triples for v in tri], np.int32, A * 128)
        outs.append(out)
    if not group.v2:  # V1's expand_idx, on the sender
        for r in range(W):
            idx = np.full(rows_of[r] * K, -1, np.int32)
            for p in range(rows_of[r] * K):
                t, j = divmod(p, K)
                if active(masks[r], t, j):
                    idx[p] = sum(
                        1 for q in range(p) if active(masks[r], *divmod(q, K)) and ids[r].flat[q] == ids[r].flat[p]
                    )
            outs[r]["expand_idx"] = idx
    return outs


def combine(group, expand_xs, ids, dispatched, expert_scales, masks=None, shared_x=None, ori_x=None, const=None):
    """Per rank, ``x`` of 1.22 / 1.23 from the dispatch's outputs (``dispatched``) and the
    experts' rows ``expand_xs`` (one per rank, the dispatch's layout)."""
    W, S, K = group.W, group.S, ids[0].shape[1]
    masks = masks or [None] * W
    rows_of = [i.shape[0] for i in ids]
    where = {}  # (owner r, token t, slot) -> (host m, row d)
    for m in range(W):
        if group.v2:
            assist = dispatched[m]["assist_info_for_combine"]
            for d in range(dispatched[m]["n"]):
                where[tuple(int(v) for v in assist[3 * d : 3 * d + 3])] = (m, d)
        elif m >= S:
            ep = dispatched[m]["ep_recv_count"]
            for r in range(W):
                for t in range(rows_of[r]):
                    for j in range(K):
                        g = int(ids[r][t, j])
                        if active(masks[r], t, j) and group.host(g) == m:
                            e = g % group.L
                            end = ep[e * W + r]
                            count = sum(
                                1
                                for p in range(rows_of[r] * K)
                                if active(masks[r], *divmod(p, K)) and ids[r].flat[p] == g
                            )
                            where[(r, t, j)] = (m, end - count + dispatched[r]["expand_idx"][t * K + j])
        else:
            ep = dispatched[m]["ep_recv_count"]
            n_own = sum(token_active(masks[m], t) for t in range(rows_of[m]))
            for t in range(n_own):
                where[(m, t, K)] = (m, t)
            for r in range(S, W):
                act = sum(token_active(masks[r], t) for t in range(rows_of[r]))
                mine = [t for t in range(act) if shared_rank_of_token(t, r, act, S) == m]
                for i, t in enumerate(mine):
                    where[(r, t, K)] = (m, ep[r - 1] + i)
    outs = []
    for r in range(W):
        H = expand_xs[r].shape[1]
        x = np.zeros((rows_of[r], H), expand_xs[r].dtype)
        for t in range(rows_of[r]):
            if not token_active(masks[r], t):
                continue
            acc = np.zeros(H, np.float32)
            for j in range(K):
                if not active(masks[r], t, j):
                    continue
                g, w = int(ids[r][t, j]), np.float32(expert_scales[r][t, j])
                E, Z, C, N = group.E, group.Z, group.C, group.N
                if g < E:
                    m, d = where[(r, t, j)]
                    acc = (acc + (expand_xs[m][d].astype(np.float32) * w).astype(np.float32)).astype(np.float32)
                elif g < E + Z:
                    pass
                elif g < E + Z + C:
                    acc = (acc + ori_x[r][t].astype(np.float32) * w).astype(np.float32)
                elif g < E + Z + C + N:
                    a1, a2, v = const
                    c = g - (E + Z + C)
                    u = ori_x[r][t].astype(np.float32) * np.float32(a1[c])
                    u = (u + v[c].astype(np.float32) * np.float32(a2[c])).astype(np.float32)
                    acc = (acc + u * w).astype(np.float32)
            for i in range(group.sn if group.v2 else int(S > 0)):
                m, d = where[(r, t, K + i)]
                acc = (acc + expand_xs[m][d].astype(np.float32)).astype(np.float32)
            if shared_x is not None:
                acc = (acc + shared_x[r].reshape(rows_of[r], H)[t].astype(np.float32)).astype(np.float32)
            x[t] = acc.astype(x.dtype)
        outs.append(x)
    return outs
