"""The Hugging Face export (`save_hf_directory`, `python -m training.export`): sharding as
save_pretrained does it, file modes, generation config, bf16, and transformers loading the result
with our model's logits and tokens."""

from __future__ import annotations

import inspect
import json
import os
import stat

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.test_model_hf_compat import _batch as hf_compat_batch  # noqa: E402
from tests.test_model_hf_compat import tiny_model  # noqa: E402
from training.export import main as export_main  # noqa: E402
from training.model import T5ForConditionalGeneration  # noqa: E402
from training.model.hf_compat import (  # noqa: E402
    DEFAULT_MAX_SHARD_SIZE,
    hf_state_dict,
    load_pretrained,
    save_hf_directory,
    untie_hf_lm_head,
)


@pytest.fixture(scope="module")
def model() -> T5ForConditionalGeneration:
    return tiny_model()


def _batch():
    return hf_compat_batch(high=32000)  # ids of the tokenizer's pieces (below its sentinels)


def _logits(m, input_ids, mask, dec, hf: bool = False) -> torch.Tensor:
    with torch.no_grad():
        if hf:
            return m(input_ids=input_ids, attention_mask=mask, decoder_input_ids=dec).logits
        return m(input_ids, attention_mask=mask, decoder_input_ids=dec).logits


def _load_hf(path, **kwargs):
    return transformers.T5ForConditionalGeneration.from_pretrained(path, attn_implementation="eager", **kwargs).eval()


def test_a_sharded_export_loads_in_transformers_with_our_logits(model, tmp_path, spiece_path):
    out = save_hf_directory(model, tmp_path / "export", tokenizer_path=spiece_path, max_shard_size="2MB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    assert all((out / name).is_file() for name in shards)
    assert set(index["weight_map"]) == set(hf_state_dict(model))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in hf_state_dict(model).values())

    batch = _batch()
    ours = _logits(model, *batch)
    # transformers 4 reads tie_word_embeddings=false; 5.1 and later (5.0.0 is excluded in setup.cfg)
    # keep the file's lm_head untied and do not scale the decoder's output: the plain load is right.
    hf = _load_hf(out)
    assert hf.lm_head.weight.data_ptr() != hf.shared.weight.data_ptr()
    torch.testing.assert_close(_logits(hf, *batch, hf=True), ours, rtol=1e-5, atol=1e-4)
    # untie_hf_lm_head also makes a later tie_weights() (resize_token_embeddings calls it) keep the head
    untie_hf_lm_head(hf, out)
    hf.tie_weights()
    assert hf.lm_head.weight.data_ptr() != hf.shared.weight.data_ptr()
    torch.testing.assert_close(_logits(hf, *batch, hf=True), ours, rtol=1e-5, atol=1e-4)
    # our own loader reads the index and its shards
    assert torch.equal(_logits(load_pretrained(out, attention_backend="math").eval(), *batch), ours)


def test_the_default_shard_size_is_save_pretrained_s(model, tmp_path):
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("the default follows transformers 5's save_pretrained")
    default = inspect.signature(transformers.PreTrainedModel.save_pretrained).parameters["max_shard_size"].default
    assert DEFAULT_MAX_SHARD_SIZE == default
    out = save_hf_directory(model, tmp_path / "export")
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_files_get_the_mode_the_umask_gives(model, tmp_path, spiece_path, umask):
    old = os.umask(umask)
    try:
        out = save_hf_directory(model, tmp_path / "export", tokenizer_path=spiece_path, max_shard_size="4MB")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert any(name.endswith(".safetensors") for name in modes)
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask


def test_generation_config_makes_transformers_generate_our_tokens(model, tmp_path):
    out = save_hf_directory(model, tmp_path / "export")
    written = json.loads((out / "generation_config.json").read_text())
    assert (written["decoder_start_token_id"], written["eos_token_id"], written["pad_token_id"]) == (
        model.config.decoder_start_token_id, model.config.eos_token_id, model.config.pad_token_id)
    hf = _load_hf(out)
    input_ids, mask, _ = _batch()
    with torch.no_grad():
        theirs = hf.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=8, do_sample=False, num_beams=1)
        ours = model.generate(input_ids, attention_mask=mask, max_new_tokens=8)
    assert torch.equal(theirs, ours[:, : theirs.shape[1]])


def test_a_bfloat16_export_holds_the_rounded_weights(model, tmp_path):
    from safetensors import safe_open

    out = save_hf_directory(model, tmp_path / "export", dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(name).dtype for name in f.keys()} == {torch.bfloat16}
    rounded = T5ForConditionalGeneration(model.config).eval()
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    batch = _batch()
    expected = _logits(rounded, *batch)
    assert not torch.equal(expected, _logits(model, *batch))  # the rounding is visible
    assert torch.equal(_logits(load_pretrained(out, attention_backend="math").eval(), *batch), expected)
    hf = _load_hf(out, dtype=torch.float32)
    torch.testing.assert_close(_logits(hf, *batch, hf=True), expected, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="dtype"):
        save_hf_directory(model, tmp_path / "other", dtype="float16")


def test_the_command_refuses_bad_input_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        export_main([str(tmp_path), str(tmp_path / "out"), "--max-shard-size", "5XB"])
    assert exit_info.value.code == 2 and "--max-shard-size" in capsys.readouterr().err
    assert export_main([str(tmp_path / "not_a_run"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "not a run directory" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert export_main([str(tmp_path), str(tmp_path / "full")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    assert not (tmp_path / "out").exists()
