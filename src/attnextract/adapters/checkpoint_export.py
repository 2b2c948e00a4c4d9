"""A model back: recovered attention re-factored into the checkpoint's own architecture.

:func:`export_state_dict` turns a checkpoint result (outputs ``last``: every head's
whole W_h, b_h, O_h and c) into a state dict of the original architecture, written as
safetensors. Every tensor outside the recovered layers' attention is the original's;
each recovered head is re-factored from its canonical form (the factors differ from the
original ones, the function is the same):

- W_h = K_h^T Q_h / sqrt(d_h): SVD W_h = U S V^T at rank d_h, K_h = d_h^(1/4) S^(1/2) U^T,
  Q_h = d_h^(1/4) S^(1/2) V^T;
- b_h = K_h^T b_q,h / sqrt(d_h): b_q,h = sqrt(d_h) (K_h^T)^+ b_h (b_h lies in K_h^T's
  column space, W_h's); key bias 0 (it cancels in the softmax);
- O_h = W_o[:, h] W_v,h: SVD at rank d_h, W_o[:, h] = U S^(1/2), W_v,h = S^(1/2) V^T;
  value bias 0 and output bias c (the attention weights sum to 1).

GPT-2 (pre-LayerNorm): the heads were recovered on the sphere of zero-mean tokens of norm
R, where ln_1 is affine. Exported with ln_1's scale 1 and shift 0, ln_1 maps x to
z = P x / sqrt(var(x) + eps), and x = s z on the sphere with s = sqrt(R^2 / d + eps), so
the heads in z are s^2 W_h, s b_h, s O_h, c. As the original attention is a function of
z too (gamma and beta fold into the heads), the exported block equals the original for
every input, not only on the sphere.

:func:`compare` loads the original model and the same model with the exported tensors
swapped in, and reports the largest difference of their outputs on real inputs: for a
sentence-transformers folder (a tokenizer and a pooling config), the sentence embeddings
(mean pooling, normalised) of real sentences through the folder's own tokenizer; else
the last hidden states of random token ids.
"""

from __future__ import annotations

import copy
import importlib
import math
import re
from pathlib import Path

import numpy as np

from ..checkpoint import CheckpointResult, layer_heads, low_rank_factors
from ..errors import InputError, TargetLoadError
from .checkpoint import Checkpoint, torch

SENTENCES = 100


def _head_tensors(heads: dict, info, radius: float | None) -> dict[str, np.ndarray]:
    """q, k, v, o (nn.Linear layout (out, in)) and bq, bk, bv, bo from canonical heads."""
    H, dh, d = info.heads, info.head_dim, info.width
    W, b, O, c = heads["W"], heads["b"], heads["O"], heads["c"]
    if W.shape[0] > H:
        raise InputError(f"{W.shape[0]} heads found, more than the architecture's {H}")
    if radius is not None:              # the sphere's coordinates -> ln_1's output z
        s = math.sqrt(radius ** 2 / d + info.layer_norm_eps)
        W, b, O = s * s * W, s * b, s * O
    q, k, v, o = (np.zeros((d, d)) for _ in range(4))
    bq = np.zeros(d)
    root = dh ** 0.25
    for h in range(W.shape[0]):         # heads merged away are left zero (they add nothing)
        rows = slice(h * dh, (h + 1) * dh)
        left, right = low_rank_factors(W[h], dh)          # W_h = left right^T
        k[rows], q[rows] = root * left.T, root * right.T
        bq[rows] = math.sqrt(dh) * np.linalg.lstsq(k[rows].T, b[h], rcond=None)[0]
        out_f, in_f = low_rank_factors(O[h], dh)          # O_h = out_f in_f^T
        o[:, rows], v[rows] = out_f, in_f.T
    return {"q": q, "k": k, "v": v, "o": o, "bq": bq, "bk": np.zeros(d), "bv": np.zeros(d),
            "bo": np.asarray(c, dtype=np.float64)}


def _names(info, layer: int) -> dict[str, str]:
    if info.family == "bert":
        p = f"encoder.layer.{layer}.attention."
        return {"q": p + "self.query.weight", "k": p + "self.key.weight",
                "v": p + "self.value.weight", "o": p + "output.dense.weight",
                "bq": p + "self.query.bias", "bk": p + "self.key.bias",
                "bv": p + "self.value.bias", "bo": p + "output.dense.bias"}
    p = f"h.{layer}."
    return {"c_attn.weight": p + "attn.c_attn.weight", "c_attn.bias": p + "attn.c_attn.bias",
            "c_proj.weight": p + "attn.c_proj.weight", "c_proj.bias": p + "attn.c_proj.bias",
            "ln_1.weight": p + "ln_1.weight", "ln_1.bias": p + "ln_1.bias"}


def recovered_state_dict(result: CheckpointResult,
                         ck: Checkpoint) -> tuple[dict[str, np.ndarray], list[int]]:
    """The original's state dict (float64) with every recovered layer's attention replaced,
    and the indices of those layers."""
    info = ck.info
    if result.data["outputs"] == "scalar":
        raise InputError("a scalar extraction knows each head's values along one readout "
                         "only: export needs the whole output vectors (--outputs last)")
    if result.data["width"] != info.width or result.data["heads"] != info.heads:
        raise InputError(f"the result is of another architecture than {info.path}")
    state = {k: t.detach().to(torch.float64).numpy().copy()
             for k, t in ck.model.state_dict().items()}
    done = []
    for entry in result.layers:
        if "heads" not in entry:
            continue
        t = _head_tensors(layer_heads(entry), info, entry.get("radius"))
        names = _names(info, entry["layer"])
        if info.family == "bert":
            for key, name in names.items():
                state[name] = t[key]
        else:                                    # Conv1D: (in, out), x W + b
            d = info.width
            state[names["c_attn.weight"]] = np.hstack([t["q"].T, t["k"].T, t["v"].T])
            state[names["c_attn.bias"]] = np.concatenate([t["bq"], t["bk"], t["bv"]])
            state[names["c_proj.weight"]] = t["o"].T
            state[names["c_proj.bias"]] = t["bo"]
            state[names["ln_1.weight"]] = np.ones(d)
            state[names["ln_1.bias"]] = np.zeros(d)
        done.append(entry["layer"])
    if not done:
        raise InputError("the result holds no recovered layer to export")
    return state, done


