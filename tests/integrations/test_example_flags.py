"""The examples' numeric flags refuse values they cannot run with, as argparse errors naming
the flag (exit 2), before any process starts: before, ``--world 0`` printed nothing and
exited 0, ``--capacity 0`` or ``--stop-after -1`` ended in tracebacks from the spawned ranks,
``--dp 0`` in a pydantic traceback, ``--samples -5`` in numpy's 'negative dimensions'."""
import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples"


def _module(name):
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.mark.parametrize("script,flag,value", [
    ("rl_rollout_balance", "--world", "0"), ("rl_rollout_balance", "--capacity", "0"),
    ("rl_rollout_balance", "--steps", "0"), ("rl_rollout_balance", "--batch", "-1"),
    ("stream_balance", "--world", "0"), ("stream_balance", "--stop-after", "-1"),
    ("stream_balance", "--docs", "0"), ("stream_balance", "--shards", "0"),
    ("sync_balance", "--dp", "0"), ("sync_balance", "--samples", "-5"),
    ("sync_balance", "--microbatches", "0"),
])
def test_a_bad_number_is_an_argparse_error(script, flag, value, capsys):
    main = _module(script).main
    with pytest.raises(SystemExit) as e:
        main([flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {flag}" in err and value in err, err
