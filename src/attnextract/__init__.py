"""attnextract: exact recovery of attention-model parameters from black-box queries."""

from .errors import (AttnExtractError, BlackBoxError, BudgetExceededError, InputError,
                     MalformedOutputError, ModelMismatchError, NonFiniteOutputError,
                     NotIdentifiableError, TargetLoadError)
from .models import SingleHeadAttention
from .oracle import Oracle
from .report import ExtractionResult, Report, Verification, load_model, verify_model
from .single_head import extract_single_head
from .noisy import extract_noisy
from .sign_only import extract_sign_only

__version__ = "0.1.0"

__all__ = [
    "AttnExtractError", "BlackBoxError", "BudgetExceededError", "InputError",
    "MalformedOutputError", "ModelMismatchError", "NonFiniteOutputError",
    "NotIdentifiableError", "TargetLoadError", "SingleHeadAttention", "Oracle",
    "ExtractionResult", "Report", "Verification", "load_model", "verify_model",
    "extract_single_head", "extract_noisy", "extract_sign_only", "__version__",
]
