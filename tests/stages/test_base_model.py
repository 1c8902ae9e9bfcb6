"""The base stage imports model.base: pickle weights exit 2 unless model.allow_pickle, and are then published
as safetensors, so no later stage reads a pickle."""

from __future__ import annotations

import torch

from alignflow.config import TinyModelConfig
from alignflow.contract import StageResult, StageSpec
from alignflow.stages import base_model
from alignflow.stages.common.models import tiny
from alignflow.stages.common.models.loading import load_causal_lm, pickle_files

TINY = TinyModelConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                       num_hidden_layers=1, vocab_size=320, max_position_embeddings=64)


def run_base(tmp_path, model: dict, capsys) -> tuple[int, StageResult, str]:
    spec = StageSpec(stage="base", config={"model": {"device": "cpu", **model}},
                     output_uri=f"file://{tmp_path}/out", workdir=str(tmp_path))
    code = base_model.main(["--spec", str(spec.dump(tmp_path / "spec.json"))])
    out, err = capsys.readouterr()
    return code, StageResult.model_validate_json(out.strip().splitlines()[-1]), err


def test_pickle_weights_exit_2_unless_allowed_then_publish_as_safetensors(tmp_path, capsys):
    tokenizer = tiny.train_tokenizer(["a pickle is a jar of code", "safetensors hold tensors"] * 20, 320)
    model = tiny.make_tiny_model(TINY, tokenizer, seed=0)
    folder = tmp_path / "bin-model"
    folder.mkdir()
    model.config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")

    code, result, stderr = run_base(tmp_path, {"base": str(folder)}, capsys)
    assert (code, result.status) == (2, "failed")
    line = f"error: base: model.base: {folder}: refusing to load pickle files (pytorch_model.bin)"
    assert stderr.startswith(line) and "model.allow_pickle=true" in stderr
    assert len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()

    code, result, stderr = run_base(tmp_path, {"base": str(folder), "allow_pickle": True}, capsys)
    assert (code, result.status) == (0, "ok"), stderr
    out = tmp_path / "out"
    assert (out / "model.safetensors").is_file() and pickle_files(out) == []
    published = load_causal_lm(out)  # safetensors only: no opt-in needed downstream
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(published.state_dict()[name], tensor, rtol=0, atol=0)
