"""Optimizer registry, AdamWScale against a per-tensor nanoT5 transcription, the non-finite guard,
the weight-norm helper and the flat-partition layout arithmetic (single process)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from training.optim import (
    OPTIMIZERS,
    AdamWScale,
    FlatLayout,
    build_optimizer,
    param_groups_no_decay,
    weight_l2_norm,
)
from training.optim.zero_layout import PADDING, segments_for_partition


class NanoT5AdamWScale(torch.optim.Optimizer):
    """Per-tensor reference: nanoT5/utils/copied_utils.py AdamWScale.step, transcribed."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, correct_bias=True):
        super().__init__(
            params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, correct_bias=correct_bias)
        )

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                beta1, beta2 = group["betas"]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                exp_avg.mul_(beta1).add_(grad, alpha=(1.0 - beta1))
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                denom = exp_avg_sq.sqrt().add_(group["eps"])
                step_size = group["lr"]
                if group["correct_bias"]:
                    bias_correction1 = 1.0 - beta1 ** state["step"]
                    bias_correction2 = 1.0 - beta2 ** state["step"]
                    step_size = step_size * math.sqrt(bias_correction2) / bias_correction1
                step_size = step_size * max(1e-3, p.norm(2) / (p.numel() ** 0.5))
                p.addcdiv_(exp_avg, denom, value=-step_size)
                if group["weight_decay"] > 0.0:
                    p.add_(p, alpha=(-group["lr"] * group["weight_decay"]))


