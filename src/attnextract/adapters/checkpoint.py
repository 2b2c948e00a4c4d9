"""A local model folder (config.json + model.safetensors) as one black box per attention layer.

The black box of layer i is the checkpoint's own forward code, run by the framework
(Hugging Face ``transformers`` on PyTorch) in float64 and eval mode: the layer module
itself is called, and a forward hook on the module that produces the attention
sublayer's output takes that output and stops the rest of the layer. Nothing here
re-implements attention; the canonical form computed from the weights
(:func:`canonical_layer`) is only the truth the answers are checked against.

Families, from config.json's ``model_type`` (docs/checkpoint.md):

- BERT-style encoders (``bert``, ``roberta``, ``xlm-roberta``; all-MiniLM-L6-v2 is a
  ``bert``), post-LayerNorm: the sublayer maps the residual stream x directly,
  ``attention.self`` then ``attention.output.dense`` (before dropout, residual and
  LayerNorm). Bidirectional.
- GPT-2, pre-LayerNorm and causal: the sublayer is ``ln_1`` then ``attn`` (c_attn, the
  causal softmax, c_proj; before the residual). The box includes ``ln_1``, so a token on
  the sphere of zero mean and norm sqrt(d) is the pre-LayerNorm learners' domain.
- Rotary models (llama, mistral, qwen2, gemma, ... or any config naming rope/rotary):
  the score of a query at position j and a key at position i depends on j - i, so copies
  of one token at two positions score differently: outside every model class. Refused
  from config.json alone, before the weights are read and before any query.

The canonical form of a layer (docs/algorithms.md, "Attention with biases" and
"Vector outputs"), with W_q,h, W_k,h, W_v,h the head's rows (d_h, d) and W_o[:, h] its
columns (m, d_h) of the output projection:

    W_h = W_k,h^T W_q,h / sqrt(d_h),   b_h = W_k,h^T b_q,h / sqrt(d_h),
    O_h = W_o[:, h] W_v,h,             c = W_o b_v + b_o,
    F(X)_j = sum_h O_h X^T softmax(X (W_h x_j + b_h)) + c   (causal: over i <= j).

The key bias adds the same term to every score of a row and cancels in the softmax.

transformers and torch are optional: this module imports them at its top, and nothing
in the core imports this module at import time. Nothing is downloaded: the folder is
read with ``local_files_only=True`` and HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import InputError, ModelMismatchError, TargetLoadError
from ..models import BiasedMultiHeadAttention, PreLayerNormAttention

# never ask the hub, whatever the folder's config names (set before transformers loads)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

try:
    import torch
    import transformers
    from transformers import AutoModel
    from transformers.masking_utils import create_causal_mask
except ImportError as exc:          # an optional extra: say how to get it
    raise TargetLoadError("checkpoints are run by their own code: pip install "
                          "'attnextract[checkpoint]' (torch, transformers, safetensors)") from exc

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

BERT_STYLE = ("bert", "roberta", "xlm-roberta")
GPT2_STYLE = ("gpt2",)
# model types whose attention scores depend on the positions' offset (rotary embeddings)
ROTARY = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma",
          "gemma2", "gemma3", "gemma3_text", "phi", "phi3", "gptj", "gpt_neox", "falcon",
          "stablelm", "olmo", "olmo2", "cohere", "starcoder2", "deepseek_v2", "deepseek_v3",
          "granite", "internlm2", "chatglm", "baichuan", "yi", "roformer", "esm", "persimmon",
          "codegen", "smollm3", "glm", "glm4")
WEIGHTS = "model.safetensors"
SHARDED = "model.safetensors.index.json"
# the framework's eager attention holds (B, H, N, N) scores (and a causal mask of B N^2):
# a batch is cut into chunks of at most this many score numbers (256 MiB in float64)
CHUNK_NUMBERS = 1 << 25


class RotaryModelError(ModelMismatchError):
    """The checkpoint uses rotary position embeddings: its attention scores depend on the
    positions of query and key, which no model class here has. Raised from config.json,
    before any weight is read and before any query (exit code of a mismatch)."""


@dataclass(frozen=True)
class CheckpointInfo:
    """What config.json says about a model folder.

    Attributes
    ----------
    path : Path
        The folder.
    model_type : str
        config.json's ``model_type``.
    family : {"bert", "gpt2"}
        Where the attention sublayer is and how it is normalised (post-LN or pre-LN).
    layers, width, heads : int
        Number of attention layers L, residual width d (= m, the output width), heads H.
    head_dim : int
        d_h = d / H.
    causal : bool
        Position j attends to i <= j only (GPT-2).
    layer_norm_eps : float
        The pre-LayerNorm's eps (GPT-2), else the post-LN's (not part of the box).
    """

    path: Path
    model_type: str
    family: str
    layers: int
    width: int
    heads: int
    head_dim: int
    causal: bool
    layer_norm_eps: float
    config: dict = field(repr=False, compare=False, default_factory=dict)

    @property
    def pre_layer_norm(self) -> bool:
        return self.family == "gpt2"

    def describe(self) -> str:
        return (f"{self.model_type} ({'pre-LN, causal' if self.causal else 'post-LN'}), "
                f"{self.layers} layers, d = {self.width}, {self.heads} heads of {self.head_dim}")


def _rotary_reason(config: dict) -> str | None:
    """Why ``config`` describes a rotary model, or None."""
    model_type = str(config.get("model_type", "")).lower()
    if model_type in ROTARY:
        return f"model_type {model_type!r} uses rotary position embeddings"
    for key in ("rope_theta", "rope_scaling", "rope_parameters", "rotary_dim", "rotary_pct",
                "rotary_emb_base", "partial_rotary_factor"):
        if config.get(key) is not None:
            return f"config.json sets {key!r} (rotary position embeddings)"
    if "rotary" in str(config.get("position_embedding_type", "")).lower():
        return "config.json sets position_embedding_type 'rotary'"
    return None


def inspect_checkpoint(path) -> CheckpointInfo:
    """Read config.json of the model folder ``path`` and check the folder (no weights read).

    Raises
    ------
    TargetLoadError
        Not a folder, no config.json (not a model folder), a config.json that is not
        JSON, no model.safetensors, or a ``model_type`` outside the supported families.
    RotaryModelError
        A rotary model (llama and the like): refused with the reason.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise TargetLoadError(f"{folder} is not a folder: give a model folder holding "
                              f"config.json and {WEIGHTS}")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise TargetLoadError(f"{folder} is not a model folder: it holds no config.json")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TargetLoadError(f"{config_file} is not readable JSON: {exc}") from exc
    if not isinstance(config, dict) or not config.get("model_type"):
        raise TargetLoadError(f"{config_file} names no model_type")
    model_type = str(config["model_type"]).lower()
    rotary = _rotary_reason(config)
    if rotary is not None:
        raise RotaryModelError(
            f"{folder}: {rotary}: a score depends on the offset of the query's and the key's "
            f"positions, so copies of one token at two positions score differently; that is "
            f"outside every model class attnextract extracts (nothing was queried)")
    if model_type in BERT_STYLE:
        family = "bert"
        position = str(config.get("position_embedding_type", "absolute"))
        if position != "absolute":
            # relative_key adds a learned position term inside the scores: another class
            raise ModelMismatchError(
                f"{folder}: position_embedding_type {position!r} puts positions inside the "
                f"attention scores: outside every model class (nothing was queried)")
    elif model_type in GPT2_STYLE:
        family = "gpt2"
    else:
        raise TargetLoadError(
            f"{folder}: model_type {model_type!r} is not supported (BERT-style: "
            f"{', '.join(BERT_STYLE)}; GPT-2: gpt2; rotary models are refused)")
    if not (folder / WEIGHTS).is_file() and not (folder / SHARDED).is_file():
        raise TargetLoadError(f"{folder} holds no {WEIGHTS}: only safetensors weights are read "
                              f"(nothing is downloaded)")
    try:
        if family == "bert":
            layers, width = int(config["num_hidden_layers"]), int(config["hidden_size"])
            heads, eps = int(config["num_attention_heads"]), float(config.get("layer_norm_eps",
                                                                                1e-12))
        else:
            # GPT-2's names, else the common ones (neither: KeyError, reported below)
            layers = int(config["n_layer"] if "n_layer" in config else config["num_hidden_layers"])
            width = int(config["n_embd"] if "n_embd" in config else config["hidden_size"])
            heads = int(config["n_head"] if "n_head" in config
                        else config["num_attention_heads"])
            eps = float(config.get("layer_norm_epsilon", 1e-5))
    except (KeyError, TypeError, ValueError) as exc:
        raise TargetLoadError(f"{config_file} lacks the layer, width or head count: {exc}") \
            from exc
    if heads < 1 or width % heads:
        raise TargetLoadError(f"{config_file}: width {width} is not a multiple of {heads} heads")
    if family == "gpt2" and (config.get("scale_attn_by_inverse_layer_idx")
                             or config.get("reorder_and_upcast_attn")):
        # both only rescale or reorder the same bilinear scores; kept out until checked
        raise ModelMismatchError(f"{folder}: scale_attn_by_inverse_layer_idx / "
                                 f"reorder_and_upcast_attn are not supported")
    return CheckpointInfo(folder, model_type, family, layers, width, heads, width // heads,
                          family == "gpt2", eps, config)


