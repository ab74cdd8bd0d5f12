"""Export to an HF directory, load it with transformers and with our loader; nanoT5 state dicts."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from training.model import T5Config, T5ForConditionalGeneration  # noqa: E402
from training.model.hf_compat import load_pretrained, save_hf_directory, untie_hf_lm_head  # noqa: E402


def tiny_model() -> T5ForConditionalGeneration:
    """The tiny T5 (math attention, seed 0) in eval mode that the export tests compare (also tests/test_export.py)."""
    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config.from_preset("tiny", attention_backend="math")).eval()


@pytest.fixture(scope="module")
def model() -> T5ForConditionalGeneration:
    return tiny_model()


def _batch(high: int = 32128):
    """(input_ids with the second sequence's last 3 positions masked, their mask, decoder ids): ids in [2, high)."""
    g = torch.Generator().manual_seed(5)
    input_ids = torch.randint(2, high, (2, 12), generator=g)
    mask = torch.ones_like(input_ids)
    mask[1, -3:] = 0
    dec = torch.randint(2, high, (2, 6), generator=g)
    return input_ids, mask, dec


def test_export_loads_in_transformers_with_identical_logits(model, tmp_path, spiece_path):
    out = save_hf_directory(model, tmp_path / "export", tokenizer_path=spiece_path)
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "spiece.model", "tokenizer_config.json"} <= files
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False

    hf = transformers.T5ForConditionalGeneration.from_pretrained(out, attn_implementation="eager").eval()
    untie_hf_lm_head(hf, out)
    assert hf.lm_head.weight.data_ptr() != hf.shared.weight.data_ptr()
    input_ids, mask, dec = _batch()
    with torch.no_grad():
        ours = model(input_ids, attention_mask=mask, decoder_input_ids=dec).logits
        theirs = hf(input_ids=input_ids, attention_mask=mask, decoder_input_ids=dec).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-4)

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.pad_token_id == 0 and tokenizer.eos_token_id == 1
    assert tokenizer.convert_tokens_to_ids("<extra_id_0>") == 32099
    assert tokenizer("Hello world").input_ids[-1] == 1


def test_our_loader_reads_the_export(model, tmp_path):
    out = save_hf_directory(model, tmp_path / "export")
    loaded = load_pretrained(out, attention_backend="math").eval()
    assert loaded.config == model.config
    input_ids, mask, dec = _batch()
    with torch.no_grad():
        a = model(input_ids, attention_mask=mask, decoder_input_ids=dec).logits
        b = loaded(input_ids, attention_mask=mask, decoder_input_ids=dec).logits
    assert torch.equal(a, b)
    with pytest.raises(FileExistsError):
        save_hf_directory(model, out)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_nanot5_style_state_dict_loads(model, tmp_path, suffix):
    # nanoT5 saves the (compiled) model's state dict: HF names, maybe with a torch.compile prefix.
    state = {f"_orig_mod.{k}": v.clone() for k, v in model.state_dict().items()}
    path = tmp_path / f"pytorch_model{suffix}"
    if suffix == ".safetensors":
        from safetensors.torch import save_file

        state = {k: v for k, v in state.items() if "embed_tokens" not in k}  # safetensors refuses aliases
        save_file(state, str(path))
    else:
        torch.save(state, path)
    with pytest.raises(ValueError, match="preset"):
        load_pretrained(path)
    loaded = load_pretrained(path, preset="tiny", attention_backend="math").eval()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_loading_a_wrong_size_checkpoint_fails_clearly(model, tmp_path):
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_pretrained(path, preset="tiny", d_ff=256)
