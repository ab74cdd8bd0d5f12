"""DeepSpeed config files: load one from ds_configs/ and fill its "auto" entries from the run config.

The json files under ds_configs/ say HOW to train (ZeRO stage, buckets, offload, which mixed
precision mechanism); the run config (training.config.RunConfig) says WHAT to train (batch, grad
accumulation, clipping, precision). `resolve_ds_config` joins them:

- "auto" batch entries are filled: train_batch_size = optim.batch_size, gradient_accumulation_steps =
  optim.grad_acc, train_micro_batch_size_per_gpu = batch_size / (grad_acc * world_size),
  gradient_clipping = optim.grad_clip. An explicit number that disagrees with the run config is an
  error naming both values (a silent mismatch would train a different recipe than the YAML says).
- Precision: with precision=bf16 on a GPU, exactly one of `torch_autocast` (fp32 weights, bf16
  compute: the default of every shipped file) or `bf16` (DeepSpeed's bf16 weights + fp32 master
  copy) is enabled; "auto" picks torch_autocast, and a json with neither section gets torch_autocast. With precision=fp32, or on CPU, both are disabled
  (CPU runs in fp32), with a log line.
- `optimizer` / `scheduler` sections are rejected: the training loop builds its own optimizer and
  schedule from `optim.*` (use optim.name, optim.lr_scheduler).
- Keys the installed DeepSpeed does not know are rejected with the closest known one ("did you mean
  zero_optimization?"): DeepSpeed itself ignores an unknown top-level key (a misspelled
  `zero_optimization` trains at ZeRO 0) and rejects one inside `zero_optimization`, `bf16` or `fp16`
  with a long validation error. The known keys are read from DeepSpeed itself
  (`deepspeed_config_keys`).
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import logging
import typing
from pathlib import Path
from typing import Any

from training.config import ConfigError, RunConfig, micro_batch_size

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
AUTO = "auto"


class DSConfigError(ConfigError):
    """The DeepSpeed json is invalid or contradicts the run config; the message says what to change."""


def find_ds_config(path: str | Path) -> Path:
    """Locate a DeepSpeed json: as given (absolute or relative to the cwd), else relative to the repo root."""
    p = Path(path)
    if p.is_file():
        return p
    if not p.is_absolute() and (REPO_ROOT / p).is_file():
        return REPO_ROOT / p
    shipped = sorted(x.name for x in (REPO_ROOT / "ds_configs").glob("*.json"))
    raise DSConfigError(
        f"DeepSpeed config {path} not found; shipped configs in ds_configs/: {', '.join(shipped)}"
    )


def load_ds_config(path: str | Path) -> dict[str, Any]:
    p = find_ds_config(path)
    try:
        with open(p) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise DSConfigError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise DSConfigError(f"{p}: a DeepSpeed config must be a JSON object")
    return data


# Top-level keys DeepSpeed reads outside DeepSpeedConfig._initialize_params (deepspeed.initialize and
# DeepSpeedConfig's other methods).
_KEYS_READ_ELSEWHERE = ("sequence_parallel_size", "data_parallel_size", "vocabulary_size")


class _RecordingDict(dict):
    """A dict that remembers which keys were looked up in it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        self.read.add(key)
        return super().__contains__(key)

    def keys(self):  # `key in d.keys()` is how DeepSpeed tests for some sections
        recording = self

        class _Keys(typing.KeysView):
            def __contains__(self, key) -> bool:
                return recording.__contains__(key)

        return _Keys(self)


def _model_keys(model: type) -> dict[str, dict]:
    """A pydantic config model's keys (field names and aliases) -> the keys of a nested model ({}: none)."""
    import pydantic

    keys = {}
    for name, field in model.model_fields.items():
        nested = {}
        for candidate in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(candidate, type) and issubclass(candidate, pydantic.BaseModel):
                nested = _model_keys(candidate)
        for key in {name, field.alias} - {None}:
            keys[key] = nested
    return keys


@functools.cache
def deepspeed_config_keys() -> dict[str, dict]:
    """The keys the installed DeepSpeed accepts: top-level key -> {} or, for the sections DeepSpeed
    validates as a schema (zero_optimization, bf16, fp16), their keys (nested alike). The top level is
    what DeepSpeedConfig reads from a config, recorded as it parses an empty one."""
    # DeepSpeed imports take seconds; a run has imported them by the time it resolves its config.
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    recorder = _RecordingDict()
    DeepSpeedConfig.__new__(DeepSpeedConfig)._initialize_params(recorder)
    keys: dict[str, dict] = {key: {} for key in (*recorder.read, *_KEYS_READ_ELSEWHERE)}
    keys["zero_optimization"] = _model_keys(DeepSpeedZeroConfig)
    keys["bf16"] = keys["bfloat16"] = _model_keys(DeepSpeedBF16Config)
    keys["fp16"] = _model_keys(DeepSpeedFP16Config)
    return keys