class Toy(nn.Module):
    """Tensors whose RMS differs by orders of magnitude (one below the 1e-3 floor)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 32)
        self.layer_norm = nn.LayerNorm(32)
        self.out = nn.Linear(32, 50, bias=False)
        with torch.no_grad():
            self.out.weight.mul_(1e-3)

    def forward(self, x):
        return self.out(self.layer_norm(torch.relu(self.proj(self.emb(x)))))


def _train(model, opt, steps=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 50, (4, 9), generator=g)
        y = torch.randint(0, 50, (4, 9), generator=g)
        loss = nn.functional.cross_entropy(model(x).reshape(-1, 50), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_adamwscale_matches_nanot5_reference():
    torch.manual_seed(0)
    ours, ref = Toy(), Toy()
    ref.load_state_dict(ours.state_dict())
    opt = build_optimizer("adamwscale", ours, lr=2e-2, weight_decay=0.1, eps=1e-6)
    ref_opt = NanoT5AdamWScale(param_groups_no_decay(ref.named_parameters(), 0.1), lr=2e-2, eps=1e-6)
    w0 = {n: p.detach().clone() for n, p in ours.named_parameters()}
    _train(ours, opt)
    _train(ref, ref_opt)
    for (name, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
        p, q = p.detach(), q.detach()
        assert (p - w0[name]).abs().max() > 1e-5, f"{name} did not move"
        # 1e-6 of the tensor's scale: ours divides the denominator by the step size (a device
        # tensor) where nanoT5 multiplies by a Python float, a rounding difference (~1.6e-7 here).
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6 * float(q.abs().max()), msg=name)


def test_naive_rms_differs_from_reference():
    """Sanity check of the test design: one RMS for all tensors gives different weights."""
    torch.manual_seed(0)
    a, b = Toy(), Toy()
    b.load_state_dict(a.state_dict())
    flat_b = [torch.cat([p.detach().reshape(-1) for p in b.parameters()]).requires_grad_()]
    _train(a, build_optimizer("adamwscale", a, lr=2e-2))
    opt_b = AdamWScale(flat_b, lr=2e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(6):  # b's params are views rebuilt from the flat tensor each step
        x = torch.randint(0, 50, (4, 9), generator=g)
        y = torch.randint(0, 50, (4, 9), generator=g)
        views, off = {}, 0
        for n, p in b.named_parameters():
            views[n] = flat_b[0][off : off + p.numel()].view_as(p)
            off += p.numel()
        out = torch.func.functional_call(b, views, (x,))
        loss = nn.functional.cross_entropy(out.reshape(-1, 50), y.reshape(-1))
        opt_b.zero_grad()
        loss.backward()
        opt_b.step()
    full_a = torch.cat([p.detach().reshape(-1) for p in a.parameters()])
    assert (full_a - flat_b[0].detach()).abs().max() / full_a.abs().max() > 1e-3


def test_param_groups_follow_nanot5_no_decay_names():
    model = nn.ModuleDict(
        dict(
            lin=nn.Linear(4, 4),
            layer_norm=nn.LayerNorm(4),
            LayerNorm=nn.LayerNorm(4),
            relative_attention_bias=nn.Embedding(3, 2),
        )
    )
    opt = build_optimizer("adamw", model, lr=1e-3, weight_decay=0.1)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model["lin"].weight)}
    assert len(no_decay["params"]) == 6  # lin.bias, 2 x (norm weight, bias), relative_attention_bias


def test_frozen_params_left_out_and_empty_groups_dropped():
    model = nn.Linear(3, 3, bias=False)
    groups = param_groups_no_decay(model.named_parameters(), 0.0)
    assert len(groups) == 1
    model.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer("adamwscale", model, lr=1e-3)


def test_unknown_optimizer_lists_valid_names():
    with pytest.raises(ValueError, match="adafactor, adamw, adamwscale"):
        build_optimizer("sgd", nn.Linear(2, 2), lr=0.1)
    assert set(OPTIMIZERS) == {"adamwscale", "adamw", "adafactor"}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_trains_and_skips_nonfinite(name):
    torch.manual_seed(0)
    model = Toy()
    opt = build_optimizer(name, model, lr=1e-2)
    x = torch.randint(0, 50, (2, 5))
    model(x).sum().backward()
    model.proj.weight.grad[0, 0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert (opt.skipped_steps, opt.consecutive_skips) == (1, 1)
    model.proj.weight.grad[0, 0] = float("nan")  # adamwscale zeroed the grads of the skipped step
    opt.step()
    assert (opt.skipped_steps, opt.consecutive_skips) == (2, 2)
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert (opt.skipped_steps, opt.consecutive_skips) == (2, 0)


def test_guard_can_be_disabled():
    model = nn.Linear(2, 2)
    opt = build_optimizer("adamw", model, lr=1e-2, skip_nonfinite=False)
    model(torch.ones(1, 2)).sum().backward()
    model.weight.grad[0, 0] = float("inf")
    opt.step()
    assert opt.skipped_steps == 0 and not torch.isfinite(model.weight).all()


def _replace_with_flat(opt):
    """What DeepSpeed ZeRO does to the client optimizer: one flat fp32 tensor per group."""
    for group in opt.param_groups:
        flat = torch.cat([p.detach().reshape(-1) for p in group["params"]]).requires_grad_()
        flat.grad = torch.zeros_like(flat)
        group["params"] = [flat]


def test_adamwscale_refuses_unbound_flat_partitions():
    opt = build_optimizer("adamwscale", Toy(), lr=1e-3)
    _replace_with_flat(opt)
    with pytest.raises(RuntimeError, match="bind_zero_layout"):
        opt.step()
    with pytest.raises(RuntimeError, match="bind_zero_layout"):
        opt.weight_l2_norm()


def test_adafactor_refuses_flat_partitions():
    opt = build_optimizer("adafactor", Toy(), lr=1e-3)
    _replace_with_flat(opt)
    with pytest.raises(RuntimeError, match="ZeRO stage 0"):
        opt.step()


def test_adamw_accepts_flat_partitions_elementwise():
    opt = build_optimizer("adamw", Toy(), lr=1e-3)
    _replace_with_flat(opt)
    opt.step()  # element-wise: fine without a layout


def test_same_shaped_master_copies_are_whole_tensors():
    """DeepSpeed's bf16 ZeRO-0 wrapper swaps in fp32 copies with the model's shapes."""
    torch.manual_seed(0)
    a, b = Toy(), Toy()
    b.load_state_dict(a.state_dict())
    opt_a = build_optimizer("adamwscale", a, lr=2e-2)
    opt_b = build_optimizer("adamwscale", b, lr=2e-2)
    copies = []
    for group in opt_b.param_groups:
        group["params"] = [p.detach().clone().requires_grad_() for p in group["params"]]
        copies += group["params"]
    for opt, params in ((opt_a, list(a.parameters())), (opt_b, copies)):
        for p in params:
            p.grad = torch.full_like(p, 0.5)
        opt.step()
    flat_a = torch.cat([p.detach().reshape(-1) for g in opt_a.param_groups for p in g["params"]])
    flat_b = torch.cat([p.detach().reshape(-1) for p in copies])
    torch.testing.assert_close(flat_a, flat_b)


def test_same_shaped_copies_still_accepted_after_load_state_dict():
    model = Toy()
    opt = build_optimizer("adamwscale", model, lr=1e-2)
    for group in opt.param_groups:
        group["params"] = [p.detach().clone().requires_grad_() for p in group["params"]]
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    opt.step()
    opt.load_state_dict(opt.state_dict())  # torch builds new group dicts here
    opt.step()
    opt.settle()  # the step counts advance once the step's outcome is read (the deferred guard)
    assert all(s["step"] == 2 for s in opt.state.values())


def _padded_flat(tensors, pad: int) -> torch.Tensor:
    return torch.cat([t for x in tensors for t in (x.detach().reshape(-1), x.new_zeros(pad))])


def _bind_padded_flat(opt, pad: int) -> list:
    """What DeepSpeed ZeRO does, with a bound layout: each group becomes one flat tensor holding its
    tensors with `pad` elements of alignment padding after each."""
    layouts = []
    for group in opt.param_groups:
        spans, off = [], 0
        for j, p in enumerate(group["params"]):
            spans.append((j, off, p.numel()))
            off += p.numel() + pad
        lengths, index = segments_for_partition(spans, 0, off)
        flat = _padded_flat(group["params"], pad).requires_grad_()
        layouts.append(
            FlatLayout(lengths, index, [s[2] for s in spans], [str(s[0]) for s in spans], flat_param=flat)
        )
        group["params"] = [flat]
    opt.bind_flat_layouts(layouts)
    return layouts


def test_bound_layout_single_rank_equals_per_tensor_path():
    """A flat buffer with padding + a bound layout steps exactly like the per-tensor path."""
    torch.manual_seed(0)
    a, b = Toy(), Toy()
    b.load_state_dict(a.state_dict())
    opt_a = build_optimizer("adamwscale", a, lr=2e-2, weight_decay=0.1)
    opt_b = build_optimizer("adamwscale", b, lr=2e-2, weight_decay=0.1)
    pad = 3  # elements of alignment padding after every tensor
    layouts = _bind_padded_flat(opt_b, pad)
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        for ga, lay in zip(opt_a.param_groups, layouts):  # same group structure in both optimizers
            grads = [torch.randn(p.shape, generator=g) for p in ga["params"]]
            for p, gr in zip(ga["params"], grads):
                p.grad = gr
            lay.flat_param.grad = _padded_flat(grads, pad)
        opt_a.step()
        opt_b.step()
    for ga, lay in zip(opt_a.param_groups, layouts):
        flat = lay.flat_param.detach()
        off = 0
        for p in ga["params"]:
            torch.testing.assert_close(
                flat[off : off + p.numel()].view_as(p), p.detach(), rtol=1e-6, atol=1e-7
            )
            assert float(flat[off + p.numel() : off + p.numel() + pad].abs().sum()) == 0.0  # padding stays 0
            off += p.numel() + pad
    norm_a = math.sqrt(sum(float(p.detach().pow(2).sum()) for p in a.parameters()))
    assert weight_l2_norm(opt_b) == pytest.approx(norm_a, rel=1e-6)
    assert weight_l2_norm(opt_a) == pytest.approx(norm_a, rel=1e-6)


def test_segments_for_partition_cuts_mid_tensor():
    spans = [(0, 0, 10), (1, 12, 5), (2, 20, 4)]  # gaps: 10..12 and 17..20 padding, tail 24..28
    assert segments_for_partition(spans, 0, 14) == ([10, 2, 2], [0, PADDING, 1])
    assert segments_for_partition(spans, 14, 14) == ([3, 3, 4, 4], [1, PADDING, 2, PADDING])
    lengths, index = segments_for_partition(spans, 5, 3)
    assert (lengths, index) == ([3], [0])
    with pytest.raises(ValueError, match="overlap"):
        segments_for_partition([(0, 0, 5), (1, 3, 5)], 0, 8)


def test_flat_layout_validates():
    with pytest.raises(ValueError, match="outside"):
        FlatLayout([3], [2], [3], ["x"])
    with pytest.raises(ValueError, match="one entry per segment"):
        FlatLayout([3, 1], [0], [3], ["x"])


CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("flat", [False, True], ids=["tensors", "flat"])
def test_adamwscale_skipped_step_leaves_no_trace(flat, bad, device):
    """Steps (g1, g2 with one non-finite entry, g3) end exactly where (g1, g3) does: weights, both
    moments and the step counts of the bias correction; the deferred guard reports the skip a step
    late unless asked to wait."""

    def run(grad_seeds):
        torch.manual_seed(0)
        model = Toy().to(device)
        opt = build_optimizer("adamwscale", model, lr=2e-2, weight_decay=0.1)
        params = [p for group in opt.param_groups for p in group["params"]]
        sizes = [len(group["params"]) for group in opt.param_groups]
        layouts = _bind_padded_flat(opt, pad=2) if flat else None
        for seed in grad_seeds:
            g = torch.Generator().manual_seed(abs(seed))
            grads = [torch.randn(p.shape, generator=g).to(device) for p in params]
            if seed < 0:  # the bad step
                grads[1].view(-1)[3] = bad
            if flat:
                chunks = [grads[sum(sizes[:i]) : sum(sizes[: i + 1])] for i in range(len(sizes))]
                for lay, chunk in zip(layouts, chunks):
                    lay.flat_param.grad = _padded_flat(chunk, 2)
            else:
                for p, gr in zip(params, grads):
                    p.grad = gr
            opt.step()
            if seed < 0:
                assert opt.skip_counters(wait=False) == (0, 0)  # not read yet: no wait for the device
                assert opt.skip_counters() == (1, 1)
        state = opt.state_dict()["state"]
        weights = [lay.flat_param.detach() for lay in layouts] if flat else params
        return [w.detach().clone() for w in weights], state

    w_skip, s_skip = run([1, -2, 3])
    w_ref, s_ref = run([1, 3])
    assert all(torch.equal(a, b) for a, b in zip(w_skip, w_ref))
    assert s_skip.keys() == s_ref.keys()
    for k in s_ref:
        assert s_skip[k]["step"] == s_ref[k]["step"] == 2
        assert torch.equal(s_skip[k]["exp_avg"], s_ref[k]["exp_avg"])
        assert torch.equal(s_skip[k]["exp_avg_sq"], s_ref[k]["exp_avg_sq"])


def test_adamwscale_state_dict_settles_a_pending_skip():
    model = nn.Linear(3, 2)
    opt = build_optimizer("adamwscale", model, lr=1e-2)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    model.weight.grad[0, 0] = float("nan")
    opt.step()  # skipped; the host has not read it yet
    assert opt.skip_counters(wait=False) == (0, 0)
    state = opt.state_dict()
    assert [s["step"] for s in state["state"].values()] == [1, 1]
    assert opt.skip_counters(wait=False) == (1, 1)


def test_adamwscale_called_per_group_as_zero_does_waits_for_no_earlier_group():
    """DeepSpeed ZeRO 1-3 call step() once per parameter group in a row (the others hidden): the
    second call must not wait for the first's flag, and the result equals one call for both."""

    def run(per_group: bool):
        torch.manual_seed(0)
        model = Toy()
        opt = build_optimizer("adamwscale", model, lr=2e-2, weight_decay=0.1)
        assert len(opt.param_groups) == 2
        _train(model, opt, steps=2)  # state exists from here on
        g = torch.Generator().manual_seed(5)
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g)
            if per_group:
                groups = opt.param_groups
                for group in groups:
                    opt.param_groups = [group]
                    opt.step()
                opt.param_groups = groups
                assert len(opt._pending) == 2  # neither call waited for the other's outcome
            else:
                opt.step()
        opt.settle()
        return [p.detach().clone() for p in model.parameters()], [s["step"] for s in opt.state.values()]

    (w_split, steps_split), (w_one, steps_one) = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(w_split, w_one))
    assert steps_split == steps_one == [5] * len(steps_one)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_adamwscale_fused_matches_foreach_on_the_gpu():
    """`fused=True` runs the model-tensor path as one Triton kernel: the weights, moments and step
    counts of the foreach path over steps whose lr changes every step (a schedule), with weight decay
    and a skipped (non-finite) step, with fp32 and bf16 tensors in one group (two launches) and
    tensors of several kernel blocks. (tests/interpreted_kernels.py checks it on CPU.)"""

    def run(fused: bool):
        torch.manual_seed(0)
        params = [
            nn.Parameter(0.1 * torch.randn(shape, device="cuda")) for shape in [(300, 70), (5000,), (3,)]
        ]
        params.append(nn.Parameter(0.1 * torch.randn(4100, device="cuda", dtype=torch.bfloat16)))
        opt = AdamWScale(params, lr=2e-2, weight_decay=0.1, fused=fused)
        for step, lr in enumerate([2e-2, 1.5e-2, 1e-2, 7e-3, 5e-3]):
            for group in opt.param_groups:
                group["lr"] = lr
            g = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(p)
            if step == 2:
                params[1].grad.view(-1)[0] = float("nan")
            opt.step()
        assert opt.skip_counters() == (1, 0)  # (skipped in total, in a row)
        return [p.detach().clone() for p in params], opt.state_dict()["state"]

    w_ref, s_ref = run(False)
    w, s = run(True)
    for i, (a, b) in enumerate(zip(w, w_ref)):  # fp32: fused multiply-adds round in the last bit
        close = dict(rtol=2e-2, atol=1e-3) if a.dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(a, b, **close, msg=f"weight {i}")
        assert s[i]["step"] == s_ref[i]["step"] == 4
        for moment in ("exp_avg", "exp_avg_sq"):
            ref = s_ref[i][moment]
            if ref.dtype == torch.bfloat16:  # foreach rounds each op to bf16, the kernel once: 2 ulps
                close = dict(rtol=0, atol=float(ref.abs().max()) * 2**-6)
            torch.testing.assert_close(s[i][moment], ref, **close, msg=f"{moment} {i}")


