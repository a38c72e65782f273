"""A saved DatasetDict (save_to_disk of several splits) is read as one: report picks --split
and names the splits when it has no such one, precompute names the splits to choose from.
Before: report --split nope was a KeyError traceback; precompute --dataset read the folder's
dataset_dict.json as a JSON data file ('dataset has neither a length column 'length' nor a
token column (columns: ['splits'])')."""
import datasets
import pytest

from balancer.cli import main


@pytest.fixture()
def dd(tmp_path):
    d = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"length": list(range(1, 300))}),
                              "test": datasets.Dataset.from_dict({"length": list(range(1, 50))})})
    d.save_to_disk(str(tmp_path / "dd"))
    return tmp_path / "dd"


def test_report_names_the_splits(dd, tmp_path, capsys):
    rc = main(["report", "--dataset", str(dd), "--dp", "2", "--microbatches", "2", "--capacity",
               "4096", "--out", str(tmp_path / "r"), "--no-plots", "--split", "nope"])
    err = capsys.readouterr().err
    assert rc == 2 and "--split nope" in err and "train" in err and "test" in err, err
    assert main(["report", "--dataset", str(dd), "--dp", "2", "--microbatches", "2",
                 "--capacity", "4096", "--out", str(tmp_path / "r"), "--no-plots",
                 "--split", "test"]) == 0


def test_precompute_names_the_splits(dd, tmp_path, capsys):
    rc = main(["precompute", "--dataset", str(dd), "--capacity", "4096", "--out",
               str(tmp_path / "p")])
    err = capsys.readouterr().err
    assert rc == 2 and "DatasetDict" in err and "'train'" in err and "'test'" in err, err
    # one split's folder plans
    assert main(["precompute", "--dataset", str(dd / "train"), "--capacity", "4096", "--out",
                 str(tmp_path / "p")]) == 0


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_report_reads_the_files_precompute_reads(tmp_path, capsys, kind):
    """report --dataset took only a save_to_disk folder ('Directory d.jsonl is neither a
    `Dataset` directory nor a `DatasetDict` directory'); precompute and lengths read jsonl /
    parquet files too: one reader for all three."""
    ds = datasets.Dataset.from_dict({"length": list(range(1, 200))})
    f = tmp_path / f"d.{kind}"
    ds.to_json(str(f)) if kind == "jsonl" else ds.to_parquet(str(f))
    rc = main(["report", "--dataset", str(f), "--dp", "2", "--microbatches", "2", "--capacity",
               "4096", "--out", str(tmp_path / "r"), "--no-plots"])
    assert rc == 0, capsys.readouterr().err
