"""Load Hugging Face / nanoT5 checkpoints into our T5 and export HF model directories.

Our parameter names are HF's, so loading is a key clean-up (prefixes, tied aliases) plus dtype
conversion. The exported directory loads with transformers' `T5ForConditionalGeneration
.from_pretrained`; what each transformers version does with T5 v1.1's untied head is in
docs/model.md (`untie_hf_lm_head` makes any version keep it).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from training.model.config import T5Config
from training.model.t5 import T5ForConditionalGeneration

logger = logging.getLogger(__name__)

_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.pt")
# save_pretrained's default shard size in transformers 5 (4.x: "5GB"); a test compares it with the
# installed transformers'.
DEFAULT_MAX_SHARD_SIZE = "50GB"
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# Prefixes that wrappers add to parameter names: torch.compile, DDP/DeepSpeed, nanoT5/accelerate.
_STRIP_PREFIXES = ("_orig_mod.", "module.", "model.")


def read_weight_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A state dict from a .safetensors or torch (.bin/.pt) file; a {"model": sd} / {"module": sd} wrapper is
    unwrapped."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(str(path), map_location="cpu", weights_only=True)
    for key in ("model", "module", "state_dict"):
        if isinstance(state, dict) and key in state and isinstance(state[key], dict):
            state = state[key]
    if not isinstance(state, dict):
        raise ValueError(f"{path} does not hold a state dict (got {type(state).__name__})")
    return state


def _read_directory_weights(directory: Path) -> dict[str, torch.Tensor]:
    for index_name in _INDEX_FILES:  # sharded checkpoints (t5-v1_1-xl/xxl)
        index = directory / index_name
        if index.exists():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            state: dict[str, torch.Tensor] = {}
            for shard in shards:
                state.update(read_weight_file(directory / shard))
            return state
    for name in _WEIGHT_FILES:
        if (directory / name).exists():
            return read_weight_file(directory / name)
    raise FileNotFoundError(
        f"no weights in {directory}: expected one of {_WEIGHT_FILES + _INDEX_FILES} "
        "(download the full HF model directory, or pass the weight file itself)"
    )


def clean_state_dict(
    state: dict[str, torch.Tensor], model: T5ForConditionalGeneration
) -> dict[str, torch.Tensor]:
    """Strip wrapper prefixes, drop non-parameter entries HF files may carry, convert to the model's dtype."""
    expected = set(model.state_dict().keys())
    cleaned: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = key
        changed = True
        while changed and name not in expected:
            changed = False
            for prefix in _STRIP_PREFIXES:
                if name.startswith(prefix):
                    name, changed = name[len(prefix) :], True
        if name in expected:
            cleaned[name] = value.float() if value.is_floating_point() else value
        else:
            logger.warning("ignoring checkpoint entry %s (not a T5 parameter)", key)
    return cleaned


