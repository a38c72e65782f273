"""The shipped Hugging Face config presets (issue #25 item 4): loadable by name, each with its
source, every field they need given (no default-value warning), plausible sizes."""
import warnings

import pytest

from balancer.cost.model import load_cost_model, preset_path, read_yaml

#: preset -> (total parameters, active matmul parameters per token) in billions, as published
HF_PRESETS = {"mistral-7b-v0.1": (7.2, 7.1), "gemma3-27b": (27.0, 27.0),
              "gpt-oss-20b": (20.9, 3.6), "qwen3-30b-a3b": (30.5, 3.0),
              "mixtral-8x7b": (46.7, 12.8), "qwen3-next-80b-a3b": (79.8, 3.7),
              "llama4-scout": (107.8, 16.1), "deepseek-v3": (671.0, 36.6)}


@pytest.mark.parametrize("name", sorted(HF_PRESETS))
def test_hf_preset_loads_by_name(name):
    doc = read_yaml(preset_path(name, "models"), "cost preset")
    assert "huggingface.co/" in doc["source"] and isinstance(doc["hf_config"], dict)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cost = load_cost_model(name)
    total, active = HF_PRESETS[name]
    assert cost.memory.fixed_bytes / 4 / 1e9 == pytest.approx(total, abs=0.1)
    assert cost.forward.b / 2 / 1e9 == pytest.approx(active, abs=0.1)
    assert cost.attention and cost.flops_per_second == 4e14