def check_known_keys(ds: dict[str, Any], source: str, known: dict[str, dict] | None = None, where: str = "") -> None:
    """DSConfigError naming the first key of `ds` that DeepSpeed does not know, with the closest known one."""
    known = deepspeed_config_keys() if known is None else known
    for key, value in ds.items():
        if key not in known:
            import deepspeed
            from deepspeed.runtime import config as deepspeed_config

            removed_keys = {"": "_REMOVED_TOP_LEVEL_CONFIG_KEYS", "zero_optimization.": "_REMOVED_ZERO_CONFIG_KEYS"}
            removed = getattr(deepspeed_config, removed_keys.get(where, "-"), None) or {}
            if key in removed:  # DeepSpeed's own message says what replaced it
                raise DSConfigError(f'{source}: "{where}{key}": {removed[key]}')

            close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
            fix = f'did you mean "{where}{close[0]}"?' if close else (
                f"known keys{' in ' + where.rstrip('.') if where else ''}: {', '.join(sorted(known))}")
            effect = "ignores it, silently" if not where else "rejects it"
            raise DSConfigError(f'{source}: "{where}{key}" is not a DeepSpeed {deepspeed.__version__} config key '
                                f"(DeepSpeed {effect}): {fix}")
        if known[key] and isinstance(value, dict):
            check_known_keys(value, source, known[key], f"{where}{key}.")


def zero_stage(ds: dict[str, Any]) -> int:
    """ZeRO stage of a (resolved or not) DeepSpeed config dict; 0 when there is no zero section."""
    return int((ds.get("zero_optimization") or {}).get("stage", 0))


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == AUTO


def _fill(ds: dict[str, Any], key: str, expected: int | float, run_key: str, source: str) -> None:
    """Fill an "auto" (or missing) entry; raise if an explicit value contradicts the run config."""
    value = ds.get(key, AUTO)
    if _is_auto(value):
        ds[key] = expected
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or float(value) != float(expected):
        raise DSConfigError(
            f"{source}: {key}={value!r} contradicts the run config ({run_key} gives {expected!r}). "
            f'Set "{key}": "auto" in the json (recommended: the run config is the single source), '
            f"or change {run_key} to match"
        )
    ds[key] = value


def _enabled(section: Any) -> bool | str | None:
    """True / False / "auto" for a precision section, None when the section is absent."""
    if section is None:
        return None
    if not isinstance(section, dict):
        raise DSConfigError(f"precision section must be an object with an `enabled` key, got {section!r}")
    value = section.get("enabled", False)
    if _is_auto(value):
        return AUTO
    if not isinstance(value, bool):
        raise DSConfigError(f'"enabled" must be true, false or "auto", got {value!r}')
    return value


def _resolve_precision(ds: dict[str, Any], use_bf16: bool, source: str, reason: str) -> str:
    """Set torch_autocast/bf16 `enabled` flags; returns the mode: "torch_autocast" | "bf16" | "fp32"."""
    for key in ("fp16", "float16"):
        if _enabled(ds.get(key)) is True:
            raise DSConfigError(
                f"{source}: {key}.enabled=true is not supported (T5 overflows in fp16); remove the section "
                "and use precision=bf16 (torch_autocast) or precision=fp32"
            )
    if "bfloat16" in ds:  # DeepSpeed's older spelling of the bf16 section
        if "bf16" in ds:
            raise DSConfigError(f'{source}: has both "bf16" and "bfloat16" sections; keep only "bf16"')
        ds["bf16"] = ds.pop("bfloat16")
    autocast, bf16 = _enabled(ds.get("torch_autocast")), _enabled(ds.get("bf16"))

    if not use_bf16:
        explicit = [k for k, v in (("torch_autocast", autocast), ("bf16", bf16)) if v is True]
        log = logger.warning if explicit else logger.info
        log(
            "%s: running in fp32 (%s): disabling DeepSpeed bf16 sections%s",
            source,
            reason,
            f" (the json enables {', '.join(explicit)})" if explicit else "",
        )
        for key in ("torch_autocast", "bf16"):
            if key in ds:
                ds[key]["enabled"] = False
        return "fp32"

    if autocast is None and bf16 is None:  # the json leaves precision to the run config
        ds["torch_autocast"] = {"enabled": AUTO, "dtype": "bfloat16", "lower_precision_safe_modules": []}
        autocast = AUTO
    if autocast is True and bf16 is True:
        raise DSConfigError(
            f'{source}: both "torch_autocast" and "bf16" are enabled; enable one (torch_autocast = fp32 '
            "weights with bf16 compute, the nanoT5 recipe; bf16 = DeepSpeed bf16 weights with fp32 master copy)"
        )
    if autocast is True or (autocast == AUTO and bf16 is not True):
        mode = "torch_autocast"
    elif bf16 is True or bf16 == AUTO:
        mode = "bf16"
    else:
        raise DSConfigError(
            f"{source}: precision=bf16 but the json enables no bf16 mechanism; set "
            '"torch_autocast": {"enabled": "auto", "dtype": "bfloat16"} in the json, or run with precision=fp32'
        )
    if mode == "torch_autocast":
        ds["torch_autocast"]["enabled"] = True
        ds["torch_autocast"].setdefault("dtype", "bfloat16")
        if "bf16" in ds:
            ds["bf16"]["enabled"] = False
    else:
        ds["bf16"]["enabled"] = True
        if "torch_autocast" in ds:
            ds["torch_autocast"]["enabled"] = False
    logger.info("%s: bf16 mixed precision via %s", source, mode)
    return mode