def load_pretrained(
    path: str | os.PathLike,
    preset: str | None = None,
    config: T5Config | None = None,
    **config_overrides: Any,
) -> T5ForConditionalGeneration:
    """Our T5 from an HF model directory (config.json + weights) or a plain state-dict file/directory.

    path: an HF directory (e.g. a local google/t5-v1_1-base), or a nanoT5 / torch / safetensors weight
    file (or a directory holding one without config.json), which then needs `preset` (e.g. "base") or
    `config`. config_overrides (e.g. attention_backend="math", dropout_rate=0.0) apply on top.
    Missing or unexpected parameters raise.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    hf_config_path = path / "config.json" if path.is_dir() else None
    if config is None and hf_config_path is not None and hf_config_path.exists():
        config = T5Config.from_hf_config(json.loads(hf_config_path.read_text()), **config_overrides)
    elif config is None and preset is not None:
        config = T5Config.from_preset(preset, **config_overrides)
    elif config is None:
        raise ValueError(
            f"{path} has no config.json: pass preset='base' (or another T5 v1.1 preset) or config=T5Config(...)"
        )
    elif config_overrides:
        config = T5Config(**{**config.__dict__, **config_overrides})
    state = _read_directory_weights(path) if path.is_dir() else read_weight_file(path)
    model = T5ForConditionalGeneration(config)
    model.load_state_dict(clean_state_dict(state, model), strict=True)
    logger.info("loaded %s (%.1fM parameters) from %s", config, model.num_parameters() / 1e6, path)
    return model


def hf_state_dict(model: T5ForConditionalGeneration) -> dict[str, torch.Tensor]:
    """HF-named tensors for a file: one entry per distinct tensor (the embedding aliases dropped)."""
    state = model.state_dict()
    out = {}
    for name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        state.pop(name, None)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for key, value in state.items():
        out[key] = value.detach().to("cpu").contiguous()
    return out


def save_hf_directory(
    model: T5ForConditionalGeneration,
    out_dir: str | os.PathLike,
    tokenizer_path: str | os.PathLike | None = None,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: str = "float32",
) -> Path:
    """Write what `save_pretrained` writes: config.json, generation_config.json, the weights as
    safetensors (one model.safetensors, or shards of at most `max_shard_size` with
    model.safetensors.index.json) and, given the SentencePiece model, the tokenizer files.

    dtype: "float32" or "bfloat16" for the weights. The directory loads with transformers'
    `T5ForConditionalGeneration.from_pretrained` and `AutoTokenizer.from_pretrained`. Files are
    written to a temporary directory first and renamed, so a crash leaves no half-written export
    under out_dir; every file gets the mode the umask gives a new file.
    """
    from huggingface_hub import save_torch_state_dict

    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(EXPORT_DTYPES)}, got {dtype!r}")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty; choose a new directory or remove it")
    tmp = out_dir.with_name(out_dir.name + ".tmp-export")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    hf_config = {**model.config.to_hf_config(), "torch_dtype": dtype}
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    _write_generation_config(model.config, tmp)
    state = {name: tensor.to(EXPORT_DTYPES[dtype]) for name, tensor in hf_state_dict(model).items()}
    save_torch_state_dict(state, tmp, max_shard_size=max_shard_size)
    if tokenizer_path is not None:
        _write_tokenizer(Path(tokenizer_path), tmp)
    _give_files_the_umask_mode(tmp, like=tmp / "config.json")
    if out_dir.exists():
        out_dir.rmdir()
    tmp.rename(out_dir)
    return out_dir


def _write_generation_config(config: T5Config, out_dir: Path) -> None:
    """generation_config.json with T5's special ids, as save_pretrained writes it."""
    from transformers import GenerationConfig

    GenerationConfig(decoder_start_token_id=config.decoder_start_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(str(out_dir))


def _give_files_the_umask_mode(directory: Path, like: Path) -> None:
    """safetensors writes its files with mode 0600 whatever the umask; give every file the mode of
    `like`, a file opened the ordinary way (0666 less the umask)."""
    mode = like.stat().st_mode & 0o777
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(mode)


def _write_tokenizer(tokenizer: Path, out_dir: Path) -> None:
    """The tokenizer files: a Hugging Face tokenizer directory's, copied; for a SentencePiece model,
    spiece.model and the transformers files with its 100 sentinels <extra_id_*> (data_prep.tokenizer)."""
    from data_prep.tokenizer import HF_TOKENIZER_FILES, write_hf_tokenizer

    if tokenizer.is_dir():
        for name in HF_TOKENIZER_FILES:
            if (tokenizer / name).is_file():
                shutil.copy(tokenizer / name, out_dir / name)
        return
    if not tokenizer.is_file():
        raise FileNotFoundError(f"SentencePiece model {tokenizer} not found (e.g. assets/t5/spiece.model)")
    write_hf_tokenizer(tokenizer, out_dir)


def untie_hf_lm_head(hf_model, model_dir: str | os.PathLike) -> None:
    """Make a T5 v1.1 model that transformers 5 loaded with from_pretrained keep its own head: lm_head
    its own Parameter with the file's `lm_head.weight`, no decoder output scaling (5.0.0 scales),
    and `tie_word_embeddings=False` in its config (5.x reads True: a later `tie_weights()` ties the
    head, and under 5.0.0 a save_pretrained and reload scales the outputs)."""
    state = _read_directory_weights(Path(model_dir))
    if "lm_head.weight" not in state:
        raise ValueError(f"{model_dir} has no lm_head.weight: the checkpoint really is tied (original T5)")
    hf_model.config.tie_word_embeddings = False
    if hasattr(hf_model.config, "scale_decoder_outputs"):
        hf_model.config.scale_decoder_outputs = False
    weight = state["lm_head.weight"].to(
        dtype=hf_model.lm_head.weight.dtype, device=hf_model.lm_head.weight.device
    )
    hf_model.lm_head.weight = torch.nn.Parameter(weight.clone())
