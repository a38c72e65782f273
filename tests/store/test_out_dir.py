"""``--out`` naming an empty directory that exists (issue 30 item 10): it is a new plan
directory, written in place (before: ``--out .`` was refused as "already exists", and with
``--overwrite`` as "not a plan directory": the writer's hidden sibling of "." was made inside
"." itself). The directory stays the same directory (a shell's working directory, a mount point,
its owner and mode survive), and a directory that holds anything is still refused."""
import os

import numpy as np
import pytest

from balancer import Layout, PlannerConfig, SampleTable, load_cost_model, plan_epochs
from balancer import cli
from balancer.store import plan_store as store


@pytest.fixture(scope="module")
def plan():
    samples = SampleTable(np.random.default_rng(3).integers(1, 900, 300))
    return plan_epochs(samples, load_cost_model("quadratic-64k"),
                       Layout(dp=2, microbatches=2, capacity=1024), PlannerConfig(), 1)[0]


def _hidden(parent):
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("spell", [".", "./", "../here"])
def test_save_plan_into_the_empty_working_directory(plan, tmp_path, monkeypatch, overwrite,
                                                    spell):
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    ino = os.stat(".").st_ino
    p = store.save_plan(plan, spell, overwrite=overwrite)
    assert os.stat(".").st_ino == ino  # the same directory: the cwd is still there
    assert os.path.samefile(p, here)
    assert store.load_plan(".", 0)[0].fingerprint() == plan.fingerprint()
    assert _hidden(tmp_path) == [] and _hidden(here) == []


def test_an_empty_directory_by_name_is_new_and_a_full_one_is_refused(plan, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o750)
    ino = os.stat(empty).st_ino
    store.save_plan(plan, empty)  # no --overwrite needed: there is nothing to replace
    assert os.stat(empty).st_ino == ino and (os.stat(empty).st_mode & 0o777) == 0o750
    assert store.load_plan(empty, 0)[0].fingerprint() == plan.fingerprint()
    with pytest.raises(FileExistsError, match="already exists"):
        store.save_plan(plan, empty)  # now it holds a plan
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "a.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="already exists"):
        store.save_plan(plan, notes)
    assert (notes / "a.txt").read_text() == "keep" and _hidden(tmp_path) == []


def test_precompute_out_dot_in_an_empty_directory(tmp_path, monkeypatch, capsys):
    f = tmp_path / "l.npy"
    np.save(f, np.random.default_rng(1).integers(1, 900, 200))
    here = tmp_path / "run"
    here.mkdir()
    monkeypatch.chdir(here)
    assert cli.main(["precompute", "--lengths", str(f), "--capacity", "1024", "--dp", "2",
                     "--tail", "carry", "--out", "."]) == 0, capsys.readouterr().err
    assert (here / "manifest.json").is_file() and _hidden(tmp_path) == []
    assert cli.main(["inspect", "."]) == 0
