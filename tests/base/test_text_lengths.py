"""Lengths from raw text (issue 31 item 4): token counts of a text column with the training
tokenizer in one ``datasets.map`` pass (in order with num_proc, nothing truncated), through
``token_lengths`` / ``text_lengths``, ``SampleTable.from_dataset(tokenizer=, text_column=)`` and
``python -m balancer lengths``; a text-only dataset's error names the route."""
from __future__ import annotations

import json

import numpy as np
import pytest

from balancer.samples import SampleTable

datasets = pytest.importorskip("datasets")

WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran"]


def _texts(n=57, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(k))) for k in rng.integers(1, 40, n)]


def _hf_tokenizer(bos: bool):
    """A word-level tokenizer built in memory (nothing downloaded); with ``bos`` it adds one
    special token in front of every text."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                           special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   model_max_length=8)  # shorter than many texts: no truncation


def _words(texts):
    return [len(t.split()) for t in texts]


def split_tokenizer(texts):
    """A plain callable tokenizer (module level: picklable for num_proc)."""
    return [t.split() for t in texts]


@pytest.mark.parametrize("num_proc", [None, 2])
def test_token_lengths_adds_a_length_column_in_order(num_proc):
    from balancer.text_lengths import token_lengths
    texts = _texts()
    ds = datasets.Dataset.from_dict({"text": texts, "id": list(range(len(texts)))})
    out = token_lengths(ds, _hf_tokenizer(bos=True), num_proc=num_proc, batch_size=10,
                        progress=False)
    assert out.column_names == ["text", "id", "length"]
    assert out["id"] == list(range(len(texts)))
    assert out["length"] == [w + 1 for w in _words(texts)]  # BOS counted, > model_max_length kept
    assert out.features["length"].dtype == "int64"


def test_text_lengths_with_a_callable_and_without_special_tokens():
    from balancer.text_lengths import text_lengths
    texts = _texts(seed=1)
    ds = datasets.Dataset.from_dict({"body": texts})
    got = text_lengths(ds, split_tokenizer, "body", num_proc=2, progress=False)
    assert got.dtype == np.int64 and got.tolist() == _words(texts)
    got = text_lengths(ds, _hf_tokenizer(bos=True), "body", add_special_tokens=False,
                       progress=False)
    assert got.tolist() == _words(texts)


def test_from_dataset_counts_text_with_a_tokenizer():
    texts = _texts(seed=2)
    ds = datasets.Dataset.from_dict({"content": texts})
    t = SampleTable.from_dataset(ds, tokenizer=_hf_tokenizer(bos=False), text_column="content",
                                 num_proc=2)
    assert t.lengths.tolist() == _words(texts)
    # a length column, when there is one, is read and the tokenizer not used
    ds2 = ds.add_column("length", [5] * len(texts))
    assert SampleTable.from_dataset(ds2, tokenizer=split_tokenizer).lengths.tolist() == \
        [5] * len(texts)


def test_errors_name_the_route():
    ds = datasets.Dataset.from_dict({"text": ["a b", "c"]})
    with pytest.raises(ValueError, match="tokenizer=.*python -m balancer lengths"):
        SampleTable.from_dataset(ds)
    with pytest.raises(ValueError, match="no text column 'body'.*columns: \\['text'\\]"):
        SampleTable.from_dataset(ds, tokenizer=split_tokenizer, text_column="body")
    with pytest.raises(ValueError, match="needs tokenizer="):
        SampleTable.from_dataset(ds, text_column="text")
    with pytest.raises(ValueError, match="not both"):
        SampleTable.from_dataset(ds, tokens_column="x", tokenizer=split_tokenizer)
    bad = datasets.Dataset.from_dict({"text": ["a b", None, "c"]})
    with pytest.raises(ValueError, match="sample 1: text column .text. holds NoneType"):
        SampleTable.from_dataset(bad, tokenizer=split_tokenizer)
    empty = datasets.Dataset.from_dict({"text": ["a b", ""]})
    with pytest.raises(ValueError, match="sample 1: length 0"):
        SampleTable.from_dataset(empty, tokenizer=split_tokenizer)


def test_cli_lengths_writes_npy_and_dataset_then_precompute_reads_them(tmp_path, capsys):
    from balancer.cli import main
    texts = _texts(n=400, seed=3)
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok_dir = tmp_path / "tok"
    _hf_tokenizer(bos=True).save_pretrained(tok_dir)
    npy, saved = tmp_path / "lengths.npy", tmp_path / "with_lengths"
    assert main(["lengths", "--dataset", str(src), "--tokenizer", str(tok_dir), "--num-proc",
                 "2", "--out", str(npy), "--save-dataset", str(saved)]) == 0
    want = [w + 1 for w in _words(texts)]
    assert np.load(npy).tolist() == want
    assert "400 texts" in capsys.readouterr().out
    assert datasets.load_from_disk(str(saved))["length"] == want
    for src_flag in (["--lengths", str(npy)], ["--dataset", str(saved)]):
        out = tmp_path / f"plan{src_flag[0]}"
        assert main(["precompute", *src_flag, "--capacity", "64", "--dp", "2",
                     "--microbatches", "2", "--out", str(out), "--no-progress"]) == 0
    assert main(["lengths", "--dataset", str(src), "--tokenizer", str(tok_dir)]) == 2
    assert "--out" in capsys.readouterr().err


@pytest.mark.parametrize("num_proc", [None, 2])
def test_a_text_that_is_not_a_string_names_its_sample(num_proc):
    # was: "text 3 of the batch is NoneType None" for row 1003 (batches of 1000)
    texts = _texts(1500)
    texts[1003] = None
    ds = datasets.Dataset.from_dict({"text": texts})
    from balancer.text_lengths import text_lengths
    with pytest.raises(ValueError, match="sample 1003: text column 'text' holds NoneType None"):
        text_lengths(ds, split_tokenizer, num_proc=num_proc, progress=False)
