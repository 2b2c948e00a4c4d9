"""Tuning constants of the multi-head learner, each with the measurement behind it."""

MAX_HEADS = 12            # largest H searched when no bound is given
COUNT_FIRST = 8           # ... searched first (the base window for 8 heads is 16x shorter)
MORE_STEPS_VOTES = 3      # rows none of whose fits reach the noise that end the search
BELOW_TOLD_VOTES = 3      # told H, rows that must agree on a count below H (two may hide
                          # the same head: a small height there, a step near another's)
WINDOW_MARGIN = 4.0       # a base row with a step farther beyond the window does not vote
COUNT_MARGIN = 1          # not told H, a count k is read from a scan that could show k + 1
                          # steps (4 (k + 1) + 8 samples): a told run knows no more exist
                          # (tanh and sine of a 2-head box at d = 6, outside the class:
                          # rows fitted 4 to 6 steps to the noise on 4k + 8 samples and 2 of
                          # 12 runs reached the main rows before their refusal; 1 of 12
                          # with the margin, 0 of 12 with 40-sample scans)
UNRESOLVED_HEIGHT = 3.0   # not told H, a row's step whose height is within this many of its
                          # standard deviations is tried away (:func:`_fewest_steps`)
COUNT_EXTRA_SCANS = 4     # base rows scanned beyond the multi-head paper's share when no two agree (no H)
MAX_DESIGNS = 4           # designs (base row, perturbations, main rows) tried at most
BASE_ERROR_CORRECTED = 1.0  # a base estimate predicted this far off (relative) says nothing
                            # of W_h q_0: a fresh design where the count leaves room for it
                            # (main rows corrected estimates 0.01 to 0.3 off; d = H = 8 seed 0
                            # under OpenBLAS Haswell, 1.4 off, spent 1900 of 2033 on main rows
                            # that could not label their steps, and was refused)
BASE_CANDIDATES = 10      # candidate base rows at most; the search stops at a well-conditioned one
BASE_QUALITY = 1e-7       # a base row whose logit error / smallest gap is below this
                          # ends the search (the perturbations' error scales with it)
                          # is in the right basin (a missing head misses by far more)
SCALE_ROUNDS = 4          # base scans to bring the steps into the window
ERROR_BAR_FACTOR = 4.0    # error bar = this times the predicted rms relative error
SINGLE_TOKEN_MISFIT = 1e-3   # a refusal's single tokens (:meth:`single_token_misfit`) missing
                             # x^T v by more (relative) show a box outside the class
F32_MISFIT = (1e-3, 30.0)   # base rows missing float64 answers by this many times the noise of
                            # a float32 pass name --output-dtype float32 (:meth:`.base_row.
                            # BaseRowStage.base_row`): float32 nn.MultiheadAttention read out
                            # in float64 missed by 0.0033 to 15 (32 refusals, d = 8 and 16,
                            # H = 2 and 4; 30 = NOISE_FACTOR, what a float32 fit may leave)
NOISE_FACTOR = 30.0       # a residual this far above the output precision is a misfit
DEFAULT_TOLERANCE = 1e-6  # largest error bar accepted (float64 outputs; rounded: ROUNDED_TOLERANCE)
ROUNDED_TOLERANCE = 1.6e5 # ... in units of the output rounding (9.5e-3 for float32): a float32
                          # forward pass at d = 16 gives bars up to 1e-3 at H = 2 and 6.2e-3 at
                          # H = 4 (nn.MultiheadAttention; errors at most 0.64 x the bar)
ROUNDED_BAR_OFFERED = 5e-2  # rounded answers: a refusal whose bar is above the tolerance
                          # and at most this names max_error_bar (float32
                          # nn.MultiheadAttention, d = 8, H = 4: bars 1.5e-2 and 2.6e-2,
                          # errors 3.0e-3 and 5.7e-3 with the option; the held-out check
                          # allows 10x the bar, so larger bars are not offered)
COARSEST_SHARE = 0.05     # largest NOISE_FACTOR x base-scan rounding / answer accepted
                          # (float32: 3.4e-5; float16: 0.28 and bfloat16: 2.2 are refused)
EXTRA_COLUMNS = 1         # columns beyond the d that determine each z_h (0 or 1)
COLUMN_MOVE = 0.08        # column step s = this x gap x sqrt(d) / |u_k| |W_h q_0|: moves
                          # measured at 0.18 of the gap (median), 0.33 at most over 40
                          # runs at d = 16 (|W_h^T u_k| is not known before round 2)
COLUMN_SPARES = 1         # samples per column probe beyond its H steps (they pin heights)
REFINE_ABOVE = 2.5e-11    # predicted error above which round 3 (wide columns) runs: an
                          # error bar (4x) above 1e-10
WIDE_ROUNDS = 3           # wide-column rounds at most (after the first, only while the
                          # predicted error exceeds REFINE_ABOVE and the count has room)