def parse_layers(spec, layers: int) -> list[int]:
    """``"all"``, ``"0,3,5"`` or a list of ints -> sorted distinct layer indices in 0..L-1."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() == "all"):
        return list(range(layers))
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    chosen = set()
    for item in items:
        try:
            index = int(str(item).strip())
        except ValueError:
            raise InputError(f"--layers takes 'all' or indices like 0,3,5, got {spec!r}") \
                from None
        if not 0 <= index < layers:
            raise InputError(f"layer {index} is outside 0..{layers - 1}")
        chosen.add(index)
    if not chosen:
        raise InputError("no layer chosen")
    return sorted(chosen)


def load_model(info: CheckpointInfo):
    """The folder's model, built by transformers from its own files in float64, eval mode.

    ``attn_implementation="sdpa"`` (transformers' default): PyTorch's fused attention,
    causal through its own flag, without the (B, N, N) mask the eager path builds (14x
    faster on sequences of 2048 tokens, equal to the eager path to 1e-16)."""
    try:
        model = AutoModel.from_pretrained(str(info.path), local_files_only=True,
                                          dtype=torch.float64, attn_implementation="sdpa")
    except Exception as exc:          # a damaged or foreign file: one line, which folder
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TargetLoadError(f"transformers cannot load {info.path}: {first}") from exc
    model.eval()
    return model


def _layers_of(model, info: CheckpointInfo):
    """The model's list of layer modules (a task head's wrapper is looked through)."""
    base = getattr(model, "base_model", model)
    return base.encoder.layer if info.family == "bert" else base.h


class _Captured(Exception):
    """Raised by the forward hook once the sublayer's output is taken: the rest of the
    layer (residual, LayerNorm, feed-forward) is not computed."""


class LayerBlackBox:
    """The attention sublayer of one layer, run by the framework, as a vector black box.

    ``box(X)`` with X (B, N, d) float64 returns the sublayer's output at the last
    position, (B, m), or with ``outputs="all"`` at every position, (B, N, m). BERT-style:
    ``attention.output.dense`` of x (before dropout, residual, LayerNorm); GPT-2:
    ``attn(ln_1(x))`` with the causal mask of the framework's own mask builder.

    Parameters
    ----------
    model : transformers model
        From :func:`load_model` (float64, eval).
    info : CheckpointInfo
    layer : int
    outputs : {"last", "all"}
    """

    def __init__(self, model, info: CheckpointInfo, layer: int, outputs: str = "last"):
        if outputs not in ("last", "all"):
            raise InputError(f"outputs must be 'last' or 'all', got {outputs!r}")
        if not 0 <= layer < info.layers:
            raise InputError(f"layer {layer} is outside 0..{info.layers - 1}")
        self.model, self.info, self.layer, self.outputs = model, info, int(layer), outputs
        self.dim = self.out_dim = info.width
        self.kind = f"{info.model_type} layer {layer} attention"
        self.module = _layers_of(model, info)[layer]
        # the module whose output is the sublayer's: BERT's output projection (before its
        # dropout and the LayerNorm of x + it), GPT-2's whole attention (c_proj included)
        self.tap = (self.module.attention.output.dense if info.family == "bert"
                    else self.module.attn)

    def _hook(self, module, inputs, output):
        self._taken = output[0] if isinstance(output, tuple) else output
        raise _Captured

    def forward(self, X: np.ndarray) -> np.ndarray:
        """Every position's sublayer output, (B, N, m) float64."""
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 3 or X.shape[2] != self.dim:
            raise InputError(f"expected (B, N, {self.dim}), got {X.shape}")
        per_sequence = (self.info.heads + 1) * X.shape[1] ** 2
        step = max(1, CHUNK_NUMBERS // per_sequence)
        if X.shape[0] <= step:
            return self._forward(X)
        return np.concatenate([self._forward(X[i:i + step]) for i in range(0, len(X), step)])

    def _forward(self, X: np.ndarray) -> np.ndarray:
        hidden = torch.from_numpy(np.ascontiguousarray(X))
        mask = None
        if self.info.causal:
            positions = torch.arange(X.shape[1])[None]
            mask = create_causal_mask(config=self.model.config, inputs_embeds=hidden,
                                      attention_mask=None, cache=None,
                                      position_ids=positions)
        handle = self.tap.register_forward_hook(self._hook)
        self._taken = None
        try:
            with torch.no_grad():
                if self.info.family == "bert":
                    self.module(hidden)
                else:
                    self.module(hidden, None, mask)
        except _Captured:
            pass
        finally:
            handle.remove()
        if self._taken is None:
            raise TargetLoadError(f"layer {self.layer} of {self.info.path} never reached its "
                                  f"attention output")
        return self._taken.detach().numpy().astype(np.float64, copy=False)

    def __call__(self, X: np.ndarray) -> np.ndarray:
        out = self.forward(X)
        return out[:, -1, :] if self.outputs == "last" else out


def readout_vector(width: int, seed) -> np.ndarray:
    """The readout r: a random unit vector in R^m drawn from ``seed``."""
    r = np.random.default_rng(seed).standard_normal(width)
    return r / np.linalg.norm(r)


class ScalarReadout:
    """r^T F(X) at the last position: a vector black box read by one seeded direction,
    (B, N, d) -> (B,), for the scalar learners."""

    def __init__(self, box: LayerBlackBox, readout: np.ndarray):
        self.box, self.r = box, np.asarray(readout, dtype=np.float64)
        self.dim, self.kind = box.dim, f"{box.kind}, read out by r"

    def __call__(self, X: np.ndarray) -> np.ndarray:
        return self.box.forward(X)[:, -1, :] @ self.r


@dataclass
class CanonicalLayer:
    """The canonical form of an attention sublayer (module docstring).

    Attributes
    ----------
    W : array (H, d, d)
    b : array (H, d)
    O : array (H, m, d)
    c : array (m,)
    causal : bool
    norm : tuple (gamma (d,), beta (d,), eps) or None
        A pre-LayerNorm in front (GPT-2): the parameters act on LN(x).
    """

    W: np.ndarray
    b: np.ndarray
    O: np.ndarray
    c: np.ndarray
    causal: bool = False
    norm: tuple | None = None

    @property
    def heads(self) -> int:
        return self.W.shape[0]

    @property
    def dim(self) -> int:
        return self.W.shape[1]

    def forward(self, X: np.ndarray) -> np.ndarray:
        """F at every position, (B, N, m), computed from the canonical parameters."""
        X = np.asarray(X, dtype=np.float64)
        if self.norm is not None:
            gamma, beta, eps = self.norm
            centred = X - X.mean(axis=-1, keepdims=True)
            X = gamma * centred / np.sqrt((centred ** 2).mean(axis=-1, keepdims=True) + eps) + beta
        N = X.shape[1]
        out = np.broadcast_to(self.c, X.shape[:2] + self.c.shape).copy()
        for W, b, O in zip(self.W, self.b, self.O):
            scores = np.einsum("bid,de,bje->bji", X, W, X) + (X @ b)[:, None, :]
            if self.causal:
                scores = np.where(np.tril(np.ones((N, N), dtype=bool)), scores, -np.inf)
            scores -= scores.max(axis=-1, keepdims=True)
            alpha = np.exp(scores)
            alpha /= alpha.sum(axis=-1, keepdims=True)
            out += np.einsum("bji,bid->bjd", alpha, X) @ O.T
        return out

    def on_sphere(self, radius: float) -> CanonicalLayer:
        """What a pre-LayerNorm layer computes on tokens of zero mean and norm ``radius``,
        projected on the hyperplane 1^T x = 0 (the identifiable part): LN(x) = A x + beta
        there, A = diag(gamma) / sqrt(radius^2 / d + eps), so W_h' = A W_h A,
        b_h' = A (W_h beta + b_h), O_h' = O_h A, c' = c + sum_h O_h beta."""
        if self.norm is None:
            return self
        gamma, beta, eps = self.norm
        d = self.dim
        A = gamma / math.sqrt(radius ** 2 / d + eps)
        P = np.eye(d) - 1.0 / d
        W = P @ (A[None, :, None] * self.W * A[None, None, :]) @ P
        b = (A * (self.W @ beta + self.b)) @ P
        O = (self.O * A[None, None, :]) @ P
        c = self.c + np.einsum("hmd,d->m", self.O, beta)
        return CanonicalLayer(W, b, O, c, self.causal, None)

    def read_out(self, r: np.ndarray):
        """The scalar model r^T F at the last position: (W, v, b, c) with v_h = O_h^T r."""
        return self.W, np.einsum("hmd,m->hd", self.O, r), self.b, float(self.c @ r)


def _t(tensor) -> np.ndarray:
    return tensor.detach().to(torch.float64).numpy().copy()


def attention_weights(model, info: CheckpointInfo, layer: int) -> dict[str, np.ndarray]:
    """The raw projections of ``layer`` in nn.Linear's layout (out, in), float64.

    Keys ``q, k, v, o`` (d, d) and ``bq, bk, bv, bo`` (d,); GPT-2 also ``gamma, beta`` of
    ln_1. GPT-2's Conv1D stores (in, out) and computes x W + b: transposed here."""
    module = _layers_of(model, info)[layer]
    if info.family == "bert":
        s, o = module.attention.self, module.attention.output.dense
        return {"q": _t(s.query.weight), "k": _t(s.key.weight), "v": _t(s.value.weight),
                "o": _t(o.weight), "bq": _t(s.query.bias), "bk": _t(s.key.bias),
                "bv": _t(s.value.bias), "bo": _t(o.bias)}
    d = info.width
    w, b = _t(module.attn.c_attn.weight), _t(module.attn.c_attn.bias)   # (d, 3d), (3d,)
    return {"q": w[:, :d].T, "k": w[:, d:2 * d].T, "v": w[:, 2 * d:].T,
            "o": _t(module.attn.c_proj.weight).T, "bq": b[:d], "bk": b[d:2 * d],
            "bv": b[2 * d:], "bo": _t(module.attn.c_proj.bias),
            "gamma": _t(module.ln_1.weight), "beta": _t(module.ln_1.bias)}


def canonical_from_weights(w: dict[str, np.ndarray], info: CheckpointInfo) -> CanonicalLayer:
    """The canonical form of one layer from its raw projections (:func:`attention_weights`)."""
    H, dh = info.heads, info.head_dim
    # GPT-2 may turn the 1/sqrt(d_h) scaling off (scale_attn_weights: false)
    scaled = info.family == "bert" or info.config.get("scale_attn_weights", True)
    scale = 1.0 / math.sqrt(dh) if scaled else 1.0
    Ws, bs, Os = [], [], []
    for h in range(H):
        rows = slice(h * dh, (h + 1) * dh)
        Ws.append(w["k"][rows].T @ w["q"][rows] * scale)
        bs.append(w["k"][rows].T @ w["bq"][rows] * scale)
        Os.append(w["o"][:, rows] @ w["v"][rows])
    c = w["o"] @ w["bv"] + w["bo"]
    norm = (w["gamma"], w["beta"], info.layer_norm_eps) if info.pre_layer_norm else None
    return CanonicalLayer(np.stack(Ws), np.stack(bs), np.stack(Os), c, info.causal, norm)


def canonical_layer(model, info: CheckpointInfo, layer: int) -> CanonicalLayer:
    """The canonical form of ``layer`` of the loaded ``model`` (the truth, from the weights)."""
    return canonical_from_weights(attention_weights(model, info, layer), info)


class Checkpoint:
    """A model folder, inspected, then loaded once: its layers' black boxes and truths.

    Parameters
    ----------
    path : str or Path
        The model folder.

    Raises
    ------
    TargetLoadError, RotaryModelError
        See :func:`inspect_checkpoint`; also a folder transformers cannot load.
    """

    def __init__(self, path):
        self.info = inspect_checkpoint(path)
        self.model = load_model(self.info)

    def black_box(self, layer: int, outputs: str = "last") -> LayerBlackBox:
        return LayerBlackBox(self.model, self.info, layer, outputs)

    def truth(self, layer: int) -> CanonicalLayer:
        return canonical_layer(self.model, self.info, layer)


def save_layer_target(path, layers, out, readout_seed=0) -> Path:
    """Write one layer, read out by r(``readout_seed``), as a model file for
    ``attnextract serve --secret FILE.npz`` (its canonical form from the weights).

    BERT-style: a biased multi-head model (W, v, b, c); GPT-2: the pre-LayerNorm block
    with ln_1's scale and shift (no residual). ``layers`` must name exactly one layer."""

    info = inspect_checkpoint(path)
    chosen = parse_layers(layers, info.layers)
    if len(chosen) != 1:
        raise InputError("--save-target writes one layer: give --layers L")
    ck = Checkpoint(path)
    truth = ck.truth(chosen[0])
    W, v, b, c = truth.read_out(readout_vector(info.width, readout_seed))
    model: BiasedMultiHeadAttention | PreLayerNormAttention
    if truth.norm is None:
        model = BiasedMultiHeadAttention(W, v, b, c)
    else:
        gamma, beta, eps = truth.norm
        model = PreLayerNormAttention(gamma, beta, W, b, v, c, eps=eps)
    out = Path(out)
    np.savez(out, **model.parameters(), kind=np.str_(model.kind))
    return out if out.suffix == ".npz" else out.with_name(out.name + ".npz")
