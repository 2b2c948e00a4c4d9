"""Known orthogonal head subspaces (the single-head paper): the single-head learner inside each.

Inside S_h every other head scores 0 (uniform attention) and reads 0 (v_g is
orthogonal to S_h), so the single-head learner runs per head through a restricted
view of the oracle: tokens y in R^r are sent as B y.
"""

from __future__ import annotations

import time

import numpy as np

from ...errors import InputError, ModelMismatchError, NotIdentifiableError
from ...models import MultiHeadAttention
from ...oracle import Oracle, QueryAccess
from ...report import ExtractionResult, Report, checked_result, verification_count, verify_model
from ..single_head import extract_single_head


def subspace_bases(subspaces, d: int) -> list[np.ndarray]:
    bases = []
    for i, s in enumerate(subspaces):
        arr = np.asarray(s)
        if arr.ndim == 1 and arr.size and np.issubdtype(arr.dtype, np.integer):
            if np.any(arr < 0) or np.any(arr >= d) or len(set(arr.tolist())) != arr.size:
                raise InputError(f"subspace {i}: coordinate indices must be distinct in 0..{d - 1}")
            basis = np.eye(d)[:, arr]
        else:
            basis = np.asarray(s, dtype=np.float64)
            if basis.ndim != 2 or basis.shape[0] != d or basis.shape[1] < 1:
                raise InputError(f"subspace {i}: expected a basis (d={d}, r) or coordinate "
                                 f"indices, got shape {np.shape(s)}")
            if not np.all(np.isfinite(basis)):
                raise InputError(f"subspace {i}: basis is not finite")
            q, r = np.linalg.qr(basis)
            if np.min(np.abs(np.diag(r))) <= 1e-12 * np.max(np.abs(np.diag(r))):
                raise InputError(f"subspace {i}: basis columns are linearly dependent")
            basis = q
        bases.append(basis)
    for i in range(len(bases)):
        for j in range(i):
            overlap = np.linalg.norm(bases[i].T @ bases[j])
            if overlap > 1e-9:
                raise InputError(f"subspaces {j} and {i} are not orthogonal "
                                 f"(|B_{j}^T B_{i}| = {overlap:.2e})")
    if sum(b.shape[1] for b in bases) > d:
        raise InputError("the subspaces' dimensions add up to more than d")
    return bases


def extract_in_subspaces(oracle: QueryAccess, subspaces, seed, verify_tolerance) -> ExtractionResult:
    start, q0, bb0 = time.perf_counter(), oracle.queries, oracle.black_box_seconds
    d = oracle.dim
    bases = subspace_bases(subspaces, d)
    if not bases:
        raise InputError("subspaces must hold at least one subspace")
    n_verify = verification_count(sum(b.shape[1] ** 2 + b.shape[1] for b in bases))
    inner_total = sum(b.shape[1] ** 2 + b.shape[1] + verification_count(b.shape[1] ** 2 + b.shape[1])
                      for b in bases)
    oracle.plan(inner_total + n_verify, "multi-head extraction in known subspaces")
    W, v, notes, per_head = [], [], [], []
    for i, B in enumerate(bases):
        # The restricted view: tokens y in R^r are sent as B y; every query goes through
        # the outer oracle, so its counter and budget see each one.
        def restricted(Y: np.ndarray, B: np.ndarray = B) -> np.ndarray:
            return oracle.query(Y @ B.T)

        view = Oracle(restricted, B.shape[1])
        try:
            inner = extract_single_head(view, seed=None if seed is None else seed + i,
                                        verify_tolerance=verify_tolerance)
        except NotIdentifiableError:
            notes.append(f"subspace {i}: v = 0 (dead head), dropped from the canonical form")
            per_head.append(view.queries)
            continue
        except ModelMismatchError as exc:
            raise ModelMismatchError(
                f"subspace {i}: the black box restricted to it is not a single head "
                f"(are the subspaces right?): {exc}", result=exc.result) from exc
        per_head.append(view.queries)
        W.append(B @ inner.model.W @ B.T)
        v.append(B @ inner.model.v)
    model = (MultiHeadAttention(np.array(W), np.array(v)) if W
             else MultiHeadAttention(np.zeros((0, d, d)), np.zeros((0, d))))
    recovery = oracle.queries - q0
    verification = verify_model(oracle, model, count=n_verify, seed=seed,
                                tolerance=verify_tolerance)
    floor = sum(b.shape[1] ** 2 + b.shape[1] for b in bases)
    report = Report(kind=MultiHeadAttention.kind, dim=d, queries=oracle.queries - q0,
                    breakdown={"recovery": recovery, "verification": n_verify},
                    floor=floor, verification=verification,
                    seconds=time.perf_counter() - start,
                    black_box_seconds=oracle.black_box_seconds - bb0, notes=notes,
                    details={"method": "known orthogonal subspaces (the single-head paper)",
                             "heads": model.heads, "queries per subspace": per_head,
                             "sequence lengths": "1..2 (+ 1..16 verification)"})
    return checked_result(model, report, "multi-head attention on these subspaces")
