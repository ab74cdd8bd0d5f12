"""training/run_setup.py: how the forward is compiled (`model.compile_mode`) and where that is refused."""

from __future__ import annotations

import pytest
import torch

from training.config import load_run_config
from training.run_setup import compile_forward, start_engine


@pytest.mark.parametrize("mode, expected", [("default", None), ("reduce-overhead", "reduce-overhead"),
                                            ("max-autotune-no-cudagraphs", "max-autotune-no-cudagraphs")])
def test_compile_forward_passes_the_mode(monkeypatch, mode, expected):
    calls = []

    def fake_compile(fn, **kwargs):
        calls.append(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    model = torch.nn.Linear(2, 2)
    compile_forward(model, mode)
    assert calls == [dict(fullgraph=True, mode=expected)]


def test_a_compile_mode_under_zero3_is_refused_before_the_engine_starts(tmp_path):
    cfg = load_run_config(None, ["model.preset=tiny", "model.compile_mode=reduce-overhead"])
    ds_config = {"zero_optimization": {"stage": 3}, "gradient_clipping": 1.0, "train_batch_size": 8}
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="model.compile_mode=default"):
        start_engine(cfg, model, None, None, ds_config, tmp_path, rank=0, world_size=1, device=torch.device("cpu"))
    assert list(tmp_path.iterdir()) == []  # nothing written
