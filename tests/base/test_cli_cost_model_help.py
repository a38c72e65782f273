"""Every command that takes ``--cost-model`` says in its --help that a Hugging Face config.json
is one (load_cost_model reads it: docs/cost-models.md)."""
from __future__ import annotations

import pytest

from balancer.cli.app import main


@pytest.mark.parametrize("command", ["compare", "report", "precompute"])
def test_cost_model_help_names_config_json(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    i = text.index("--cost-model COST_MODEL ")
    assert "config.json" in text[i:i + 300], text[i:i + 300]
