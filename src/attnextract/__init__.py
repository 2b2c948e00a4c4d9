"""attnextract: exact recovery of attention-model parameters from black-box queries."""

from .errors import (AttnExtractError, BlackBoxError, BudgetExceededError, InputError,
                     MalformedOutputError, ModelMismatchError, NonFiniteOutputError,
                     NotIdentifiableError, TargetLoadError)
from .models import MultiHeadAttention, SingleHeadAttention
from .multi_head import (canonical_form, extract_multi_head, non_identifiable_twin,
                         twin_difference)
from .oracle import Oracle
from .report import ExtractionResult, Report, Verification, load_model, verify_model
from .single_head import extract_single_head

__version__ = "0.1.0"

__all__ = [
    "AttnExtractError", "BlackBoxError", "BudgetExceededError", "InputError",
    "MalformedOutputError", "ModelMismatchError", "NonFiniteOutputError",
    "NotIdentifiableError", "TargetLoadError", "SingleHeadAttention", "Oracle",
    "ExtractionResult", "Report", "Verification", "load_model", "verify_model",
    "extract_single_head", "__version__",
    "MultiHeadAttention", "extract_multi_head", "canonical_form", "non_identifiable_twin",
    "twin_difference",
]
