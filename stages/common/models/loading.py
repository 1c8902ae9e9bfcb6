"""The one way stages load models and tokenizers: `from_pretrained` on a local Hugging Face directory.

What this is: causal LMs (policy, reference), reward models (sequence classifiers with one output)
and tokenizers, with a check up front that names the directory and the missing file when it is not a
saved model. Any architecture transformers knows (Llama, Qwen2, GPT-2, ...) loads the same way.
Weights load from safetensors only, unless the caller allows pickle (`model.allow_pickle`, which only
the base stage's import of `model.base` passes on): unpickling a file runs any code its author put in it.
What it is not: storage. s3:// and file:// URIs are resolved to local directories by the storage
layer before these functions are called.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DType = Literal["float32", "bfloat16", "float16"]
PaddingSide = Literal["left", "right"]
WEIGHT_FILES: tuple[str, ...] = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
)
SAFETENSORS_WEIGHTS: tuple[str, ...] = ("model.safetensors", "model.safetensors.index.json")
# Formats read with pickle (torch.save and friends). The setting that allows them, named in refusals.
PICKLE_SUFFIXES: tuple[str, ...] = (".bin", ".pt", ".pkl", ".pth", ".ckpt")
ALLOW_PICKLE_SETTING = "model.allow_pickle"
# What to do about pickle weights in a folder an engine builds from or loads. Engines take no opt-in: they
# read the pipeline's own outputs, which are safetensors.
ENGINE_PICKLE_FIX = (
    "engines read safetensors only: build the engine from a checkpoint a stage published (the base stage "
    f"re-saves a model.base it was allowed to unpickle, {ALLOW_PICKLE_SETTING}, as safetensors)"
)
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "tokenizer.model",
)


class ModelDirError(ValueError):
    """A path that is not a loadable Hugging Face directory; the message names it and what is missing."""


class PickleRefusedError(ModelDirError):
    """A folder whose weights would be unpickled, loaded without the setting that allows pickle."""


def _model_dir(path: str | os.PathLike[str], what: str) -> Path:
    path = Path(path)
    if not path.exists():
        raise ModelDirError(
            f"{path}: {what} directory not found (give a local directory written by save_pretrained)"
        )
    if not path.is_dir():
        raise ModelDirError(f"{path}: is a file, not a {what} directory written by save_pretrained")
    return path


def pickle_files(path: str | os.PathLike[str]) -> list[str]:
    """The files under folder `path` (subfolders too) in a pickle format, as sorted relative paths."""
    path = Path(path)
    return sorted(
        p.relative_to(path).as_posix()
        for p in path.rglob("*")
        if p.suffix.lower() in PICKLE_SUFFIXES and p.is_file()
    )


def _explicit_weights(path: Path) -> str | None:
    """The weights file config.json names (`transformers_weights`), which from_pretrained loads first."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("transformers_weights") if isinstance(config, dict) else None
    return name if isinstance(name, str) else None


def pickle_refusal(
    path: str | os.PathLike[str], allow_pickle: bool = False, fix: str | None = None
) -> str | None:
    """Why loading the model folder `path` would unpickle, as a one-line error, or None.

    Loading unpickles when the weights are in a pickle format only (no model.safetensors or its index), or
    when config.json names a pickle file as its weights. Pickle files beside safetensors weights are never
    opened (loads pass use_safetensors=True), so they do not refuse the folder. `fix`: what to do, in the
    message (default: convert, or set model.allow_pickle).
    """
    path = Path(path)
    if allow_pickle or not path.is_dir():
        return None
    found = pickle_files(path)
    explicit = _explicit_weights(path)
    if not found or (
        any((path / name).is_file() for name in SAFETENSORS_WEIGHTS)
        and not (explicit and Path(explicit).suffix.lower() in PICKLE_SUFFIXES)
    ):
        return None
    shown = ", ".join(found[:5]) + (f", ... ({len(found)} files)" if len(found) > 5 else "")
    fix = fix or (
        "convert them to safetensors (load and save_pretrained them where you trust the source), or set "
        f"{ALLOW_PICKLE_SETTING}=true if you trust the source"
    )
    return (
        f"{path}: refusing to load pickle files ({shown}): unpickling runs any code their author put in "
        f"them; {fix}"
    )


def refuse_pickle(path: str | os.PathLike[str], allow_pickle: bool = False, fix: str | None = None) -> None:
    """Raise PickleRefusedError when loading the folder `path` would unpickle (see pickle_refusal)."""
    problem = pickle_refusal(path, allow_pickle, fix)
    if problem is not None:
        raise PickleRefusedError(problem)