WIDE_COLUMNS_UP_TO = 1e-2 # ... and below which the logits are predicted well enough for it
                          # (|t| <= 7: 0.07 off against a step spacing above 1.4; float32
                          # nn.MultiheadAttention at H = 4 predicts 1e-3 to 3e-3 before it)
WIDE_COLUMNS_UP_TO_COARSE = 5e-2  # ... for coarse answers, whose rows pin less before them
                          # (|t| <= 7: 0.35 off, a sixth of the spacing 2.4 at H = 4 and
                          # less at fewer heads: the columns' samples stay on the steps'
                          # slopes; float32 nn.MultiheadAttention at H = 4 predicts 1e-2 to
                          # 3.4e-2 in a few percent of boxes, refused for bars of 1.4e-2 to
                          # 5.9e-2 without wide columns)
COARSE_ROUNDING = 2.0 ** -30  # relative rounding from which answers count as coarse
                          # (float32, a few decimals): base rows are scaled one by one
PINNED_STEPS = 0.1         # coarse answers: a base row whose logit error is below this x its
                          # smallest step gap has as many heads as fitted steps at least
SHORT_LENGTH = 2          # tokens of the short probes ([q + u; q], lambda = 0)
SHORT_SPACING = 5.0       # ... whose columns put the heads' logits this far apart: about one
                          # head per column on its slope, the others saturated (they pin
                          # the heights); d = 8, H = 6, 3 seeds, rows alone: spacing 3
                          # 3.8e-14, 4 1.9e-14, 5 1.3e-14, 6 1.2e-14, 8 2.0e-14 (median)
SHORT_BALANCE = 16.0      # ... |u| / |q| (u a, q / a leave every logit): the sensitivity to W
                          # grows with |u| (heights c_h), the rounding with |u| and |q|;
                          # d = 8, H = 6, 4 seeds, rows alone: 1 1.5e-14, 4 1.1e-14,
                          # 16 8.8e-15, 64 9.6e-15, 1024 9.5e-15 (median)
SHORT_OVERSAMPLE = 1.25   # ... at least this x each row's H (d + 1) unknowns (else skipped)
SHORT_INTERCEPTS = 0.5    # ... with biases, the intercepts a u^T b_h at most this x the
                          # ladder's half span (a shrinks)
SHORT_ROW_CANDIDATES = 64 # draws per short row (:func:`.design.even_height_rows`)
PERTURBATION_MOVE = 0.003 # base perturbations move the steps by about this x the smallest
                          # gap (labels kept; the estimate's error scales with 1 / this)
PERTURBATION_NOISE_MOVES = 30.0  # ... or this x the base row's largest logit error,
PERTURBATION_MAX_MOVE = 0.25     # ... at most this x the smallest gap
DESIGNED_SCANS = 5         # scans of designed columns of the base row at most (each
                           # 3H + 1 queries, within the count): where 9 nudges of a fifth
                           # of a 0.003 gap cannot pin the pair's separation the scans
                           # missed it by 0.7 to 6 (d = H = 8); 3 scans left that row
                           # crowded in 7 of 13 design draws
RANDOM_COLUMNS = 1         # nudged columns beyond H scanned (with q_0, H + 1 + this; with
                           # none, d = 16, H = 10, s = 3: seed 16 refused, seed 10 crowded)
PILOT_COLUMNS = 2          # with biases: nudged columns scanned first, their moves size the
                           # other nudges (:meth:`.base_row.BaseRowStage.designed_column`)
CROWDED_GAP = 0.5          # a base row whose smallest step gap is below this x the evenly
                           # spaced gap moves to a designed column
COLUMN_SPREAD = 2.0        # spread columns (nudges missed): outermost step this many deviations out
COLUMN_NUDGE = 0.2         # nudged columns move the steps by about this x the smallest gap
                           # (a pair's relative move about 0.3 of its gap: labels kept)
COARSE_ROW_DRAWS = 32      # coarse answers: main row designs drawn, the best conditioned
                          # measured (:func:`.design.best_conditioned_rows`)
ILL_ROW_FACTOR = 30.0     # a main row whose parameters are pinned this much worse than the
                          # median row's is redesigned
LABEL_MISFIT = 100.0      # chi^2 per entry of the base rows' predictions (1 expected)
                          # below which the main rows' labels are confirmed
MISPLACED_GAP = 0.5       # a main row whose smallest measured gap is below this x the
                          # designed spacing is redesigned (labels confirmed)
MISPLACED_SHARE = 0.25    # coarse answers: more misplaced main rows than this share of d
                          # end the design (a fresh one is drawn while the count allows)
ROW_REDESIGNS = 3         # rounds of redesigning the main rows whose first probe misfits
BIASED_COUNT_BOUND = 1.1  # the biased count at most this x (the multi-head paper's count + H d)
PRECISIONS = ("full", "fast")  # extract_multi_head's precision= choices
DTYPE_PRECISION = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "bfloat16": 2.0 ** -8,
                   "float16": 2.0 ** -11}   # relative rounding of each output dtype
