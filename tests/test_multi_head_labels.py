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


@pytest.mark.parametrize("seed", range(3))
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


@pytest.mark.parametrize("seed", range(2))
def test_right_labels_are_kept(seed):
    U, T, C, row_std, base = measurements(8, 8, seed)
    out = relabel_rows(U, T, C, row_std, row_std, *base)
    assert np.array_equal(out.order, np.tile(np.arange(8), (8, 1)))
    assert out.rows_changed == 0 and out.misfit_after == out.misfit_before < 10


# ---------------------------------------------------------------------------
# in the learner
# ---------------------------------------------------------------------------

from attnextract import Oracle                                          # noqa: E402
from attnextract.adapters.targets import random_multi_head              # noqa: E402
from attnextract.errors import RecoveryFailedError                      # noqa: E402
from attnextract.learners.multi_head import (canonical_error, extract_multi_head,  # noqa: E402
                                             paper2_count)


def swapping_main_row_fits(monkeypatch, rows_to_swap):
    """Give the first steps of the main rows' round-1 fits to the wrong head (the design's
    labels off by a gap, as a rough base estimate leaves them), in ``rows_to_swap`` of the
    main rows fitted (counted from the first)."""
    from attnextract.learners.multi_head import fit as fit_module
    import attnextract.learners.multi_head as learner
    real, calls = fit_module.fit_steps_from, []
    in_main = {"on": False}
    real_main = learner._Extraction.main

    def main(self, Y0, V0):
        in_main["on"] = True
        return real_main(self, Y0, V0)

    def swapped(*args, **kwargs):
        steps, started = real(*args, **kwargs)
        if in_main["on"]:
            calls.append(1)
            if len(calls) - 1 in rows_to_swap:
                order = np.arange(steps.t.size)
                order[[0, 1]] = order[[1, 0]]
                steps = fit_module.StepFit(t=steps.t[order], c=steps.c[order], rms=steps.rms,
                                           t_std=steps.t_std[order], c_std=steps.c_std[order])
                started = True
        return steps, started

    monkeypatch.setattr(learner._Extraction, "main", main)
    monkeypatch.setattr(fit_module, "fit_steps_from", swapped)


def test_a_wrong_labelling_is_relabelled_not_refused(monkeypatch):
    """Two main rows with two heads' steps swapped: every row still fits to the noise,
    and without the check the heads would mix (held-out error O(1), blamed on the box
    before). The base rows' measurements relabel them, and the model is right."""
    swapping_main_row_fits(monkeypatch, {1, 4})
    d, H = 8, 3
    M = random_multi_head(H, d, seed=52)
    oracle = Oracle(M, d)
    result = extract_multi_head(oracle, heads=H, seed=2)
    det = result.report.details
    assert det["main rows relabelled"] == 2
    assert det["label misfit (before, after)"][1] < 100
    assert canonical_error(result.model, M) <= min(det["error bar"], 1e-10)
    assert result.queries <= paper2_count(H, d)


def test_labels_the_base_rows_do_not_confirm_are_the_learners_failure(monkeypatch):
    """When the relabelling cannot make the main rows agree with the base rows (here it
    is made to return the swapped labels with a large misfit), the held-out mismatch is
    the learner's own failure: a RecoveryFailedError that does not say the box is not
    multi-head attention, reporting the H asked, its floor and paper 2's count, within
    that count."""
    from attnextract.learners.multi_head import labels as labels_module
    swapping_main_row_fits(monkeypatch, set(range(0, 200, 3)))

    def unresolved(U, T, *rest):
        d, H = T.shape
        return labels_module.Relabelled(np.tile(np.arange(H), (d, 1)), 1e6, 1e6, 0)

    monkeypatch.setattr(labels_module, "relabel_rows", unresolved)
    d, H = 8, 3
    oracle = Oracle(random_multi_head(H, d, seed=52), d)
    with pytest.raises(RecoveryFailedError) as info:
        extract_multi_head(oracle, heads=H, seed=2)
    message = str(info.value)
    assert "not judged" in message and "labels disagree with the base rows" in message
    assert "is not multi-head attention" not in message
    det = info.value.result.report.details
    assert det["heads asked"] == H
    assert det["floor H(d^2 + d)"] == H * (d * d + d)
    assert det["multi-head paper's count"] == paper2_count(H, d)
    assert oracle.queries <= paper2_count(H, d)


@pytest.mark.slow            # about 5 s unloaded
def test_journal_checks_count_within_paper2(tmp_path):
    """d = 8, H = 8 (the grid's box s = 1, seed 14, close to paper 2's 2033 without a
    journal): with a journal its binding queries (the fingerprint) are counted apart,
    never taken from the learner's plan: the learner sends the same queries, within
    paper 2's count, and returns the same model."""
    from attnextract.adapters.journal import QueryJournal
    d = H = 8
    box = random_multi_head(H, d, seed=10_000 * H + 100 * d + 14, w_scale=1 / np.sqrt(d))
    plain = Oracle(box, d)
    alone = extract_multi_head(plain, heads=H, seed=1638871557)
    with QueryJournal(str(tmp_path / "j.sqlite")) as journal:
        oracle = Oracle(box, d, journal=journal)
        result = extract_multi_head(oracle, heads=H, seed=1638871557)
    assert oracle.check_queries > 0
    assert oracle.queries == plain.queries <= paper2_count(H, d)
    assert np.array_equal(result.model.W, alone.model.W)
    assert canonical_error(result.model, box) <= result.report.details["error bar"]


def test_a_refused_models_held_out_error_is_not_scaled_by_its_bar(monkeypatch):
    """A refusal's report gives the model's true held-out error: a refused model (here
    the row fits' heads doubled, with a predicted error of 200, as a wrong basin gives)
    is checked without its own (untrusted) bar; with it, the check scaled the error it
    reports by tolerance / bar (a model wrong by 36 showed 2.7e-12)."""
    import attnextract.learners.multi_head as learner
    from attnextract.models import MultiHeadAttention
    real = learner._Extraction.assemble

    def wrong(self, U, rows, noise_floor):
        model, predicted, sigma, measured = real(self, U, rows, noise_floor)
        return MultiHeadAttention(2 * model.W, model.v), 200.0, sigma, measured

    monkeypatch.setattr(learner._Extraction, "assemble", wrong)
    # (the joint polish, whose bar the prediction sets, would mend the doubled heads)
    monkeypatch.setattr(learner._Extraction, "polished", lambda self, model, p: (model, p))
    d, H = 8, 2
    oracle = Oracle(random_multi_head(H, d, seed=8), d)
    with pytest.raises(RecoveryFailedError) as info:
        extract_multi_head(oracle, heads=H, seed=1)
    det = info.value.result.report.details
    assert det["error bar"] >= 800
    assert det["held-out error"] > 1e-2
    assert oracle.queries <= paper2_count(H, d)
