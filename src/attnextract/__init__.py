"""attnextract: exact recovery of attention-model parameters from black-box queries."""

from .errors import (AttnExtractError, BlackBoxError, BudgetExceededError, InputError,
                     MalformedOutputError, ModelMismatchError, NonFiniteOutputError,
                     NotIdentifiableError, RecoveryFailedError, TargetLoadError)
from .models import MultiHeadAttention, SingleHeadAttention
from .multi_head import (canonical_form, extract_multi_head, non_identifiable_twin,
                         twin_difference)
from .oracle import Oracle
from .report import ExtractionResult, Report, Verification, load_model, verify_model
from .single_head import extract_single_head
from .models import OneLayerTransformer, ReLUNetwork
from .noisy import extract_noisy
from .one_layer import extract_one_layer
from .relu_network import extract_relu_network
from .sign_only import extract_sign_only
from .low_rank import extract_low_rank

__version__ = "0.1.0"

__all__ = [
    "AttnExtractError", "BlackBoxError", "BudgetExceededError", "InputError",
    "MalformedOutputError", "ModelMismatchError", "NonFiniteOutputError",
    "NotIdentifiableError", "TargetLoadError", "SingleHeadAttention", "Oracle",
    "ExtractionResult", "Report", "Verification", "load_model", "verify_model",
    "extract_single_head", "extract_noisy", "extract_sign_only", "__version__",
    "RecoveryFailedError", "extract_low_rank",
    "MultiHeadAttention", "extract_multi_head", "canonical_form", "non_identifiable_twin",
    "twin_difference",
]
__all__ += ["ReLUNetwork", "OneLayerTransformer", "extract_relu_network", "extract_one_layer"]
