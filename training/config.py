"""Run configuration: typed, validated dataclasses, one per section of a run's YAML file.

    from training.config_loader import load_run_config
    cfg = load_run_config("training/configs/t5_base_c4.yaml", ["optim.base_lr=1e-2", "model.preset=small"])

Each field has its default and a docstring; `__post_init__` validates a section and says how to fix
a bad value (ConfigError). Reading YAML files, `key=value` overrides and typed parsing live in
training/config_loader.py, which depends on this module (never the reverse);
`python -m training.config_loader CONFIG.yaml [key=value ...]` prints a resolved config.
`micro_batch_size` and `eval_batch_size_per_rank` below derive per-rank sizes from a config and the
world size.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from training.cli_errors import ExpectedError

# Mirrors of training.model.config's choices (kept in sync by tests/test_config.py), so that a typo
# fails at config load, before any process group or model is built.
MODEL_PRESETS = ("tiny", "small", "base", "large", "xl", "xxl")
ATTENTION_BACKENDS = ("auto", "math", "sdpa", "triton")
RESIDUAL_DTYPES = ("float32", "autocast")
FFN_KERNELS = ("default", "quack")
ACTIVATION_CHECKPOINTING = ("none", "block", "selective")
ATTENTION_BIAS_LAYOUTS = ("auto", "dense", "row")
ZERO3_COMPILE_MODES = ("blocks", "pointwise")  # training.zero3_compile
COMPILE_SCOPES = ("model", "blocks")  # model.compile_scope at ZeRO 0-2
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")  # torch.compile
DEVICES = ("auto", "cuda", "cpu")
PRECISIONS = ("bf16", "fp32")
OPTIMIZERS = ("adamwscale", "adamw", "adafactor")
LR_SCHEDULERS = ("cosine", "legacy", "constant", "linear")
WANDB_MODES = ("offline", "online", "disabled")
OBJECTIVES = ("span_corruption", "ul2", "prefix_lm")  # training.data.objectives.OBJECTIVES
DENOISER_KINDS = ("span", "prefix")


class ConfigError(ExpectedError, ValueError):
    """A config value or key is invalid; the message says how to fix it (an error line and exit code
    2 at every entry point, training/cli_errors.py)."""


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not valid; use one of: {', '.join(choices)}")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


# ------------------------------------------------------------------------------------------------
# Sections
# ------------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    preset: str = "base"
    """Model size: tiny | small | base | large | xl | xxl (the presets of training.model.T5Config)."""
    dropout_rate: float = 0.0
    """Dropout probability in [0, 1). nanoT5 pre-trains with 0.0; T5 fine-tuning used 0.1."""
    attention_backend: str = "auto"
    """Attention implementation: auto (triton on a GPU, math on the CPU) | triton (the fused kernels
    with T5's bias; with dropout on, or decoding with a cache, sdpa runs instead) | sdpa (torch's
    scaled_dot_product_attention) | math (plain torch ops, the reference). training/model/attention.py."""
    residual_dtype: str = "float32"
    """Hidden states between blocks: float32 (HF numerics) | autocast (bf16 under bf16 precision, as
    T5X's activations; ~5% faster steps and 3 GiB less at T5-base batch 128 on an H100)."""
    ffn_kernel: str = "default"
    """Kernels of the gated FFN in training steps: default (cuBLAS GEMMs, Triton gated GELU) | quack
    (the GELU and its gradient in the epilogues of QuACK's GEMMs; needs `pip install '.[quack]'`,
    plus `nvidia-cutlass-dsl[cu13]==4.7.0` for a CUDA 13 torch, and a Hopper or newer GPU; ~4% faster
    steps and 3.9 GiB less at T5-base batch 128 on an H100, after 2-3 minutes of autotuning on the
    first step; over a 600-step schedule with three seeds its held-out loss matches the default's
    within 0.01. That gain is under ZeRO 0; under ZeRO 2 none is measurable)."""
    activation_checkpointing: str = "none"
    """What a training step keeps for its backward: none (everything: the fastest) | block (each
    block's inputs only; its forward runs again in the backward: for the largest models and the
    longest inputs) | selective (the GEMM and attention outputs; the element-wise ops run again).
    training/model/activation_checkpointing.py."""
    attention_bias_layout: str = "auto"
    """How the fused attention gets T5's relative bias: auto (as its (heads, q + k - 1) row from
    2048 x 2048 query x key pairs on, where that is the faster step; expanded below) | dense | row.
    The row keeps the bias and the backward's dS out of memory that grows with the square of the
    length (training/model/attention.py)."""
    compile: bool = True
    """torch.compile the model's forward. Ignored on CPU (compilation there costs more than it saves);
    under ZeRO 3 `zero3_compile` says what is compiled (DeepSpeed gathers the parameters in module
    hooks that a whole compiled forward would skip)."""
    compile_scope: str = "model"
    """What `compile` compiles at ZeRO 0-2: model (the whole forward as one graph: the fastest step) |
    blocks (each T5 block, the final norms and the loss on their own: the blocks of a stack share
    their compiled code, so the first step comes 2-3x sooner, and the step is ~4% slower; for short
    runs, docs/performance.md). ZeRO 3 takes `zero3_compile` instead."""
    compile_mode: str = "default"
    """torch.compile mode of the forward (ZeRO 0-2): default | reduce-overhead (CUDA graphs) |
    max-autotune-no-cudagraphs | max-autotune. T5 base on an H100: reduce-overhead runs at the
    default's speed; the max-autotune modes spend over 9 minutes compiling for GEMMs that cuBLAS
    nearly always wins. Under ZeRO 3 only default is accepted (`zero3_compile` there)."""
    zero3_compile: str = "blocks"
    """What `compile` compiles under ZeRO 3: blocks (each T5 block one graph, its parameters gathered
    in one all-gather) | pointwise (only the RMS norms and gated GELUs). training/zero3_compile.py."""
    compile_cache: str | None = "user"
    """Where torch.compile keeps what it compiled (inductor's and Triton's caches), so that a later
    process of the same code and shapes starts warm: user ($XDG_CACHE_HOME/t5ds/compile, by default
    ~/.cache/t5ds/compile: every run of this user, and on a cluster whose home directories are shared
    every node, so a requeue elsewhere too) | run (the run directory's compile_cache/: this run's
    ranks and restarts only) | a directory | null (torch's own: TORCHINDUCTOR_CACHE_DIR, else
    /tmp/torchinductor_$USER, per node)."""
    init_from: str | None = None
    """Optional weights to start from: a Hugging Face model dir or a nanoT5 state dict (.pt/.bin)."""
    vocab_size: int | None = None
    """Rows of the embedding and the head; null: the tokenizer's ids rounded up to a multiple of 128
    (32128 for T5's, 250112 for mT5's). training/vocabulary.py."""

    def __post_init__(self) -> None:
        _check_choice("model.preset", self.preset, MODEL_PRESETS)
        _check(self.vocab_size is None or self.vocab_size >= 1,
               f"model.vocab_size={self.vocab_size} must be >= 1, or null to take the tokenizer's")
        _check(
            0.0 <= self.dropout_rate < 1.0,
            f"model.dropout_rate={self.dropout_rate} must be in [0, 1); 0.0 is the pre-training default",
        )
        _check_choice("model.attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice("model.residual_dtype", self.residual_dtype, RESIDUAL_DTYPES)
        _check_choice("model.ffn_kernel", self.ffn_kernel, FFN_KERNELS)
        _check_choice("model.activation_checkpointing", self.activation_checkpointing, ACTIVATION_CHECKPOINTING)
        _check_choice("model.attention_bias_layout", self.attention_bias_layout, ATTENTION_BIAS_LAYOUTS)
        _check_choice("model.zero3_compile", self.zero3_compile, ZERO3_COMPILE_MODES)
        _check_choice("model.compile_mode", self.compile_mode, COMPILE_MODES)
        _check_choice("model.compile_scope", self.compile_scope, COMPILE_SCOPES)
        _check(self.compile_scope == "model" or self.compile_mode == "default",
               f"model.compile_scope=blocks compiles with torch.compile's default mode: set model.compile_mode=default "
               f"(it is {self.compile_mode}) or model.compile_scope=model")
        _check(
            self.init_from is None or bool(self.init_from),
            "model.init_from must be a path or null",
        )
        _check(self.compile_cache is None or bool(self.compile_cache),
               "model.compile_cache must be user, run, a directory or null")


@dataclass
class Source:
    """One corpus of a mixture (`data.sources`)."""

    dir: str = ""
    """Directory written by `python -m data_prep.shard`."""
    weight: float = 1.0
    """Share of the training samples, relative to the other sources' weights (> 0)."""
    name: str | None = None
    """Name in logs and metrics (eval_loss/<name>); null = the directory's last component."""


@dataclass
class Denoiser:
    """One denoiser of the ul2 / prefix_lm objectives (training/data/denoisers.py)."""

    kind: str = "span"
    """span (T5 span corruption: masked spans become sentinels) | prefix (prefix LM: the row's suffix
    is the target)."""
    rate: float = 0.15
    """span: share of the row's tokens masked, in (0, 1); prefix: mean share of the row in the
    target, in (0, 0.5] (the split point is uniform, T5's random_prefix_noise_mask)."""
    mean_span: float = 3.0
    """span: mean masked span length in tokens (>= 1); ignored when `spans` is set."""
    spans: int = 0
    """span: a fixed number of masked spans instead of `mean_span` (0 = from mean_span)."""
    mode_token: str = ""
    """Text prepended to the inputs (UL2's [NLU], [NLG], [S2S]); "" = none. Its pieces must be in
    the vocabulary."""
    weight: float = 1.0
    """Relative share of the samples (>= 0; normalised over the list)."""
    name: str = ""
    """Name in metrics (eval_loss/NAME); "" = derived from the parameters, e.g. span_mu3_r0.15."""

    def __post_init__(self) -> None:
        _check_choice("data.denoisers[].kind", self.kind, DENOISER_KINDS)
        if self.kind == "span":
            _check(0.0 < self.rate < 1.0, f"data.denoisers[].rate={self.rate} of a span denoiser must be in (0, 1)")
        else:
            _check(0.0 < self.rate <= 0.5,
                   f"data.denoisers[].rate={self.rate} of a prefix denoiser must be in (0, 0.5] (mean target share)")
        _check(self.mean_span >= 1.0, f"data.denoisers[].mean_span={self.mean_span} must be >= 1")
        _check(self.spans >= 0, f"data.denoisers[].spans={self.spans} must be >= 0 (0 = from mean_span)")
        _check(self.weight >= 0.0, f"data.denoisers[].weight={self.weight} must be >= 0")
        if not self.name:
            shape = f"spans{self.spans}" if self.spans else f"mu{self.mean_span:g}"
            self.name = f"span_{shape}_r{self.rate:g}" if self.kind == "span" else f"prefix_r{self.rate:g}"


# UL2 (Tay et al. 2022): R-denoisers [NLU], X-denoisers [NLG], the S-denoiser (prefix LM) [S2S], in
# the proportions FAT5 pre-trains its UL2 mixture with: R 33%, S 34%, X 33%, equal within R and X.
UL2_DENOISERS = (
    Denoiser("span", 0.15, 3.0, mode_token="[NLU]", weight=0.165, name="R_mu3_r0.15"),
    Denoiser("span", 0.15, 8.0, mode_token="[NLU]", weight=0.165, name="R_mu8_r0.15"),
    Denoiser("span", 0.5, 3.0, mode_token="[NLG]", weight=0.0825, name="X_mu3_r0.5"),
    Denoiser("span", 0.5, 8.0, mode_token="[NLG]", weight=0.0825, name="X_mu8_r0.5"),
    Denoiser("span", 0.15, 64.0, mode_token="[NLG]", weight=0.0825, name="X_mu64_r0.15"),
    Denoiser("span", 0.5, 64.0, mode_token="[NLG]", weight=0.0825, name="X_mu64_r0.5"),
    Denoiser("prefix", 0.25, mode_token="[S2S]", weight=0.34, name="S_prefix_r0.25"),
)
PREFIX_LM_DENOISERS = (Denoiser("prefix", 0.25),)


@dataclass
class DataConfig:
    dir: str | None = "data/c4_shards"
    """Directory written by `python -m data_prep.shard` (manifest.json, train/, validation/); null
    when `sources` names the corpora."""
    sources: tuple[Source, ...] = ()
    """A weighted mixture of corpora instead of `dir`, e.g. [{dir: a, weight: 3}, {dir: b, weight: 1}]:
    same tokenizer and row length; the interleave and its resume are in training/data/mixture.py."""
    tokenizer: str = "assets/t5/spiece.model"
    """SentencePiece .model file or Hugging Face tokenizer directory; its sha256, vocabulary size and
    sentinels must match those recorded in the shard manifest, and it sizes the model's vocabulary."""
    input_length: int = 512
    """Encoder input length in tokens after span corruption (the raw row is longer: 568 for 512)."""
    noise_density: float = 0.15
    """Fraction of raw tokens masked by span corruption, in (0, 1)."""
    mean_noise_span_length: float = 3.0
    """Mean masked span length in tokens (>= 1)."""
    objective: str = "span_corruption"
    """Pre-training objective: span_corruption (T5's, with the three settings above) | ul2 (UL2's
    mixture of denoisers) | prefix_lm (the S-denoiser alone). All read the same shards: rows of the
    raw length T5's formula gives for input_length (568 for 512). training/data/objectives.py."""
    denoisers: tuple[Denoiser, ...] = ()
    """The denoisers of ul2 / prefix_lm, each {kind, rate, mean_span, spans, mode_token, weight,
    name}; empty = the objective's default (UL2's seven; one prefix denoiser of rate 0.25)."""
    target_buckets: tuple[int, ...] = ()
    """Length-grouped micro-batches for ul2 / prefix_lm, e.g. [128, 256]: each optimizer step's
    micro-batches of a rank hold the same samples, sorted by target length, and each micro-batch's
    labels are as wide as the smallest of these widths (or the objective's target length, always
    the last) that holds its longest target; the gradient stays the ungrouped one. Ascending
    multiples of 8 below the target length (384 for UL2 at input_length 512). Empty = off (every
    micro-batch is target_length wide). Needs optim.grad_acc >= 2: with one micro-batch per step
    there is nothing to group. training/data/length_groups.py."""
    num_workers: int = 2
    """DataLoader worker processes per rank (0 = load in the training process)."""

    def __post_init__(self) -> None:
        _check(
            not (self.dir and self.sources),
            "data.dir and data.sources are both set: drop one (data.dir=null to train on the sources)",
        )
        _check(
            bool(self.dir) or bool(self.sources),
            "data.dir must name the shard directory written by data_prep.shard (or data.sources a mixture)",
        )
        self.sources = tuple(_named_source(s, k) for k, s in enumerate(self.sources))
        names = [s.name for s in self.sources]
        _check(len(set(names)) == len(names), f"data.sources have the same name twice ({names}): give each a name")
        _check(bool(self.tokenizer), "data.tokenizer must name a SentencePiece .model file or tokenizer directory")
        _check(self.input_length >= 8, f"data.input_length={self.input_length} must be >= 8 tokens")
        _check(
            0.0 < self.noise_density < 1.0,
            f"data.noise_density={self.noise_density} must be in (0, 1); T5 uses 0.15",
        )
        _check(
            self.mean_noise_span_length >= 1.0,
            f"data.mean_noise_span_length={self.mean_noise_span_length} must be >= 1; T5 uses 3.0",
        )
        _check(self.num_workers >= 0, f"data.num_workers={self.num_workers} must be >= 0")
        _check_choice("data.objective", self.objective, OBJECTIVES)
        _check(not self.denoisers or self.objective != "span_corruption",
               "data.denoisers applies to data.objective=ul2 or prefix_lm: set one of them or drop data.denoisers")
        _check(self.objective != "prefix_lm" or all(d.kind == "prefix" for d in self.denoisers),
               "data.objective=prefix_lm takes only denoisers of kind prefix; use data.objective=ul2 for span ones")
        weights = [d.weight for d in self.denoisers]
        _check(not weights or sum(weights) > 0,
               f"data.denoisers weights {weights} sum to 0: give at least one denoiser a positive weight")
        names = [d.name for d in self.denoisers]
        _check(len(set(names)) == len(names), f"data.denoisers names {names} repeat: give each a distinct name")
        _check(not self.target_buckets or self.objective != "span_corruption",
               "data.target_buckets applies to data.objective=ul2 or prefix_lm (span corruption's targets all have "
               "one length): drop data.target_buckets")
        buckets = list(self.target_buckets)
        _check(all(b > 0 and b % 8 == 0 for b in buckets) and buckets == sorted(set(buckets)),
               f"data.target_buckets={buckets} must be ascending multiples of 8, e.g. [128, 256]")
        shared = sorted({s.name for s in self.sources} & {d.name for d in self.objective_denoisers})
        _check(not shared, f"data.sources and the denoisers both use the name(s) {shared} (eval_loss/NAME): "
                           "rename the sources (data.sources[].name)")

    @property
    def objective_denoisers(self) -> tuple[Denoiser, ...]:
        """The denoisers the objective uses: data.denoisers, or the objective's default list."""
        if self.objective == "span_corruption":
            return ()
        return self.denoisers or (UL2_DENOISERS if self.objective == "ul2" else PREFIX_LM_DENOISERS)


def _named_source(source: Source, k: int) -> Source:
    _check(bool(source.dir), f"data.sources[{k}].dir must name a directory written by data_prep.shard")
    _check(
        source.weight > 0 and source.weight != float("inf"),
        f"data.sources[{k}].weight={source.weight} must be a number > 0 (a share relative to the others)",
    )
    name = source.name or source.dir.rstrip("/").rsplit("/", 1)[-1]
    return dataclasses.replace(source, name=name)


@dataclass
class OptimConfig:
    name: str = "adamwscale"
    """Optimizer: adamwscale (nanoT5's AdamW with RMS-scaled lr) | adamw | adafactor."""
    base_lr: float = 2e-2
    """Peak learning rate (after warmup). 2e-2 is nanoT5's value for adamwscale."""
    batch_size: int = 128
    """GLOBAL batch in sequences per optimizer step = micro_batch * grad_acc * world_size."""
    grad_acc: int = 1
    """Gradient accumulation steps (micro-batches per optimizer step on each rank)."""
    total_steps: int = 65536
    """Optimizer steps for the whole run (the schedule's length)."""
    warmup_steps: int = 10000
    """Linear warmup length in optimizer steps; must be < total_steps."""
    lr_scheduler: str = "cosine"
    """cosine | legacy (T5's inverse sqrt) | constant | linear."""
    final_cosine: float = 1e-5
    """Learning rate at the end of the cosine/linear decay (absolute, not a fraction of base_lr)."""
    weight_decay: float = 0.0
    """Decoupled weight decay coefficient (0 = none, nanoT5's setting)."""
    grad_clip: float = 1.0
    """Clip the global gradient L2 norm to this value; 0 disables clipping."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam (beta1, beta2), each in [0, 1)."""
    eps: float = 1e-6
    """Adam epsilon (> 0); 1e-6 is what nanoT5's AdamWScale uses."""
    max_nonfinite_steps: int = 10
    """Stop the run after this many consecutive skipped (non-finite loss or gradient) updates."""
    compile: bool = True
    """Run adamwscale's update of the model's tensors as one compiled Triton kernel instead of torch's
    foreach kernels (CUDA only; ignored on CPU, for the other optimizers and for DeepSpeed's flat
    partitions). Same arithmetic, rounded once per stored value."""

    def __post_init__(self) -> None:
        _check_choice("optim.name", self.name, OPTIMIZERS)
        _check_choice("optim.lr_scheduler", self.lr_scheduler, LR_SCHEDULERS)
        _check(self.base_lr > 0, f"optim.base_lr={self.base_lr} must be > 0 (e.g. 2e-2 for adamwscale)")
        _check(self.batch_size >= 1, f"optim.batch_size={self.batch_size} must be >= 1")
        _check(self.grad_acc >= 1, f"optim.grad_acc={self.grad_acc} must be >= 1")
        _check(
            self.batch_size % self.grad_acc == 0,
            f"optim.batch_size={self.batch_size} is not divisible by optim.grad_acc={self.grad_acc}: "
            f"pick grad_acc among the divisors of batch_size ({_divisors(self.batch_size)})",
        )
        _check(self.total_steps >= 1, f"optim.total_steps={self.total_steps} must be >= 1")
        _check(
            0 <= self.warmup_steps < self.total_steps,
            f"optim.warmup_steps={self.warmup_steps} must be in [0, total_steps={self.total_steps}); "
            "lower warmup_steps or raise total_steps",
        )
        _check(self.final_cosine >= 0, f"optim.final_cosine={self.final_cosine} must be >= 0")
        _check(self.weight_decay >= 0, f"optim.weight_decay={self.weight_decay} must be >= 0")
        _check(self.grad_clip >= 0, f"optim.grad_clip={self.grad_clip} must be >= 0 (0 disables clipping)")
        _check(
            len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
            f"optim.betas={self.betas} must be two numbers in [0, 1), e.g. optim.betas=0.9,0.999",
        )
        _check(self.eps > 0, f"optim.eps={self.eps} must be > 0")
        _check(
            self.max_nonfinite_steps >= 1,
            f"optim.max_nonfinite_steps={self.max_nonfinite_steps} must be >= 1",
        )


@dataclass
class EvalConfig:
    every_steps: int = 5000
    """Evaluate every this many optimizer steps; 0 = only at the end of the run."""
    max_samples: int | None = 12800
    """Validation sequences per evaluation; null or 0 = the whole validation split."""
    batch_size: int = 128
    """GLOBAL evaluation batch in sequences (split evenly over ranks)."""

    def __post_init__(self) -> None:
        _check(
            self.every_steps >= 0, f"eval.every_steps={self.every_steps} must be >= 0 (0 = only at the end)"
        )
        _check(
            self.max_samples is None or self.max_samples >= 0,
            f"eval.max_samples={self.max_samples} must be >= 0 or null (0/null = the whole split)",
        )
        _check(self.batch_size >= 1, f"eval.batch_size={self.batch_size} must be >= 1")


@dataclass
class CheckpointConfig:
    every_steps: int = 5000
    """Save a checkpoint every this many optimizer steps; 0 = only at the end of the run."""
    keep_last: int = 3
    """Keep this many newest checkpoints; older ones are deleted after a successful save."""
    at_end: bool = True
    """Save a checkpoint when the run reaches its last step or budget (false: benchmark and throwaway
    runs; a stop signal still checkpoints, so a requeued job never loses its progress)."""

    def __post_init__(self) -> None:
        _check(
            self.every_steps >= 0,
            f"checkpoint.every_steps={self.every_steps} must be >= 0 (0 = only at the end)",
        )
        _check(self.keep_last >= 1, f"checkpoint.keep_last={self.keep_last} must be >= 1")


@dataclass
class LoggingConfig:
    every_steps: int = 100
    """Log training metrics (loss, lr, grad norm, throughput) every this many optimizer steps."""
    wandb: str = "offline"
    """Weights & Biases mode: offline (files under output_dir, sync later) | online | disabled."""
    wandb_project: str = "t5ds"
    """W&B project name."""
    run_name: str | None = None
    """W&B run name; null = the output_dir's name."""

    def __post_init__(self) -> None:
        _check(self.every_steps >= 1, f"logging.every_steps={self.every_steps} must be >= 1")
        _check_choice("logging.wandb", self.wandb, WANDB_MODES)
        _check(bool(self.wandb_project), "logging.wandb_project must not be empty")


@dataclass
class BudgetConfig:
    hours: float | None = None
    """Wall-clock training budget in hours (cramming's `budget`): when spent, the run evaluates,
    checkpoints and stops, and the lr schedule is fitted to the budget. null = train total_steps."""

    def __post_init__(self) -> None:
        _check(
            self.hours is None or self.hours > 0,
            f"budget.hours={self.hours} must be > 0, or null for no budget",
        )


@dataclass
class RunConfig:
    output_dir: str = "runs/t5_base_c4"
    """Run directory: config.yaml (the resolved config), metrics.jsonl, checkpoints/ (training/run_dir.py)."""
    seed: int = 2137
    """Base random seed (model init, span corruption, data order)."""
    deterministic: bool = False
    """Bit-identical GPU runs from the same seed and data (training/determinism.py): ~3% slower
    steps for T5 base on an H100. Without it runs drift apart within tens of steps."""
    device: str = "auto"
    """auto (cuda when available, else cpu) | cuda | cpu."""
    precision: str = "bf16"
    """bf16 (bf16 autocast compute, fp32 master weights) | fp32. CPU runs always use fp32."""
    ds_config: str = "ds_configs/zero0.json"
    """DeepSpeed config json (ZeRO stage, buckets, offload); switching ZeRO stage = switching file.
    `auto` entries in it are filled from this config (training.ds_config.resolve_ds_config)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)

    def __post_init__(self) -> None:
        _check(bool(self.output_dir), "output_dir must name the run directory, e.g. runs/my_run")
        _check_choice("device", self.device, DEVICES)
        _check_choice("precision", self.precision, PRECISIONS)
        _check(bool(self.ds_config), "ds_config must name a DeepSpeed json, e.g. ds_configs/zero0.json")

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (tuples become lists), suitable for YAML/JSON and W&B."""
        return _to_plain(dataclasses.asdict(self))


def section_types(root: type) -> dict[str, type]:
    """The sections (dataclass-typed fields) of a root config class, by name."""
    # `from __future__ import annotations` leaves field types as strings: resolve them.
    return {name: hint for name, hint in typing.get_type_hints(root).items() if dataclasses.is_dataclass(hint)}


SECTION_TYPES: dict[str, type] = section_types(RunConfig)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _to_plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    return value


# ------------------------------------------------------------------------------------------------
# Derived quantities
# ------------------------------------------------------------------------------------------------


def micro_batch_size(cfg: RunConfig, world_size: int) -> int:
    """Per-rank micro batch (sequences per forward/backward) = batch_size / (grad_acc * world_size)."""
    if world_size < 1:
        raise ConfigError(f"world_size={world_size} must be >= 1")
    batch, acc = cfg.optim.batch_size, cfg.optim.grad_acc
    if batch % (acc * world_size) != 0:
        ok_acc = [a for a in range(1, batch + 1) if batch % (a * world_size) == 0]
        hint = (
            f"set optim.grad_acc to one of {ok_acc}"
            if ok_acc
            else f"make optim.batch_size a multiple of world_size={world_size}"
        )
        raise ConfigError(
            f"optim.batch_size={batch} is not divisible by optim.grad_acc * world_size = "
            f"{acc} * {world_size} = {acc * world_size}: {hint}, or set optim.batch_size to a multiple "
            f"of {acc * world_size} (e.g. {max(1, round(batch / (acc * world_size))) * acc * world_size})"
        )
    return batch // (acc * world_size)


def eval_batch_size_per_rank(cfg: RunConfig, world_size: int) -> int:
    """Per-rank evaluation batch = eval.batch_size / world_size."""
    if cfg.eval.batch_size % world_size != 0:
        raise ConfigError(
            f"eval.batch_size={cfg.eval.batch_size} is not divisible by world_size={world_size}; "
            f"set eval.batch_size to a multiple of {world_size}"
        )
    return cfg.eval.batch_size // world_size