@pytest.mark.parametrize("device,fused", [("cpu", False), pytest.param("cuda", False, marks=CUDA.marks),
                                          pytest.param("cuda", True, marks=CUDA.marks)],
                         ids=["cpu", "cuda-foreach", "cuda-fused"])  # fmt: skip
def test_adamwscale_clips_in_its_step_as_clip_grad_norm_before_it(device, fused):
    """`max_grad_norm`: the weights, moments, gradients and norms of torch's `clip_grad_norm_`
    followed by the step, over clipped steps, a step under the threshold and a skipped non-finite
    one; `last_grad_norm` is the norm before clipping. Eager the arithmetic is torch's own (equal
    to the bit); fused (one Triton kernel), its fused multiply-adds round in the last bit."""

    def run(in_step: bool):
        torch.manual_seed(0)
        model = Toy().to(device)
        opt = build_optimizer("adamwscale", model, lr=2e-2, weight_decay=0.1, fused=fused and in_step,
                              max_grad_norm=1.0 if in_step else 0.0)  # fmt: skip
        params = [p for group in opt.param_groups for p in group["params"]]
        norms, grads = [], []
        for step, scale in enumerate([3.0, 1e-3, 5.0, 2.0]):  # step 1 under the threshold
            g = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = (torch.randn(p.shape, generator=g) * scale).to(device)
            if step == 2:
                params[1].grad.view(-1)[0] = float("nan")
            if in_step:
                opt.step()
                norms.append(opt.last_grad_norm)
            else:
                norms.append(torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True))
                opt.step()
            grads.append([p.grad.clone() for p in params])
        assert opt.skip_counters() == (1, 0)  # (skipped in total, in a row)
        return [p.detach().clone() for p in params], opt.state_dict()["state"], norms, grads

    w_ref, s_ref, n_ref, g_ref = run(in_step=False)
    w, s, n, g = run(in_step=True)
    close = dict(rtol=0, atol=0) if not fused else dict(rtol=1e-6, atol=1e-7)
    assert float(n_ref[0]) > 1.0 > float(n_ref[1]) and math.isnan(float(n[2]))
    for a, b in zip(n, n_ref):
        torch.testing.assert_close(a, b, **close, equal_nan=True)
    for step_grads, step_ref in zip(g, g_ref):  # clipped in place (zeros on the skipped step)
        for a, b in zip(step_grads, step_ref):
            torch.testing.assert_close(a, b, **close)
    for a, b in zip(w, w_ref):
        torch.testing.assert_close(a, b, **close)
    for k in s_ref:
        assert s[k]["step"] == s_ref[k]["step"] == 3
        torch.testing.assert_close(s[k]["exp_avg"], s_ref[k]["exp_avg"], **close)
        torch.testing.assert_close(s[k]["exp_avg_sq"], s_ref[k]["exp_avg_sq"], **close)


