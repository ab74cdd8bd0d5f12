"""Greedy decoding and beam search replayed as a CUDA graph against the same decoding run eagerly
(skipped without CUDA)."""

import pytest
import torch

from training.model import T5Config, T5ForConditionalGeneration

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _model(backend: str = "auto") -> T5ForConditionalGeneration:
    """A tiny model whose EOS logit is 20 x the hidden state's first feature, so that with `_inputs`
    some rows end, at different steps, and some do not (fp32, bf16 and autocast; checked on CPU)."""
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config.from_preset("tiny", attention_backend=backend, num_layers=3))
    with torch.no_grad():
        model.lm_head.weight[model.config.eos_token_id] = 0.0
        model.lm_head.weight[model.config.eos_token_id, 0] = 20.0
    return model.cuda().eval()


def _inputs(batch: int = 6, length: int = 37):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 32128, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -11:] = 0
    mask[4, -30:] = 0
    return ids.cuda(), mask.cuda()


@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16-weights", "autocast"])
def test_cuda_graph_decoding_equals_eager(precision, num_beams):
    model = _model()
    if precision == "bf16-weights":
        model = model.to(torch.bfloat16)
    ids, mask = _inputs()
    kwargs = dict(attention_mask=mask, max_new_tokens=24, num_beams=num_beams)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "autocast"):
        eager = model.generate(ids, cuda_graph=False, **kwargs)
        graphed = model.generate(ids, **kwargs)
        again = model.generate(ids, **kwargs)  # a second graph, same buffers
    assert torch.equal(graphed, eager) and torch.equal(again, eager)
    finished = (eager == model.config.eos_token_id).any(dim=1)
    assert finished.any() and not finished.all(), "the test wants rows that end at different steps"


@pytest.mark.parametrize("num_beams", [1, 3])
def test_cuda_graph_decoding_matches_the_cpu_model(num_beams):
    """The graphed decode on the GPU (fp32, the fused kernels) gives the CPU model's tokens."""
    model = _model()
    ids, mask = _inputs()
    graphed = model.generate(ids, attention_mask=mask, max_new_tokens=16, num_beams=num_beams)
    cpu = _model("math").cpu()
    expected = cpu.generate(ids.cpu(), attention_mask=mask.cpu(), max_new_tokens=16, num_beams=num_beams)
    assert torch.equal(graphed.cpu(), expected)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_cuda_graph_decoding_frees_its_memory(num_beams):
    """Each call's caches and graph pool are released: repeated calls do not grow allocated memory."""
    model = _model()
    ids, mask = _inputs()
    model.generate(ids, attention_mask=mask, max_new_tokens=24, num_beams=num_beams)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for length in (37, 20, 37):  # different shapes: a new graph each time
        model.generate(ids[:, :length], attention_mask=mask[:, :length], max_new_tokens=24, num_beams=num_beams)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


@pytest.mark.parametrize("num_beams", [1, 3])
def test_one_step_never_captures(num_beams):
    model = _model()
    ids, mask = _inputs()
    kwargs = dict(attention_mask=mask, max_new_tokens=1, num_beams=num_beams)
    one = model.generate(ids, **kwargs)
    assert torch.equal(one, model.generate(ids, cuda_graph=False, **kwargs))
    assert one.shape == (6, 2)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_a_step_that_cannot_be_captured_goes_on_eagerly(monkeypatch, num_beams):
    """A step with a host sync cannot be captured: decoding warns and finishes with eager steps, and
    the tokens are the eager ones (capturing runs nothing, so no step ran twice)."""
    from training.model import generation

    model = _model()
    ids, mask = _inputs()
    kwargs = dict(attention_mask=mask, max_new_tokens=24, num_beams=num_beams)
    eager = model.generate(ids, cuda_graph=False, **kwargs)
    real = generation._decode_step

    def syncing_step(*args):
        logits = real(*args)
        if torch.cuda.is_current_stream_capturing():
            logits.sum().item()  # a copy to the host: not allowed while capturing
        return logits

    monkeypatch.setattr(generation, "_decode_step", syncing_step)
    with pytest.warns(UserWarning, match="could not be captured as a CUDA graph"):
        got = model.generate(ids, **kwargs)
    assert torch.equal(got, eager)
    torch.randint(0, 9, (4,), device="cuda")  # the failed capture gave the generator back its state
    monkeypatch.setattr(generation, "_decode_step", real)
    assert torch.equal(model.generate(ids, **kwargs), eager)  # graphs work again


@pytest.mark.parametrize("num_beams", [1, 3])
def test_cuda_graph_decoding_under_deterministic_algorithms(num_beams):
    """A run with `deterministic: true` evaluates under torch's deterministic algorithms (some ops,
    e.g. index_copy_, switch kernels): decoding still captures, without the fallback's warning, and
    gives the eager tokens."""
    import warnings

    from training.determinism import set_deterministic

    model = _model()
    ids, mask = _inputs()
    kwargs = dict(attention_mask=mask, max_new_tokens=24, num_beams=num_beams)
    eager = model.generate(ids, cuda_graph=False, **kwargs)
    set_deterministic(True)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="decoding could not be captured")
            graphed = model.generate(ids, **kwargs)
    finally:
        set_deterministic(False)
    assert torch.equal(graphed, eager)
