"""attnextract: exact recovery of attention-model parameters from black-box queries.

Start with :func:`extract` (``attnextract.extract(Oracle(black_box, dim), model="low-rank")``);
the algorithms are described at https://attnextract.github.io/attnextract/algorithms/.
"""

# first, before the heavy imports: Ctrl-C while the command starts is one line
from . import _startup  # noqa: F401  (its import sets that up; a library import: no change)
from . import progress as progress  # ProgressBar, configure_logging, thread_limits
from .errors import (
    AttnExtractError,
    BlackBoxError,
    BudgetExceededError,
    DimensionError,
    InputError,
    JournalError,
    JournalMismatchError,
    MalformedOutputError,
    ModelMismatchError,
    NonFiniteOutputError,
    NotIdentifiableError,
    RecoveryFailedError,
    RefusalWithResult,
    TargetLoadError,
)
from .learners.low_rank import extract_low_rank
from .learners.multi_head import (
    canonical_form,
    extract_multi_head,
    non_identifiable_twin,
    twin_difference,
)
from .learners.multi_head_low_rank import extract_multi_head_low_rank
from .learners.noisy import extract_low_precision, extract_noisy
from .learners.one_layer import extract_one_layer
from .learners.pre_layer_norm import extract_pre_layer_norm
from .learners.relu_network import extract_relu_network
from .learners.residual import extract_one_layer_residual
from .learners.sign_only import extract_sign_only
from .learners.single_head import extract_single_head
from .learners.transformer_layer import extract_transformer_layer
from .learners.vector_layer import extract_vector_layer
from .learners.vector_layer_positions import extract_standard_layer, extract_vector_layer_positions
from .learners.vector_multi_head import extract_vector_multi_head
from .learners.vector_pre_layer_norm import extract_vector_pre_layer_norm
from .learners.vector_single_head import extract_vector_single_head
from .models import (
    BiasedMultiHeadAttention,
    BiasedSingleHeadAttention,
    MultiHeadAttention,
    OneLayerTransformer,
    PreLayerNormAttention,
    ReLUNetwork,
    ResidualOneLayer,
    SingleHeadAttention,
    SphereAttention,
    TransformerLayer,
    VectorAttention,
    VectorSphereAttention,
)
from .oracle import Oracle
from .registry import extract, learner_names, register
from .report import ExtractionResult, Report, Verification, load_model, verify_model

__version__ = "0.3.0"

# Old import paths (``attnextract.single_head``, ``attnextract.remote``, ...) keep working:
# each name in sys.modules is the same module object as its new home, so monkeypatching
# either affects both. All of these import numpy and the standard library only.
import importlib as _importlib  # noqa: E402
import sys as _sys  # noqa: E402

for _package, _names in {
    "learners": ("single_head", "low_rank", "noisy", "sign_only", "relu_network", "one_layer",
                 "residual", "multi_head", "surrogate"),
    "adapters": ("torch_target", "minilm", "remote", "server", "journal", "targets"),
}.items():
    for _name in _names:
        _module = _importlib.import_module(f"{__name__}.{_package}.{_name}")
        _sys.modules[f"{__name__}.{_name}"] = _module
        globals()[_name] = _module
del _package, _names, _name, _module

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
__all__ += ["extract", "learner_names", "register"]
__all__ += ["TransformerLayer", "extract_transformer_layer"]
__all__ += ["DimensionError", "JournalError", "JournalMismatchError", "RefusalWithResult",
            "BiasedMultiHeadAttention", "BiasedSingleHeadAttention", "PreLayerNormAttention",
            "ResidualOneLayer", "SphereAttention", "VectorAttention", "VectorSphereAttention",
            "extract_multi_head_low_rank", "extract_low_precision", "extract_pre_layer_norm",
            "extract_one_layer_residual", "extract_vector_layer", "extract_vector_multi_head",
            "extract_vector_pre_layer_norm", "extract_vector_single_head",
            "extract_standard_layer", "extract_vector_layer_positions"]
