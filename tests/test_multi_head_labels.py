"""The main rows' labels checked against the base rows (learners/multi_head/labels.py).

Synthetic measurements with known heads: the base row u_0 and its perturbations pin
the heads' positions and heights to their fits' deviations; main rows measured to
1e-10 with some of their steps given to the wrong head (as a rough base estimate's
design does) are relabelled to the truth, and correct labels are left alone.
"""

import numpy as np
import pytest

from attnextract.learners.multi_head.labels import relabel_rows


def measurements(d, H, seed, rough=3e-2):
    """U (d, d), true T, C (d, H) of the main rows, and the base rows (P, T_ref, C_ref,
    T_std, C_std) with perturbations eps = 1e-3 around u_0 (their differences pin the
    heads only to ``rough`` relative, as a crowded base row's do)."""
    rng = np.random.default_rng(seed)
    Y, V = rng.standard_normal((d, H)), rng.standard_normal((d, H))
    U = rng.standard_normal((d, d))
    u_0 = rng.standard_normal(d)
    eps = 1e-3
    P = np.vstack([u_0, u_0 + eps * rng.standard_normal((d - 1, d))])
    std_ref = np.full((d, H), rough * eps)
    std_ref[0] = 1e-7
    T_ref = P @ Y + std_ref * rng.standard_normal((d, H))
    C_ref = P @ V + std_ref * rng.standard_normal((d, H))
    row_std = np.full(d, 1e-10)
    T = U @ Y + row_std[:, None] * rng.standard_normal((d, H))
    C = U @ V + row_std[:, None] * rng.standard_normal((d, H))
    return U, T, C, row_std, (P, T_ref, C_ref, std_ref, std_ref)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("d, H", [(8, 8), (16, 8), (8, 3)])
def test_swapped_steps_in_some_rows_are_relabelled(d, H, seed):
    U, T, C, row_std, base = measurements(d, H, seed)
    rng = np.random.default_rng(100 + seed)
    wrong = rng.choice(d, size=min(3, d // 2), replace=False)
    given_T, given_C = T.copy(), C.copy()
    for k in wrong:                              # one or two pairs swapped per wrong row
        order = np.arange(H)
        pairs = rng.permutation(H)[:4 if H >= 4 and k % 2 else 2].reshape(-1, 2)
        for a, b in pairs:                       # disjoint pairs: each swap stays
            order[[a, b]] = order[[b, a]]
        given_T[k], given_C[k] = T[k, order], C[k, order]
    out = relabel_rows(U, given_T, given_C, row_std, row_std, *base)
    assert out.misfit_before > 1e4
    assert np.array_equal(np.take_along_axis(given_T, out.order, axis=1), T)
    assert np.array_equal(np.take_along_axis(given_C, out.order, axis=1), C)
    assert out.misfit_after < 10 and out.rows_changed == wrong.size


@pytest.mark.parametrize("seed", range(4))
def test_right_labels_are_kept(seed):
    U, T, C, row_std, base = measurements(8, 8, seed)
    out = relabel_rows(U, T, C, row_std, row_std, *base)
    assert np.array_equal(out.order, np.tile(np.arange(8), (8, 1)))
    assert out.rows_changed == 0 and out.misfit_after == out.misfit_before < 10
