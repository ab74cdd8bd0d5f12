"""Pre-training T5 for another language, end to end on CPU, on the bundled German and French text
(assets/debian-reference): train a tokenizer, shard, pre-train the tiny model, export, load with
transformers (tokenize and decode with sentinels, generate), fine-tune from the run with its tokenizer.
And the refusals: a tokenizer without sentinels, shards of another tokenizer, starting weights of
another vocabulary, a model.vocab_size below the tokenizer's."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data_prep.shard import ShardConfig, run_sharding
from data_prep.tokenizer import UL2_MODE_TOKENS, load_tokenizer, train_sentencepiece
from training.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO / "assets" / "debian-reference"
PIECES = 2000
TINY = ["--config", "training/configs/tiny_demo.yaml", "optim.total_steps=6", "optim.warmup_steps=1",
        "optim.batch_size=8", "logging.every_steps=1", "eval.every_steps=0", "eval.max_samples=16",
        "eval.batch_size=8", "checkpoint.every_steps=0", "data.input_length=64", "data.num_workers=0"]


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def run(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    prefix = tmp_path_factory.mktemp("tok") / "defr"
    train_sentencepiece(str(TEXT / "*-train.jsonl.gz"), PIECES, str(prefix), num_threads=2,
                        seed_sentencepiece_size=50_000)
    return Path(f"{prefix}.model")


@pytest.fixture(scope="module")
def shards(tokenizer, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "defr"
    run_sharding(ShardConfig(input=str(TEXT / "*-train.jsonl.gz"), validation_input=str(TEXT / "*-validation.jsonl.gz"),
                             output=str(out), tokenizer=str(tokenizer), input_length=64, rows_per_shard=1024,
                             workers=0, progress=False))
    return out


@pytest.fixture(scope="module")
def pretrained(tokenizer, shards, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "defr"
    run("training/pretrain.py", *TINY, f"output_dir={out}", f"data.dir={shards}", f"data.tokenizer={tokenizer}")
    return out


def test_trained_tokenizer_is_t5_shaped(tokenizer):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
    assert [sp.id_to_piece(i) for i in range(6)] == ["<pad>", "</s>", "<unk>", *UL2_MODE_TOKENS]
    text = "Größenänderung ✓ « déjà » 😀"
    assert sp.unk_id() not in sp.encode(text) and sp.decode(sp.encode(text)) == text  # byte fallback
    from training.data.objectives import sentencepiece_mode_ids

    assert [sentencepiece_mode_ids(str(tokenizer))(t) for t in UL2_MODE_TOKENS] == [(3,), (4,), (5,)]  # one id each
    info = load_tokenizer(tokenizer).info
    assert (info.vocab_size, info.sentinel_start_id, info.num_sentinels) == (PIECES + 100, PIECES + 99, 100)
    hf = load_tokenizer(f"{tokenizer.with_suffix('')}-hf").info  # the same vocabulary as a directory
    assert (hf.kind, hf.vocab_size, hf.sentinel_start_id, hf.num_sentinels, hf.eos_id, hf.pad_id) == (
        "huggingface", PIECES + 100, PIECES + 99, 100, 1, 0)


def test_tokenizer_cli_options_info_and_export_of_a_directory(tokenizer, tmp_path, capsys):
    from transformers import AutoTokenizer

    from data_prep import tokenizer as tokenizer_cli
    from training.model.hf_compat import _write_tokenizer

    prefix = tmp_path / "few"
    assert tokenizer_cli.main(["train", "--input", str(TEXT / "fr-validation.jsonl.gz"), "--vocab-size", "400",
                               "--output", str(prefix), "--extra-ids", "10", "--mode-tokens", "",
                               "--num-threads", "1"]) == 0
    assert "(+10 sentinels = vocab_size 410)" in capsys.readouterr().out
    assert tokenizer_cli.main(["info", f"{prefix}-hf"]) == 0
    info = capsys.readouterr().out
    assert "'vocab_size': 410" in info and "'sentinel_start_id': 409" in info and "'num_sentinels': 10" in info
    assert AutoTokenizer.from_pretrained(f"{prefix}-hf").convert_ids_to_tokens(3) != "[NLU]"
    assert tokenizer_cli.main(["info", str(tmp_path / "missing.model")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1

    _write_tokenizer(Path(f"{tokenizer.with_suffix('')}-hf"), tmp_path)  # export copies a directory as it is
    assert len(AutoTokenizer.from_pretrained(tmp_path)) == PIECES + 100


def test_vocabulary_too_large_for_the_row_dtype():
    from data_prep.shard_format import token_dtype

    assert token_dtype(250_100).name == "uint32" and token_dtype(32_100).name == "uint16"
    with pytest.raises(ValueError, match="does not fit the shards' largest token type"):
        token_dtype(2**32 + 1)


def test_shards_record_the_tokenizer(shards, tokenizer):
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["tokenizer"]["sha256"] == load_tokenizer(tokenizer).info.sha256
    assert (manifest["tokenizer"]["sentinel_start_id"], manifest["dtype"]) == (PIECES + 99, "uint16")
    assert manifest["splits"]["train"]["rows"] > 100 and manifest["splits"]["validation"]["rows"] > 8


def test_pretrain_export_and_generate_with_transformers(pretrained, tokenizer, tmp_path):
    import torch
    from transformers import AutoTokenizer, T5ForConditionalGeneration

    from training import export

    model_config = json.loads((pretrained / "model_config.json").read_text())
    assert model_config["vocab_size"] == 2176  # 2100 ids rounded up to a multiple of 128
    loss = [r["loss"] for r in read_metrics(pretrained / "metrics.jsonl", "train")]
    assert len(loss) == 6 and loss[-1] < loss[0]

    hf_dir = tmp_path / "hf"
    assert export.main([str(pretrained), str(hf_dir)]) == 0
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = T5ForConditionalGeneration.from_pretrained(hf_dir).eval()
    assert len(tok) == PIECES + 100 and model.config.vocab_size == 2176
    ids = tok("Die Datei wird <extra_id_0> kopiert. [NLU]").input_ids
    assert tok.convert_tokens_to_ids(["<extra_id_0>", "<extra_id_99>", "[NLU]"]) == [PIECES + 99, PIECES, 3]
    assert PIECES + 99 in ids and 3 in ids and ids[-1] == 1
    assert tok.decode(ids, skip_special_tokens=True).split() == "Die Datei wird kopiert. [NLU]".split()
    assert tok.decode(ids, skip_special_tokens=False).startswith("Die Datei wird<extra_id_0> kopiert.")
    batch = tok(["Die Datei wird <extra_id_0> kopiert.", "Le fichier est <extra_id_0>."], return_tensors="pt",
                padding=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=8, do_sample=False)
    assert out.shape[0] == 2 and out.shape[1] > 1 and int(out.max()) < 2176
    assert all(isinstance(t, str) for t in tok.batch_decode(out, skip_special_tokens=True))


def test_finetune_takes_the_tokenizer_of_its_init_run(pretrained, tokenizer, tmp_path):
    out = tmp_path / "ft"
    run("training/finetune.py", "--config", "training/configs/sni_tiny.yaml", f"output_dir={out}",
        f"init={pretrained}", "data.epochs=1", "data.max_train_tasks=2", "eval.max_tasks=1",
        "eval.max_instances_per_task=2", "optim.total_steps=2", "checkpoint.at_end=false")
    assert f"tokenizer: {tokenizer}" in (out / "config.yaml").read_text()
    assert json.loads((out / "model_config.json").read_text())["vocab_size"] == 2176


def test_refusals(pretrained, tokenizer, shards, tmp_path, spiece_path, capsys):
    """Each a one-line error of the entry points (ExpectedError / ValueError under expected_errors)."""
    from transformers import T5Tokenizer

    from data_prep import shard
    from training.cli_errors import ExpectedError
    from training.config import DataConfig
    from training.data import PretrainBatches
    from training.data.objectives import build_objective
    from training.vocabulary import check_init_vocabulary, init_tokenizer, run_vocabulary

    assert init_tokenizer(str(pretrained)) == str(tokenizer)
    vocab = run_vocabulary(tokenizer)
    with pytest.raises(ExpectedError, match="model.vocab_size=2048 is smaller than the 2100 ids"):
        run_vocabulary(tokenizer, 2048)
    with pytest.raises(ExpectedError, match="has a vocabulary of 32128 entries.*data.tokenizer"):
        check_init_vocabulary("t5-run", 32128, vocab)  # T5 weights, this tokenizer
    with pytest.raises(ExpectedError, match="has a vocabulary of 2176 entries.*data.tokenizer"):
        check_init_vocabulary(str(pretrained), 2176, run_vocabulary(spiece_path))  # this run, T5's tokenizer
    sentinels = {"sentinel_start_id": vocab.sentinel_start_id, "num_sentinels": vocab.tokenizer.num_sentinels}
    build_objective(DataConfig(input_length=512, tokenizer=str(tokenizer)), **sentinels)  # 28 spans
    for objective in ("span_corruption", "prefix_lm"):  # prefix_lm (needs no sentinels) evaluates span corruption too
        data = DataConfig(objective=objective, input_length=3700, tokenizer=str(tokenizer))
        with pytest.raises(ExpectedError, match="makes 205 noise spans a row.*has 100 sentinels"):
            build_objective(data, mode_ids=lambda text: (), **sentinels)
    t5 = run_vocabulary(spiece_path)
    with pytest.raises(ValueError, match="Re-shard the corpus with the run's tokenizer"):
        PretrainBatches(shards, rank=0, world_size=1, micro_batch_size=2, grad_acc=1, seed=0, input_length=64,
                        expected_tokenizer_sha256=t5.tokenizer.sha256, vocab_size=t5.model_vocab_size,
                        sentinel_start_id=t5.sentinel_start_id, num_workers=0)

    no_sentinels = tmp_path / "nosent"
    no_sentinels.mkdir()
    (no_sentinels / "spiece.model").write_bytes(spiece_path.read_bytes())
    T5Tokenizer.from_pretrained(str(no_sentinels), extra_ids=0).save_pretrained(str(no_sentinels))
    with pytest.raises(ExpectedError, match="no sentinel tokens <extra_id_0>"):
        run_vocabulary(no_sentinels)
    capsys.readouterr()
    assert shard.main(["--input", str(TEXT / "de-validation.jsonl.gz"), "--output", str(tmp_path / "e"),
                       "--tokenizer", str(no_sentinels), "--workers", "0", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no sentinel tokens <extra_id_0>" in err[0] and not (tmp_path / "e").exists()


MT5_IDS = 250_100  # mT5's tokenizer: 250000 pieces + 100 sentinels; its model has 250112 rows


@pytest.fixture(scope="module")
def mt5_sized_tokenizer(tmp_path_factory) -> Path:
    """A Hugging Face tokenizer directory of mT5's size whose sentinels count down from 250099; the
    words of the German validation text get the ids just below them, so shards need uint32."""
    import gzip

    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    with gzip.open(TEXT / "de-validation.jsonl.gz", "rt") as f:
        words = sorted({w for line in f for w in json.loads(line)["text"].split()})
    pieces = ["<pad>", "</s>", "<unk>"] + [f"<filler{i}>" for i in range(MT5_IDS - 100 - 3 - len(words))] + words
    sentinels = [f"<extra_id_{k}>" for k in range(100)]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(pieces + sentinels[::-1])}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single=["$A", "</s>"], special_tokens=[("</s>", 1)])
    out = tmp_path_factory.mktemp("mt5") / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
                            extra_special_tokens=sentinels).save_pretrained(str(out))
    return out


@pytest.mark.slow
def test_mt5_size_vocabulary_uint32_shards_sentinels_and_fused_loss(mt5_sized_tokenizer, tmp_path):
    import torch

    from training.data import PretrainBatches
    from training.model import T5Config, T5ForConditionalGeneration
    from training.vocabulary import run_vocabulary

    out = tmp_path / "shards"
    manifest = run_sharding(ShardConfig(input=str(TEXT / "de-validation.jsonl.gz"), output=str(out),
                                        tokenizer=str(mt5_sized_tokenizer), input_length=64, workers=0,
                                        progress=False))
    assert (manifest["dtype"], manifest["tokenizer"]["vocab_size"]) == ("uint32", MT5_IDS)
    vocab = run_vocabulary(mt5_sized_tokenizer)
    assert (vocab.model_vocab_size, vocab.sentinel_start_id) == (250_112, 250_099)
    batch = next(iter(PretrainBatches(out, rank=0, world_size=1, micro_batch_size=4, grad_acc=1, seed=0,
                                      input_length=64, expected_tokenizer_sha256=vocab.tokenizer.sha256,
                                      vocab_size=vocab.model_vocab_size, sentinel_start_id=vocab.sentinel_start_id,
                                      num_workers=0)))
    ids = batch["input_ids"]
    assert int(ids.max()) == 250_099 and int(ids[(ids > 1) & (ids < 250_000)].min()) > 65_535  # sentinels, words

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config.from_preset("tiny", vocab_size=vocab.model_vocab_size))
    fused = model(input_ids=batch["input_ids"], labels=batch["labels"], return_logits=False).loss
    fused.backward()
    fused_grad = model.lm_head.weight.grad.clone()
    model.zero_grad()
    logits = model(input_ids=batch["input_ids"], labels=batch["labels"]).logits
    reference = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
    reference.backward()
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_grad, model.lm_head.weight.grad, rtol=1e-4, atol=1e-7)

    # ZeRO 3 partitions the 250112 x 64 embedding and head: two steps of the tiny model from these shards
    run_dir = tmp_path / "zero3"
    run("training/pretrain.py", *TINY, "optim.total_steps=2", f"output_dir={run_dir}", f"data.dir={out}",
        f"data.tokenizer={mt5_sized_tokenizer}", "--deepspeed_config", "ds_configs/zero3.json")
    assert json.loads((run_dir / "model_config.json").read_text())["vocab_size"] == 250_112
    assert [math.isfinite(r["loss"]) for r in read_metrics(run_dir / "metrics.jsonl", "train")] == [True, True]
