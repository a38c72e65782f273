"""Every precompute value refused by validation is named by its flag, as the command line
spells it (``--window-samples 0``), not by its config field (``window_samples 0``). Before, only
the Layout flags and a few planner ones were: --window-samples, --epochs, --workers, --samples,
--num-proc were named window_samples, epochs, workers, samples, num_proc."""
import numpy as np
import pytest

from balancer.cli import main


@pytest.mark.parametrize("flag,value", [("--window-samples", "0"), ("--window-samples", "-3"),
                                        ("--epochs", "0"), ("--workers", "0"),
                                        ("--num-proc", "0"), ("--samples", "0"),
                                        ("--max-delay", "-1"), ("--dp", "0")])
def test_a_refused_value_is_named_by_its_flag(tmp_path, capsys, flag, value):
    np.save(tmp_path / "l.npy", np.arange(1, 200))
    rc = main(["precompute", "--lengths", str(tmp_path / "l.npy"), "--capacity", "4096",
               "--out", str(tmp_path / "plan"), flag, value])
    err = capsys.readouterr().err
    assert rc == 2 and f"{flag} {value}:" in err, err


@pytest.mark.parametrize("flag,value", [("--length-column", "n_tokens"),
                                        ("--tokens-column", "input_ids"), ("--num-proc", "2"),
                                        ("--lengths-cache", "cache.npy")])
def test_a_flag_the_lengths_file_does_not_use_is_refused(tmp_path, capsys, flag, value):
    """``--lengths FILE.npy`` holds the lengths themselves: a column, processes to measure one,
    or a cache of shards would be ignored silently (the plan written without them)."""
    np.save(tmp_path / "l.npy", np.arange(1, 200))
    rc = main(["precompute", "--lengths", str(tmp_path / "l.npy"), "--capacity", "4096",
               "--out", str(tmp_path / "plan"), flag, value])
    err = capsys.readouterr().err
    assert rc == 2 and flag in err and "--lengths" in err, err
    assert not (tmp_path / "plan").exists()


def test_the_lengths_cache_of_a_dataset_is_refused(tmp_path, capsys):
    import datasets
    datasets.Dataset.from_dict({"length": [5, 7, 9]}).save_to_disk(str(tmp_path / "ds"))
    rc = main(["precompute", "--dataset", str(tmp_path / "ds"), "--capacity", "4096",
               "--out", str(tmp_path / "plan"), "--lengths-cache", str(tmp_path / "c.npy")])
    err = capsys.readouterr().err
    assert rc == 2 and "--lengths-cache" in err and "--dataset" in err, err
