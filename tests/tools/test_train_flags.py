"""tools/train.py refuses flag values it cannot train with, as argparse errors naming the flag
(exit 2) before any rank starts. Before: --heads 0 and --scale 0 ended in ZeroDivisionError
tracebacks from the spawned ranks, --threads 0 in 'set_num_threads expects a positive
integer', --samples 0 in datasets' DatasetGenerationError, --dim 3 --heads 2 in a traceback."""
import pytest

from tools.train import parse_args


@pytest.mark.parametrize("argv,flag", [
    (["--heads", "0"], "--heads"), (["--dim", "0"], "--dim"), (["--layers", "0"], "--layers"),
    (["--vocab", "1"], "--vocab"), (["--dim", "3", "--heads", "2"], "--heads"),
    (["--scale", "0"], "--scale"), (["--scale", "-1"], "--scale"), (["--lr", "nan"], "--lr"),
    (["--samples", "0"], "--samples"), (["--threads", "0"], "--threads"),
    (["--num-workers", "-1"], "--num-workers"), (["--microbatches", "0"], "--microbatches"),
    (["--capacity", "0"], "--capacity"), (["--epochs", "0"], "--epochs"),
    (["--steps", "-1"], "--steps"), (["--refit-every", "0"], "--refit-every"),
    (["--eval-every", "-1"], "--eval-every"), (["--timeout", "0"], "--timeout"),
])
def test_a_bad_value_is_an_argparse_error(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and flag in err, err


def test_the_defaults_parse():
    a = parse_args([])
    assert a.dim % a.heads == 0 and a.steps == 20