def check_model_dir(path: str | os.PathLike[str], allow_pickle: bool = False) -> Path:
    """Raise ModelDirError unless `path` holds config.json and weights (safetensors; .bin with allow_pickle):
    PickleRefusedError when its weights are pickle files and allow_pickle is False."""
    path = _model_dir(path, "model")
    if not (path / "config.json").is_file():
        raise ModelDirError(
            f"{path}: not a Hugging Face model directory: config.json is missing "
            f"(found: {_listing(path)}); save the model with save_pretrained"
        )
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise ModelDirError(
            f"{path}: no model weights: expected one of {', '.join(WEIGHT_FILES)} (found: {_listing(path)})"
        )
    refuse_pickle(path, allow_pickle)
    return path


def check_tokenizer_dir(path: str | os.PathLike[str]) -> Path:
    """Raise ModelDirError unless `path` holds tokenizer files."""
    path = _model_dir(path, "tokenizer")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelDirError(
            f"{path}: no tokenizer files: expected one of {', '.join(TOKENIZER_FILES)} "
            f"(found: {_listing(path)}); save the tokenizer with save_pretrained next to the model"
        )
    return path


def _listing(path: Path, limit: int = 8) -> str:
    names = sorted(p.name for p in path.iterdir())
    if not names:
        return "nothing, the directory is empty"
    return ", ".join(names[:limit]) + (f", ... ({len(names)} files)" if len(names) > limit else "")


def torch_dtype(dtype: str) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' -> torch dtype; anything else lists the valid names."""
    import torch

    if dtype not in get_args(DType):
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(get_args(DType))}")
    return getattr(torch, dtype)


def _use_safetensors(allow_pickle: bool) -> bool | None:
    """from_pretrained's use_safetensors: True never reads a pickle; None prefers safetensors, else .bin."""
    return None if allow_pickle else True


def load_causal_lm(
    path: str | os.PathLike[str], dtype: DType = "float32", allow_pickle: bool = False
) -> PreTrainedModel:
    """AutoModelForCausalLM from a local directory, in `dtype`, in eval mode (call .train() to train).

    Safetensors weights only unless allow_pickle (model.allow_pickle, for a model.base the user trusts).
    """
    from transformers import AutoModelForCausalLM

    path = check_model_dir(path, allow_pickle)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch_dtype(dtype), use_safetensors=_use_safetensors(allow_pickle)
    )
    return model.eval()


def load_tokenizer(
    path: str | os.PathLike[str], padding_side: PaddingSide = "right"
) -> PreTrainedTokenizerBase:
    """AutoTokenizer from a local directory, with a pad token and the given padding side.

    A tokenizer with no pad token gets its eos token as pad (the usual choice for GPT-2-style
    vocabularies; attention masks keep padded positions out of losses). Use padding_side="left"
    for batched generation, "right" for training.
    """
    from transformers import AutoTokenizer

    if padding_side not in get_args(PaddingSide):
        raise ValueError(
            f"padding_side must be one of {', '.join(get_args(PaddingSide))}; got {padding_side!r}"
        )
    path = check_tokenizer_dir(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelDirError(
                f"{path}: tokenizer has neither a pad nor an eos token; set pad_token and save it again"
            )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = padding_side
    return tokenizer


def load_sequence_classifier(
    path: str | os.PathLike[str],
    dtype: DType = "float32",
    pad_token_id: int | None = None,
    seed: int | None = None,
    allow_pickle: bool = False,
) -> PreTrainedModel:
    """A reward model: AutoModelForSequenceClassification with num_labels=1 (one scalar per sequence).

    `path` may hold a causal LM (the SFT policy: its body is reused and a new score head is
    initialised, under `seed` when given so ensemble members differ reproducibly) or a saved reward
    model. The model scores the last non-pad token, so it needs pad_token_id: the argument, else the
    checkpoint's, else its eos id. Returns the model in eval mode; logits are (B, 1). Safetensors weights
    only unless allow_pickle.
    """
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    path = check_model_dir(path, allow_pickle)
    config = AutoConfig.from_pretrained(path)
    if pad_token_id is None:
        pad_token_id = config.pad_token_id
    if pad_token_id is None:
        eos = config.eos_token_id
        pad_token_id = eos[0] if isinstance(eos, list) else eos
    if pad_token_id is None:
        raise ModelDirError(
            f"{path}: config.json has no pad_token_id or eos_token_id; pass pad_token_id "
            "(e.g. tokenizer.pad_token_id)"
        )
    # One label is a regression-style scalar head; the id2label map a causal LM config carries has 2 entries.
    config.num_labels = 1
    config.id2label, config.label2id = {0: "reward"}, {"reward": 0}
    config.pad_token_id = pad_token_id
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_pretrained(
            path, config=config, dtype=torch_dtype(dtype), use_safetensors=_use_safetensors(allow_pickle)
        )
    return model.eval()
