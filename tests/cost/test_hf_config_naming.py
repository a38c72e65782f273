"""A cost model loaded from a Hugging Face config.json is named after its model type and its
folder ("mistral (path/to/Mistral-7B)"), never "config" (the file's stem), so reports and plan
headers tell models apart; hidden_size that num_attention_heads does not divide, with no
head_dim to say the head width, is an error naming both values (with head_dim it is valid)."""
from __future__ import annotations

import json
import os

import pytest

from balancer.cost.cp import CPCostModel
from balancer.cost.model import load_cost_model

QWEN3 = {"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36,
         "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
         "intermediate_size": 12288, "vocab_size": 151936}


def _write(folder, cfg):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder / "config.json"


def test_a_config_json_is_named_by_model_type_and_folder(tmp_path, monkeypatch):
    p = _write(tmp_path / "models" / "Qwen3-8B", QWEN3)
    assert load_cost_model(str(p)).name == f"qwen3 ({p.parent})"
    monkeypatch.chdir(tmp_path)
    assert load_cost_model("models/Qwen3-8B/config.json").name == "qwen3 (models/Qwen3-8B)"
    # the config.json of the current folder: named by that folder, not "config"
    monkeypatch.chdir(p.parent)
    assert load_cost_model("config.json").name == "qwen3 (Qwen3-8B)"
    assert load_cost_model("./config.json").name == "qwen3 (Qwen3-8B)"
    # another file name keeps its stem as the folder does
    (p.parent / "qwen.json").write_text(json.dumps(QWEN3))
    assert load_cost_model("qwen.json").name == "qwen3 (qwen)"
    assert CPCostModel.from_preset("config.json", 4096).cost.name == "qwen3 (Qwen3-8B)"


def test_a_hub_snapshot_is_named_by_its_repository(tmp_path):
    snap = tmp_path / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / ("ab12" * 10)
    p = _write(snap, QWEN3)
    assert load_cost_model(str(p)).name == "qwen3 (Qwen/Qwen3-8B)"


def test_hidden_size_not_divisible_by_heads_needs_head_dim(tmp_path):
    bad = {k: v for k, v in QWEN3.items() if k != "head_dim"}
    bad["hidden_size"] = 4100
    p = _write(tmp_path / "bad", bad)
    with pytest.raises(ValueError, match=r"hidden_size 4100 .*num_attention_heads 32"):
        load_cost_model(str(p))
    # an explicit null is no head width either
    p = _write(tmp_path / "null", {**bad, "head_dim": None})
    with pytest.raises(ValueError, match=r"hidden_size 4100 .*num_attention_heads 32"):
        load_cost_model(str(p))
    # with head_dim (gemma, qwen3 configs give one) the same sizes are valid
    p = _write(tmp_path / "ok", {**bad, "head_dim": 128})
    assert load_cost_model(str(p)).forward.b > 0


def test_zero_heads_is_an_error_not_a_division_by_zero(tmp_path):
    p = _write(tmp_path / "zero", {**QWEN3, "num_attention_heads": 0, "head_dim": None})
    with pytest.raises(ValueError, match=r"num_attention_heads 0 must be at least 1"):
        load_cost_model(str(p))