def _find_autos(value: Any, prefix: str = "") -> list[str]:
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _find_autos(v, f"{prefix}{k}.")]
    return [prefix.rstrip(".")] if _is_auto(value) else []


def resolve_ds_config(
    ds: dict[str, Any] | str | Path,
    cfg: RunConfig,
    world_size: int,
    *,
    device_type: str | None = None,
) -> dict[str, Any]:
    """A DeepSpeed config dict ready for deepspeed.initialize: "auto" filled, contradictions raised.

    `ds` is a dict or a path (absolute, cwd-relative, or repo-relative like ds_configs/zero1.json).
    `device_type` is the device the run actually uses ("cuda" or "cpu"); None resolves cfg.device
    (auto = cuda when available). The input dict is not modified.
    """
    if isinstance(ds, (str, Path)):
        source = str(ds)
        ds = load_ds_config(ds)
    else:
        source = "DeepSpeed config"
    ds = copy.deepcopy(ds)
    check_known_keys(ds, source)

    for key, fix in (
        ("optimizer", "optim.name and optim.*"),
        ("scheduler", "optim.lr_scheduler and optim.*"),
    ):
        if key in ds:
            raise DSConfigError(
                f'{source}: has an "{key}" section, but t5ds builds its own optimizer and lr schedule; '
                f"remove the section and set {fix} in the run config instead"
            )

    micro = micro_batch_size(cfg, world_size)  # ConfigError with a fix when not divisible
    _fill(ds, "train_batch_size", cfg.optim.batch_size, "optim.batch_size", source)
    _fill(ds, "gradient_accumulation_steps", cfg.optim.grad_acc, "optim.grad_acc", source)
    _fill(
        ds,
        "train_micro_batch_size_per_gpu",
        micro,
        f"optim.batch_size / (optim.grad_acc * world_size={world_size})",
        source,
    )
    _fill(ds, "gradient_clipping", float(cfg.optim.grad_clip), "optim.grad_clip", source)

    if device_type is None:
        device_type = cfg.device
        if device_type == "auto":
            import torch  # here: the rest of this module reads json only, and torch takes seconds to import

            device_type = "cuda" if torch.cuda.is_available() else "cpu"
    use_bf16 = cfg.precision == "bf16" and device_type != "cpu"
    reason = "precision=fp32" if cfg.precision == "fp32" else "device is cpu"
    _resolve_precision(ds, use_bf16, source, reason)

    stage = zero_stage(ds)
    if stage not in (0, 1, 2, 3):
        raise DSConfigError(f"{source}: zero_optimization.stage={stage} must be 0, 1, 2 or 3")

    # DeepSpeed's throughput timer synchronises the whole device at the start of every forward and
    # at the end of every step (timers.throughput.synchronized defaults to true): two host stalls
    # per step that leave the GPU idle while the host queues the next kernels. The training loop
    # measures throughput itself, so the timer is off unless the config turns it on explicitly.
    ds.setdefault("timers", {}).setdefault("throughput", {}).setdefault("enabled", False)

    leftover = _find_autos(ds)
    if leftover:
        raise DSConfigError(
            f'{source}: entries {leftover} are "auto", which only train_batch_size, '
            "train_micro_batch_size_per_gpu, gradient_accumulation_steps, gradient_clipping and the "
            "precision sections' `enabled` support; give them explicit values"
        )
    return ds


def precision_mode(ds: dict[str, Any]) -> str:
    """Mixed-precision mode of a RESOLVED config: "torch_autocast" | "bf16" | "fp32"."""
    if (ds.get("torch_autocast") or {}).get("enabled") is True:
        return "torch_autocast"
    if (ds.get("bf16") or {}).get("enabled") is True:
        return "bf16"
    return "fp32"
