"""The state one multi-head run shares between its stages, as a type.

The stage classes (:class:`.base_row.BaseRowStage`, :class:`.main_rows.MainRowStage`,
:class:`.short_probes.ShortProbeStage`, :class:`.budget.Budget`) are mixins of the run
(``_Extraction``): each reads attributes the run sets and calls methods the others define.
:class:`RunState` names those attributes and methods so a type checker can check every
stage on its own (its methods are declared abstract: each is defined by the run or by one
of the stages). The stages derive from it for the type checker only (at run time they
derive from ``object``), so it adds nothing to a run.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from ...errors import RefusalWithResult
from ...models import BiasedMultiHeadAttention, MultiHeadAttention
from ...oracle import QueryAccess
from ...report import ExtractionResult
from .fit import StepFit

# the heads a run recovers (with biases: W, v, b and c)
MultiHeadModel = MultiHeadAttention | BiasedMultiHeadAttention

# one measured copy-probe round for the polish: u, q, realised lambdas, answers f - c,
# the probes' lengths (one length, or one per lambda)
Answer = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, "np.ndarray | int"]


class RunState:
    """Attributes and cross-stage methods of one run (``_Extraction``)."""

    # set at the start (``_Extraction.__init__``, ``extract_multi_head``)
    oracle: QueryAccess
    d: int
    max_heads: int
    heads_told: bool
    rng: np.random.Generator
    seed: Any                       # as given to np.random.default_rng
    tolerance: float | None         # max_error_bar; None until set_precision chooses it
    tolerance_given: bool
    verify_tolerance: float
    say: Callable[[str], None]
    start: float
    q0: int
    bb0: float
    breakdown: dict[str, int]
    details: dict[str, Any]
    notes: list[str]
    biases: bool
    full_precision: bool
    output_dtype: str | None
    decimals: int | None
    # the answers: c = f([0]), v = sum_h v_h, the rounding (set_precision)
    c: float
    v: np.ndarray
    answers: list[Answer]
    precision: float
    precision_name: str
    absolute_noise: float
    relative_rounding: float
    coarse: bool
    # the count search and the base row (base_row)
    count_level: int
    count_ended_early: bool
    coarse_extra_scans: int
    scans_left: int
    scans_made: int
    designs_failed: int
    length: int
    half_window: float
    base_grid: np.ndarray
    spare_rows: list[tuple[np.ndarray, StepFit, np.ndarray]]
    missed_scans: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]
    count_rows: list[tuple[int, np.ndarray, StepFit]]
    count_window: int
    count_q0: np.ndarray
    saw_steps: bool
    u_0: np.ndarray
    q_0: np.ndarray
    base_fit: StepFit
    column_gain: float | None
    base_reference: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    # the main rows (main_rows) and the end
    labels_trusted: bool
    label_misfit: float
    method: str
    result: ExtractionResult

    # the run's own methods (``_Extraction``)
    @abstractmethod
    def spend(self, stage: str, before: int) -> None: ...
    @abstractmethod
    def measure(self, u: np.ndarray, q: np.ndarray, lam: np.ndarray,
                length: int | None = None) -> tuple[np.ndarray, np.ndarray]: ...
    @abstractmethod
    def lengths(self, lam: np.ndarray) -> np.ndarray: ...
    @abstractmethod
    def noise(self, f_values: Any, heights: Any = 0.0, *, floor: bool = False,
              lengths: Any = None) -> float: ...
    @abstractmethod
    def refuse(self, message: str, kind: type[RefusalWithResult] = ...,
               judge: bool = False) -> NoReturn: ...
    @abstractmethod
    def finish(self, model: MultiHeadModel, bar: float | None,
               check: bool = True) -> ExtractionResult: ...
    @abstractmethod
    def affine(self, columns: np.ndarray) -> np.ndarray: ...

    # the stages' (base_row, short_probes)
    @abstractmethod
    def set_window(self, length: int) -> None: ...
    @abstractmethod
    def short_probes(self, model: MultiHeadModel, predicted: float,
                     misfit: float) -> tuple[MultiHeadModel, float, bool]: ...

    # the budget's (budget.Budget)
    @abstractmethod
    def affordable(self, queries: int, H: int) -> bool: ...
    @abstractmethod
    def attempt_cost(self, H: int, least: bool = False) -> int: ...
    @abstractmethod
    def base_scans(self, H: int, short_share: bool) -> int: ...
    @abstractmethod
    def column_cost(self, H: int) -> int: ...
    @abstractmethod
    def count_cap(self, H: int) -> int: ...
    @abstractmethod
    def count_name(self) -> str: ...
    @abstractmethod
    def design_rest_cost(self, H: int) -> int: ...
    @abstractmethod
    def least_columns(self) -> int: ...
    @abstractmethod
    def main_columns(self, H: int) -> int: ...
    @abstractmethod
    def main_cost(self, H: int, columns: int | None = None) -> int: ...
    @abstractmethod
    def parameters(self, H: int) -> int: ...
    @abstractmethod
    def perturbation_cost(self, H: int) -> int: ...
    @abstractmethod
    def short_share(self) -> bool: ...
    @abstractmethod
    def spent(self) -> int: ...
