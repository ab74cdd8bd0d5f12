"""The QuACK FFN (training/model/quack_ffn.py, T5Config.ffn_kernel="quack").

On CPU: the bookkeeping around QuACK's two GEMMs (interleaved pre-activation, the interleaved rows of
[W0; W1] in the backward, the gradients back in the model's layout), with torch stand-ins for the
GEMMs, eager and through torch.compile; the fallback to the default FFN where QuACK cannot run; the
config checks. On a Hopper GPU with quack-kernels installed: the model's loss and gradients with
QuACK's kernels against the default FFN, eager and compiled.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from training.config import ConfigError
from training.config_loader import load_run_config
from training.model import T5Config, T5ForConditionalGeneration
from training.model import quack_ffn as qf
from training.model import triton_gated_gelu as tg

_GELU_C = math.sqrt(2 / math.pi)


def _gelu_tanh_and_grad(g):
    t = torch.tanh(_GELU_C * (g + 0.044715 * g**3))
    return 0.5 * g * (1 + t), 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * _GELU_C * (1 + 3 * 0.044715 * g * g)


def stand_in_gemm_gated(a, b, activation, concat_layout, tuned):
    """QuACK's gemm_gated as torch ops: b's columns [gate | lin] (concat_layout "B"); returns the
    pre-activation with gate and lin columns interleaved, and gelu_tanh(gate) * lin."""
    assert activation == "geglu" and concat_layout == ("B",)
    n = b.shape[1] // 2
    gate, lin = a @ b[:, :n], a @ b[:, n:]
    return torch.stack([gate, lin], -1).reshape(a.shape[0], 2 * n), _gelu_tanh_and_grad(gate)[0] * lin


def stand_in_gemm_dgated(a, b, preact, activation, tuned):
    """QuACK's gemm_dgated as torch ops: the interleaved pre-activation's gradient for upstream
    gradient a @ b, and the activation."""
    assert activation == "geglu"
    dh = a @ b
    gate, lin = preact[:, ::2], preact[:, 1::2]
    gelu, dgelu = _gelu_tanh_and_grad(gate)
    return torch.stack([dh * lin * dgelu, dh * gelu], -1).reshape(preact.shape), gelu * lin


def reference_ffn(x, wcat, wo):
    gate, lin = F.linear(x, wcat).chunk(2, dim=-1)
    return F.linear(F.gelu(gate, approximate="tanh") * lin, wo)


@pytest.fixture
def stand_ins(monkeypatch):
    monkeypatch.setattr(qf, "_gemm_gated", stand_in_gemm_gated)
    monkeypatch.setattr(qf, "_gemm_dgated", stand_in_gemm_dgated)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_epilogue_ffn_bookkeeping_gives_the_ffn_and_its_gradients(stand_ins, compiled):
    """With exact stand-ins for QuACK's GEMMs, EpilogueFFN's output and the gradients of x, [W0; W1]
    and Wo equal the plain FFN's in float64: a wrong interleave of the rows or of the gradient's
    halves would swap gate and lin. Compiled with fullgraph=True: no graph break around it."""
    torch.manual_seed(0)
    d, f, rows = 16, 24, 40
    leaves = [
        torch.randn(rows, d, dtype=torch.float64, requires_grad=True),
        torch.randn(2 * f, d, dtype=torch.float64, requires_grad=True),
        torch.randn(d, f, dtype=torch.float64, requires_grad=True),
    ]
    dy = torch.randn(rows, d, dtype=torch.float64)
    fn = qf.EpilogueFFN.apply
    if compiled:
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, dy)
    ref = reference_ffn(*leaves)
    ref_grads = torch.autograd.grad(ref, leaves, dy)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for name, g, r in zip(("x", "wcat", "wo"), grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


def test_the_model_falls_back_to_the_default_ffn_where_quack_cannot_run():
    """On CPU tensors a model configured for QuACK runs the default FFN: loss and gradients
    bit-identical to a default model with the same weights."""
    torch.manual_seed(0)
    default = T5ForConditionalGeneration(T5Config.from_preset("tiny", attention_backend="math"))
    quack = T5ForConditionalGeneration(T5Config.from_preset("tiny", attention_backend="math", ffn_kernel="quack"))
    quack.load_state_dict(default.state_dict())
    # (on a GPU machine with QuACK the modules are set up for it, and the CPU tensors still fall back)
    assert all(m.use_quack == qf.available() for m in quack.modules() if hasattr(m, "use_quack"))
    ids, labels = torch.randint(2, 32128, (2, 12)), torch.randint(2, 32128, (2, 7))
    results = []
    for model in (default, quack):
        loss = model(ids, labels=labels).loss
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


def test_applies_only_to_training_steps_of_cuda_tensors_without_dropout(stand_ins, monkeypatch):
    cuda_like = torch.empty(4, 768, device="meta")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: t.device.type == "meta"))
    assert qf.applies(cuda_like, 2048, dropout_active=False)
    assert not qf.applies(cuda_like, 2048, dropout_active=True)
    assert not qf.applies(torch.empty(4, 768), 2048, dropout_active=False)  # a CPU tensor
    assert not qf.applies(cuda_like, 2040, dropout_active=False)  # the gated output's width % 16
    with torch.no_grad():  # evaluation and generation: their shapes vary, each would autotune
        assert not qf.applies(cuda_like, 2048, dropout_active=False)


def test_config_checks_name_the_choices_and_what_quack_needs(monkeypatch):
    with pytest.raises(ValueError, match="ffn_kernel must be one of .*'quack'"):
        T5Config.from_preset("tiny", ffn_kernel="cutlass")
    with pytest.raises(ConfigError, match="model.ffn_kernel"):
        load_run_config(None, ["model.ffn_kernel=cutlass"])
    assert load_run_config(None, ["model.ffn_kernel=quack"]).model.ffn_kernel == "quack"
    # HF config.json files never carry it: a checkpoint trained with QuACK loads for anyone
    assert T5Config.from_hf_config({"ffn_kernel": "quack", "d_model": 64}).ffn_kernel == "default"
    monkeypatch.setattr(qf, "available", lambda: False)
    with pytest.raises(RuntimeError, match=r"pip install '\.\[quack\]'.*nvidia-cutlass-dsl\[cu13\].*model.ffn_kernel=default"):
        qf.load()


def test_a_run_asking_for_quack_where_it_cannot_run_stops_before_building_the_model(monkeypatch):
    from training.run_setup import build_model

    monkeypatch.setattr(qf, "available", lambda: False)
    section = load_run_config(None, ["model.preset=tiny", "model.ffn_kernel=quack"]).model
    with pytest.raises(RuntimeError, match="quack-kernels"):
        build_model(section, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not qf.available(), reason="needs quack-kernels and a CUDA GPU of compute capability >= 9")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_model_with_quack_ffn_matches_the_default_ffn_under_autocast(compiled, monkeypatch):
    """The tiny model (d_ff 128) in a bf16 autocast training step: loss and every gradient with QuACK's
    kernels (default tiles: this checks the math, not the speed) against the default FFN."""
    monkeypatch.setattr(qf, "TUNED", False)
    torch.manual_seed(0)
    default = T5ForConditionalGeneration(T5Config.from_preset("tiny", num_layers=3)).cuda()
    quack = T5ForConditionalGeneration(T5Config.from_preset("tiny", num_layers=3, ffn_kernel="quack")).cuda()
    quack.load_state_dict(default.state_dict())
    assert all(m.use_quack for m in quack.modules() if hasattr(m, "use_quack"))
    ids = torch.randint(2, 32128, (4, 128), device="cuda")
    labels = torch.randint(2, 32128, (4, 40), device="cuda")

    def run(model):
        def fn():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return model(ids, labels=labels).loss

        loss = torch.compile(fn, fullgraph=True)() if compiled else fn()
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    assert tg.kernel_applies(torch.empty(1, device="cuda"))  # the default FFN: the Triton GELU kernels
    ref_loss, ref_grads = run(default)
    loss, grads = run(quack)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=0)
    errors = {n: ((g - ref_grads[n]).norm() / ref_grads[n].norm()).item() for n, g in grads.items()}
    assert max(errors.values()) < 5e-2, sorted(errors.items(), key=lambda kv: -kv[1])[:5]