def export_state_dict(result: CheckpointResult, out) -> Path:
    """Write the recovered model's state dict (float64 safetensors) to ``out``.

    The metadata names the source folder and the recovered layers."""
    from safetensors.numpy import save_file
    ck = Checkpoint(result.data["checkpoint"])
    state, done = recovered_state_dict(result, ck)
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, str(tmp),
              metadata={"format": "pt", "source": str(ck.info.path),
                        "recovered_layers": ",".join(map(str, done)),
                        "producer": "attnextract checkpoint --export"})
    tmp.replace(out)
    return out


def _swapped(ck: Checkpoint, exported):
    from safetensors import safe_open
    try:
        with safe_open(str(exported), framework="pt") as f:
            names = list(f.keys())          # a safe_open handle is not a mapping
            state = {k: f.get_tensor(k).to(torch.float64) for k in names}
            meta = f.metadata() or {}
    except Exception as exc:          # not a safetensors file: one line
        raise TargetLoadError(f"cannot read {exported} as safetensors: {exc}") from exc
    model = copy.deepcopy(ck.model)
    missing = set(model.state_dict()) - set(state)
    if missing:
        raise InputError(f"{exported} is not a state dict of {ck.info.path}'s architecture "
                         f"(lacks {min(missing)})")
    model.load_state_dict(state, strict=False)
    return model.eval(), meta


# standard-library modules whose docstrings give real sentences offline (fixed order)
SENTENCE_MODULES = ("argparse", "collections", "email", "json", "logging", "pathlib",
                    "sqlite3", "unittest", "decimal", "datetime", "difflib", "doctest",
                    "heapq", "inspect", "pickle", "random", "statistics", "string",
                    "subprocess", "tarfile", "textwrap", "threading", "typing", "csv",
                    "shutil", "tempfile", "functools", "contextlib", "dataclasses", "enum",
                    "configparser", "optparse", "gettext", "calendar", "hashlib", "uuid",
                    "zipfile", "queue", "sched", "selectors", "ssl", "timeit", "tokenize",
                    "ast", "pdb", "fractions", "bisect", "glob", "fnmatch", "codecs")


def real_sentences(folder: Path, count: int = SENTENCES) -> list[str]:
    """Real sentences, offline: from the folder's own text files (README.md, ...), then
    from the docstrings of Python's standard library (written by people, always present)."""
    texts = [p.read_text(errors="ignore") for p in sorted(folder.glob("*.md"))]
    for name in SENTENCE_MODULES:
        try:
            texts.append(importlib.import_module(name).__doc__ or "")
        except ImportError:               # a Python built without ssl, say
            continue
    sentences, seen = [], set()
    for text in texts:
        text = re.sub(r"https?://\S+|[#*`|>\[\]()_=]", " ", text)
        for piece in re.split(r"(?<=[.!?])\s+", text):
            piece = " ".join(piece.split()).lstrip("- ")
            if 30 <= len(piece) <= 300 and re.fullmatch(r"[A-Za-z0-9 ,.;:'\"!?/&%-]+", piece) \
                    and piece not in seen:
                seen.add(piece)
                sentences.append(piece)
            if len(sentences) == count:
                return sentences
    return sentences


def _sentence_embeddings(model, tokenizer, sentences: list[str]) -> np.ndarray:
    batch = tokenizer(sentences, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)     # mean pooling
    return torch.nn.functional.normalize(pooled, p=2, dim=1).numpy()


def compare(path, exported, *, sentences: list[str] | None = None, seed: int = 0) -> dict:
    """The original model against the same model with the exported tensors swapped in.

    Returns
    -------
    dict
        ``max_abs_difference`` and ``max_relative_difference`` of the outputs (sentence
        embeddings (S, d) for a sentence-transformers folder, else last hidden states of
        random token ids (8, 16, d)), ``inputs`` (what was compared), ``recovered_layers``.
    """
    from transformers import AutoTokenizer

    ck = Checkpoint(path)
    swapped, meta = _swapped(ck, exported)
    folder = ck.info.path
    has_tokenizer = any((folder / f).is_file() for f in ("tokenizer.json", "vocab.txt"))
    if has_tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        texts = sentences or real_sentences(folder)
        a = _sentence_embeddings(ck.model, tokenizer, texts)
        b = _sentence_embeddings(swapped, tokenizer, texts)
        what = f"sentence embeddings of {len(texts)} real sentences (mean pooling, normalised)"
    else:
        vocab = int(ck.info.config.get("vocab_size", 100))
        ids = torch.from_numpy(np.random.default_rng(seed).integers(0, vocab, (8, 16)))
        with torch.no_grad():
            a = ck.model(input_ids=ids).last_hidden_state.numpy()
            b = swapped(input_ids=ids).last_hidden_state.numpy()
        what = "last hidden states of 8 random token sequences of 16"
    diff = float(np.abs(a - b).max())
    return {"inputs": what, "max_abs_difference": diff,
            "max_relative_difference": diff / max(float(np.abs(a).max()), 1e-300),
            "recovered_layers": meta.get("recovered_layers", "")}
