"""Short probes of the multi-head learner (step 8 of :mod:`attnextract.learners.multi_head`).

8. Short probes (``precision="full"``, float64 answers; :meth:`short_probes`):
   the rest of the multi-head paper's count as two-token probes [q + u; q] (lambda = 0), which
   answer g = sum_h c_h sigma(z_h^T q) with z_h = W_h^T u: d fresh rows u with every
   head's height +-|v_h| (well spread, so W_h = U^-1 Z_h amplifies little), their
   columns q designed from the heads so far with the logits on a ladder 5 apart (one
   head on its slope, the others saturated: they pin the heights), |u| = 16 |q|. Each
   row is one weighted fit of H (d + 1) unknowns, so it scales to d = 32, H = 8. A sum
   over 2 tokens rounds to about half a rounding of its terms against about 13 at 512
   tokens: measured median error at d = 8, H = 6 1.1e-12 -> under 1e-14, at d = 32,
   H = 8 5.9e-12 -> about 5e-15 (benchmarks/bench_multi_head.py; the runs are in the git
   history). With biases the probe
   answers g = sum_h c_h sigma(z_h^T q + u^T b_h) (c = f([0]) taken off), so each row
   fit is affine in [q, 1] with H (d + 2) unknowns, the ladder is met with the
   intercepts included, and the expected rounding counts the rounding of the box's
   scores, which the intercepts make large (:func:`.polish.noise_of`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...report import verification_count
from ...verification import safe_rms
from . import design, fit, polish
from .budget import _budget_left
from .constants import (
    SHORT_BALANCE,
    SHORT_INTERCEPTS,
    SHORT_LENGTH,
    SHORT_ROW_CANDIDATES,
    SHORT_SPACING,
)

if TYPE_CHECKING:
    from .state import RunState
else:
    RunState = object     # the run's attributes, a type only (state.py)


class ShortProbeStage(RunState):
    """Stage methods of :class:`_Extraction` (short probes)."""

    def short_probes(self, model, predicted, misfit):
        """Short probes (``precision="full"``, float64 answers): the rest of the multi-head paper's
        count as two-token probes on d fresh rows, designed from the row fits' heads.

        Identity. A probe [q + u; q] has lambda = 0 and answers
        g = sum_h c_h sigma(z_h^T q), c_h = u^T v_h, z_h = W_h^T u, so every row u is an
        independent block of H (d + 1) unknowns (8448 parameters at d = 32, H = 8 are
        32 blocks of 264), fitted by Gauss-Newton from the heads as they stand (their
        1e-10 places any probe). W_h = U^-1 Z_h, v_h = U^-1 C_h.

        Design. Why short: a sum over 2 tokens rounds to about 0.5 roundings of its
        terms (measured: residuals 0.3 to 0.4 of the polish's law 0.25 N^0.75 + 1 = 1.4)
        against about 13 at N = 512 and 50 to 100 at N = 2048, so one short probe carries
        the information of hundreds of the window's. No lambda: the columns q move the
        steps. Column q of row u puts the logits z_h^T q on a ladder SHORT_SPACING apart
        (random order and shift, :func:`.design.short_columns`): about one head sits on
        its slope, the others saturate, and the saturated heads pin the heights (logits
        within +-2 leave c_h and the scale of z_h nearly degenerate, sigma being nearly
        linear there: 1e-12 against 1.3e-14 at d = 8, H = 6). The rows need not place
        steps, so they are chosen for the fit: every head with height +-|v_h| in every
        row (a row where a head has almost none pins its z_h badly), the rows spread
        (:func:`.design.even_height_rows`; the main rows' cond(U) of 20 to 80 amplified
        their 1e-14 to 4e-13). u is scaled by a and q by 1 / a (the logits stay) so that
        |u| is SHORT_BALANCE times |q|: the heights, which carry the sensitivity to W_h,
        grow with |u|, the rounding with |u| and |q|.

        The heads from these rows replace the row fits' only when their predicted error
        is lower and every row's residual stays within ``misfit``; the wide columns do
        not run after them. Skipped for rounded answers (their rounding does not
        shrink with the length) and when fewer than :meth:`.Budget.short_need` are left
        per row (SHORT_OVERSAMPLE x the bias-free row's unknowns, with biases H + 1
        more: a biased run sends them when the bias-free run would).

        Biases. The probe answers g = sum_h c_h sigma(z_h^T q + u^T b_h): each row fit
        is affine in [q, 1] (z_h = [W_h^T u; u^T b_h], H (d + 2) unknowns), b_h = U^-1 of
        the intercepts. The scale a (u a, q / a) keeps z_h^T q but multiplies u^T b_h,
        so the columns are designed for the scaled rows, the ladder met with
        a u^T b_h included. Those intercepts make the box's scores large (hundreds at
        |b_h| = 5), so the expected rounding includes the scores' rounding.

        Returns (model, predicted error, whether kept)."""
        d, H = self.d, model.heads
        if self.precision_name != "float64" or self.decimals is not None:
            self.details["short probes"] = "skipped (rounded answers)"
            return model, predicted, False
        verify = verification_count(self.parameters(H))
        room = min(self.count_cap(self.max_heads) - self.spent() - verify,
                   _budget_left(self.oracle) - verify)
        per_row = int(max(room, 0) // d)
        unknowns, need = H * (d + 1 + self.biases), self.short_need(H)
        if per_row < need or not self.affordable(d * per_row, H):
            self.details["short probes"] = (
                f"skipped ({per_row} per row left in {self.count_name()}, {unknowns} "
                f"unknowns per row" + (f", {need:g} needed)" if self.biases else ")"))
            return model, predicted, False
        self.say("short probes")
        W, V = model.W, model.v.T                                            # V (d, H)
        # every head with a height of the same size in every row (a row where head h
        # has almost none pins its z_h badly), rows as far from each other as the
        # draws allow
        U = design.even_height_rows(V, self.rng, SHORT_ROW_CANDIDATES)
        U /= np.linalg.norm(U, axis=1, keepdims=True)
        self.details["short rows condition"] = float(np.linalg.cond(U))
        Z = np.einsum("kd,hde->khe", U, W)                                 # (d, H, d)
        columns = np.array([design.short_columns(Z[k], SHORT_SPACING, per_row, self.rng)
                            for k in range(d)])                              # (d, n, d)
        # |u| = SHORT_BALANCE |q| in the median (u a, q / a leave every logit)
        a = np.sqrt(SHORT_BALANCE * np.median(np.linalg.norm(columns, axis=2), axis=1))
        if self.biases:
            # ... but not the intercepts u^T b_h, which grow with a: the columns are
            # designed again for the scaled rows, the ladder met with a u^T b_h included.
            # Columns that cancel intercepts beyond the ladder share a common offset
            # larger than their spread, nearly collinear with the constant column of
            # [q, 1]: a shrinks until the intercepts stay within SHORT_INTERCEPTS of the
            # ladder's half span
            half_span = 0.5 * SHORT_SPACING * max(H - 1, 1)
            reach = a * np.max(np.abs(U @ model.b.T), axis=1)
            a = a * np.minimum(1.0, SHORT_INTERCEPTS * half_span / np.maximum(reach, 1e-300))
            B = a[:, None] * (U @ model.b.T)                                 # (d, H)
            columns = np.array([design.short_columns(Z[k], SHORT_SPACING, per_row, self.rng,
                                                     shift=B[k]) for k in range(d)])
        U, columns = U * a[:, None], columns / a[:, None, None]
        before = self.oracle.queries
        lam_s, g_s = self.measure(np.repeat(U, per_row, 0), columns.reshape(-1, d),
                                  np.zeros(d * per_row), length=SHORT_LENGTH)
        self.spend("short probes", before)
        lam_s, g_s = lam_s.reshape(d, per_row, 1), g_s.reshape(d, per_row, 1)
        rows, floors, worst = [], [], 0.0
        for k in range(d):
            samples = polish.Samples(np.broadcast_to(U[k], columns[k].shape), columns[k],
                                     np.zeros(per_row), np.zeros(per_row),
                                     np.full(per_row, float(SHORT_LENGTH)))
            noise = polish.noise_of(samples, model.v, self.precision, 0.0,
                                    *((self.c, model.W, model.b) if self.biases
                                      else (None, model.W)))
            reference = float(np.median(noise))
            # with biases z_h = [W_h^T u; u^T b_h] on the columns [q, 1]
            z0 = np.hstack([Z[k] * a[k], B[k][:, None]]) if self.biases else Z[k] * a[k]
            rows.append(fit.fit_row(lam_s[k], g_s[k], (reference / noise)[:, None],
                                    self.affine(columns[k]), U[k] @ V, z0))
            floors.append(reference)
            worst = max(worst, safe_rms(rows[-1].residual) / reference)
        # rows of different scales: each row's residual in units of its own expected
        # rounding (the floor: the polish's law, a residual below it is luck)
        rows = [fit.RowFit(c=r.c, z=r.z, c_std=r.c_std * f, z_std=r.z_std * f,
                           residual=r.residual / f, jacobian_singular_values=r.jacobian_singular_values)
                for r, f in zip(rows, floors)]
        new_model, new_predicted, _, _ = self.assemble(U, rows, 1.0)
        self.details["predicted relative error (before short probes)"] = predicted
        if not (new_predicted < predicted and worst <= misfit):
            self.details["short probes"] = (
                f"{d * per_row} sent, not kept (predicted {new_predicted:.1e}, residual "
                f"{worst:.1e} x the expected rounding)")
            return model, predicted, False
        self.details["short probes"] = (f"{d * per_row} sent ({per_row} per row, residual "
                                        f"{worst:.2f} x the expected rounding), kept")
        return new_model, new_predicted, True
