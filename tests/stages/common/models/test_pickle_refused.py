"""Pickle weights are refused: a model folder whose weights would be unpickled loads only with allow_pickle.

Each test builds the folder an attacker would hand over: a tiny model saved as pytorch_model.bin, or a
crafted torch checkpoint that writes a file when unpickled (tests/malicious_pickle.py).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from alignflow.config import EngineConfig, TinyModelConfig
from alignflow.stages.common.generation.hf_backend import HFEngine
from alignflow.stages.common.models import tiny
from alignflow.stages.common.models.loading import (
    PickleRefusedError,
    load_causal_lm,
    load_sequence_classifier,
    pickle_files,
    pickle_refusal,
)
from tests.malicious_pickle import unpickling_runs_it, write_malicious_pickle

TINY = TinyModelConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       num_hidden_layers=1, vocab_size=320, max_position_embeddings=64)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.train_tokenizer(["a pickle is a jar of code", "safetensors hold only tensors"] * 20, 320)


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny.make_tiny_model(TINY, tokenizer, seed=0)


def bin_folder(model, tokenizer, folder):
    """The model saved the pre-safetensors way: config.json, pytorch_model.bin (torch.save), tokenizer."""
    folder.mkdir(parents=True)
    model.config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return folder


def test_a_folder_of_pickle_weights_is_refused_and_loads_with_allow_pickle(model, tokenizer, tmp_path):
    folder = bin_folder(model, tokenizer, tmp_path / "bin-model")
    message = (
        f"{folder}: refusing to load pickle files (pytorch_model.bin): unpickling runs any code their "
        "author put in them; convert them to safetensors (load and save_pretrained them where you trust the "
        "source), or set model.allow_pickle=true if you trust the source"
    )
    for load in (load_causal_lm, load_sequence_classifier):
        with pytest.raises(PickleRefusedError) as refused:
            load(folder)
        assert str(refused.value) == message
        assert "\n" not in str(refused.value)
    loaded = load_causal_lm(folder, allow_pickle=True)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)
    assert load_sequence_classifier(folder, allow_pickle=True, seed=0).config.num_labels == 1


def test_a_crafted_pickle_is_never_unpickled(tmp_path, model, tokenizer):
    sentinel = tmp_path / "pwned"
    folder = bin_folder(model, tokenizer, tmp_path / "evil")
    write_malicious_pickle(folder / "pytorch_model.bin", sentinel)
    assert unpickling_runs_it(folder / "pytorch_model.bin", sentinel), "the crafted file is a working attack"
    with pytest.raises(PickleRefusedError, match=re.escape(f"{folder}: refusing to load pickle files")):
        load_causal_lm(folder)
    # Allowed, transformers still unpickles with torch's weights_only loader, which refuses the payload.
    with pytest.raises(Exception, match="Weights only load failed"):
        load_causal_lm(folder, allow_pickle=True)
    assert not sentinel.exists()


def test_pickle_files_beside_safetensors_weights_are_never_opened(tmp_path, model, tokenizer):
    """An HF Trainer checkpoint or a hub snapshot keeps training_args.bin / optimizer.pt next to
    model.safetensors: loading reads the safetensors only, so the folder loads and the payload never runs."""
    sentinel = tmp_path / "pwned"
    folder = tiny.save_base_model(model, tokenizer, tmp_path / "mixed")
    write_malicious_pickle(folder / "training_args.bin", sentinel)
    write_malicious_pickle(folder / "pytorch_model.bin", sentinel)
    assert pickle_files(folder) == ["pytorch_model.bin", "training_args.bin"]
    assert pickle_refusal(folder) is None
    load_causal_lm(folder)
    load_sequence_classifier(folder)
    assert not sentinel.exists()


def test_config_naming_a_pickle_as_its_weights_is_refused(tmp_path, model, tokenizer):
    """config.json's transformers_weights makes from_pretrained load that file first, safetensors beside it
    or not (transformers lets adapter_model.bin through)."""
    folder = tiny.save_base_model(model, tokenizer, tmp_path / "explicit")
    write_malicious_pickle(folder / "adapter_model.bin", tmp_path / "pwned")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "transformers_weights": "adapter_model.bin"}))
    with pytest.raises(PickleRefusedError, match=r"refusing to load pickle files \(adapter_model.bin\)"):
        load_causal_lm(folder)
    assert not (tmp_path / "pwned").exists()


def test_engines_refuse_pickle_weights_without_an_opt_in(tmp_path, model, tokenizer):
    folder = bin_folder(model, tokenizer, tmp_path / "bin-model")
    with pytest.raises(PickleRefusedError, match="engines read safetensors only"):
        HFEngine.build(folder, EngineConfig(backend="hf", max_seq_len=32, max_batch_size=2), device="cpu")