def test_adamwscale_clipping_in_step_skips_an_overflowing_norm_and_refuses_flat_partitions():
    """The documented edges of clipping in the step: a gradient whose squares overflow float32 makes
    the norm inf, and the step is skipped (clipping first would have zeroed every gradient instead);
    flat partitions (ZeRO 1-3, where DeepSpeed clips) raise before anything changes."""
    model = nn.Linear(3, 2)
    opt = build_optimizer("adamwscale", model, lr=1e-2, max_grad_norm=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model.weight.grad[0, 0] = 1e20  # finite, but its square is not
    opt.step()
    assert math.isinf(float(opt.last_grad_norm)) and opt.skip_counters() == (1, 1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))

    opt = build_optimizer("adamwscale", Toy(), lr=1e-2, max_grad_norm=1.0)
    layouts = _bind_padded_flat(opt, pad=2)
    for lay in layouts:
        lay.flat_param.grad = torch.ones_like(lay.flat_param)
    flat_before = [lay.flat_param.detach().clone() for lay in layouts]
    with pytest.raises(RuntimeError, match="gradient_clipping"):
        opt.step()
    assert all(torch.equal(lay.flat_param, b) for lay, b in zip(layouts, flat_before))
    assert all(len(opt.state[lay.flat_param]) == 0 for lay in layouts)
    with pytest.raises(ValueError, match="max_grad_norm"):
        build_optimizer("adamwscale", model, lr=1e-2, max_grad_norm=-1.0)
