"""Bad input is refused with one clear line naming the sample / key / file, the value and the
limit (issue #13, items 5, 6 and 11): one validation path for lengths arrays (CLI and API), cost
coefficients finite and non-negative, YAML errors as one line naming the file, and the values that
feed int64 arithmetic bounded."""
import json

import numpy as np
import pytest

from balancer import CostModel, Layout, PassCost, PlannerConfig, SampleTable
from balancer.cli import main
from balancer.cost.model import ModelSpec
from packing.validate import MAX_LENGTH, as_sizes


def _cli(capsys, *argv) -> tuple[int, str]:
    rc = main(list(argv))
    err = capsys.readouterr().err
    return rc, err


def _compare(tmp_path, capsys, arr, *extra):
    p = tmp_path / "lengths.npy"
    np.save(p, arr)
    return _cli(capsys, "compare", "--lengths", str(p), "--capacity", "8192",
                "--strategies", "sequential", *extra)


# ---- item 5: lengths validated as loaded, one path for the CLI and the API ----------------------
BAD_LENGTHS = [
    (np.array([100, 2792.5, 7]), r"sample 1: length 2792\.5 is not an integer"),
    (np.array([100, np.nan]), r"sample 1: length nan is not an integer \(not a finite number\)"),
    (np.array([100, np.inf]), r"sample 1: length inf is not an integer \(not a finite number\)"),
    (np.array(["12", "7"]), r"lengths must be integers, got dtype <U2 \(sample 0: '12'\)"),
    (np.array([3 + 0j, 4 + 1j]), r"lengths must be integers, got dtype complex128"),
    (np.array([True, False]), r"lengths must be integers, got dtype bool"),
    (np.array([5, np.iinfo(np.uint64).max], dtype=np.uint64),
     r"sample 1: length 18446744073709551615 exceeds the largest supported length 2\*\*40"),
    (np.array([5, 2 ** 41], dtype=np.int64), r"sample 1: length 2199023255552 exceeds"),
    (np.array([5.0, 1e30]), r"sample 1: length 1e\+30 exceeds"),
    (np.array([5, -3], dtype=np.int32), r"sample 1: length -3 is not positive"),
    (np.array([[1, 2]]), r"lengths must be a 1-D array, got shape \(1, 2\)"),
]


@pytest.mark.parametrize("arr,msg", BAD_LENGTHS, ids=[str(i) for i in range(len(BAD_LENGTHS))])
def test_lengths_refused_alike_by_cli_and_api(tmp_path, capsys, arr, msg):
    with pytest.raises(ValueError, match=msg) as api:
        SampleTable(arr)
    rc, err = _compare(tmp_path, capsys, arr)
    assert rc == 2
    assert err.count("\n") == 1 and str(api.value) in err  # one line, the same message
    assert "lengths.npy" in err  # names the file


def test_integral_floats_and_small_ints_accepted_exactly():
    assert as_sizes(np.array([3.0, 2792.0])).tolist() == [3, 2792]
    assert as_sizes(np.array([MAX_LENGTH], dtype=np.uint64)).tolist() == [MAX_LENGTH]
    assert as_sizes(np.array([1, 2], dtype=np.uint8)).dtype == np.int64


def test_object_arrays_name_the_bad_sample():
    with pytest.raises(ValueError, match=r"sample 1: length None is not an integer"):
        SampleTable(np.array([4, None], dtype=object))
    with pytest.raises(ValueError, match=r"sample 0: length 36893488147419103232 exceeds"):
        SampleTable([2 ** 65, 3])
    assert SampleTable(np.array([4, 5], dtype=object)).lengths.tolist() == [4, 5]


def test_total_tokens_must_fit_int64():
    big = np.broadcast_to(np.int64(MAX_LENGTH), (2 ** 23 + 8,))
    with pytest.raises(ValueError, match=r"total of the lengths .* exceeds 2\*\*62"):
        as_sizes(big)


# ---- item 11: the caller's array is never changed -----------------------------------------------
def test_sample_table_leaves_the_callers_array_writeable_and_is_not_aliased():
    a = np.arange(1, 11, dtype=np.int64)
    t = SampleTable(a)
    assert a.flags.writeable
    a[0] = 99  # the caller may still use its array; the table does not change with it
    assert t.lengths[0] == 1 and not t.lengths.flags.writeable
    before = t.fingerprint()
    a[1] = 77
    assert t.fingerprint() == before


def test_sample_table_of_a_readonly_array_shares_it():
    a = np.arange(1, 11, dtype=np.int64)
    a.setflags(write=False)
    t = SampleTable(a)
    assert np.shares_memory(t.lengths, a) and not t.lengths.flags.writeable


# ---- item 6: cost coefficients finite and non-negative; YAML errors one line ---------------------
@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0])
def test_pass_cost_refuses_non_finite_and_negative(value):
    with pytest.raises(ValueError, match="a"):
        PassCost(a=value)


@pytest.mark.parametrize("text,msg", [
    ("forward: {a: .inf, b: 1}\nbackward: {b: 2}\n", r"forward\.a: .*finite.* \(got inf\)"),
    ("forward: {a: .nan, b: 1}\nbackward: {b: 2}\n", r"forward\.a: .*finite"),
    ("forward: {b: -1}\nbackward: {b: 2}\n", r"forward\.b: .*greater than or equal to 0"),
    ("unit: seconds\nforward: {b: 1}\nbackward: {b: 2}\nflops_per_second: .inf\n",
     r"flops_per_second: .*finite"),
    ("forward: {b: 1}\nbackward: {b: 2}\nmemory: {bytes_per_token: .inf}\n",
     r"memory\.bytes_per_token: .*finite"),
    ("forward: !!python/object/apply:os.system [echo hi]\n", r"not plain YAML .*python/object"),
    ("forward: {a: 1\nbackward: [\n", r"not valid YAML \(line \d+, column \d+\)"),
    ("- 1\n- 2\n", r"a cost preset must be a mapping at the top level, got list"),
    (b"forward: {b: 1}\nname: \xff\xfe\n", r"not a UTF-8 text file \(invalid start byte at "
                                             r"byte 22\)"),  # was a UnicodeDecodeError traceback
])
def test_cost_yaml_errors_are_one_line_naming_the_file(tmp_path, capsys, text, msg):
    p = tmp_path / "bad-model.yaml"
    p.write_bytes(text) if isinstance(text, bytes) else p.write_text(text)
    with pytest.raises(ValueError, match=msg) as e:
        CostModel.from_yaml(p)
    assert str(e.value).startswith(str(p)) and "\n" not in str(e.value)
    rc, err = _cli(capsys, "compare", "--lengths", "bimodal-sft", "--samples", "50",
                   "--capacity", "8192", "--cost-model", str(p), "--strategies", "sequential")
    assert rc == 2 and err.count("\n") == 1 and str(p) in err


def test_cost_of_a_huge_length_must_stay_finite():
    cost = CostModel(name="huge", forward=PassCost(a=1e300), backward=PassCost(b=1.0))
    with pytest.raises(ValueError, match=r"cost model 'huge': sample 1 \(length 100000\) "
                                         r"costs inf"):
        cost.doc_total([1, 100000])


def test_analytic_model_with_absurd_sizes_is_refused():
    with pytest.raises(ValueError, match="hidden"):
        ModelSpec(hidden=2 ** 70, layers=1, heads=1, ffn=1, vocab=1)


def test_mm_cost_model_refuses_inf_and_bad_yaml(tmp_path):
    from balancer.multimodal.cost import EncoderSpec, MMCostModel
    with pytest.raises(ValueError, match="attn_backward_ratio"):
        MMCostModel(llm=CostModel.quadratic(), attn_backward_ratio=float("inf"))
    with pytest.raises(ValueError, match="encoder_device_bytes"):
        MMCostModel(llm=CostModel.quadratic(), encoder_device_bytes=float("nan"))
    with pytest.raises(ValueError, match="hidden"):
        EncoderSpec(hidden=2 ** 70, layers=1, heads=1, ffn=1, in_dim=1)
    p = tmp_path / "mm.yaml"
    p.write_text("llm: !!python/name:os.system\n")
    with pytest.raises(ValueError, match=r"mm\.yaml: not plain YAML") as e:
        MMCostModel.from_yaml(p)
    assert "\n" not in str(e.value)
    p.write_text("llm: {forward: {a: .inf}, backward: {}}\n")
    with pytest.raises(ValueError, match=r"mm\.yaml: .*forward\.a: .*finite"):
        MMCostModel.from_yaml(p)


# ---- item 6: values feeding int64 arithmetic are bounded ---------------------------------------
def test_layout_capacity_bounded():
    with pytest.raises(ValueError, match=r"capacity"):
        Layout(capacity=2 ** 63 - 1)
    Layout(capacity=MAX_LENGTH)  # the limit itself is fine
    with pytest.raises(ValueError, match=r"dp x microbatches x capacity .* exceeds"):
        Layout(dp=2 ** 20, microbatches=2 ** 20, capacity=2 ** 20)


def test_planner_config_bounds():
    for kw in ({"global_batch_tokens": 2 ** 63 - 1}, {"global_batch_samples": 2 ** 63},
               {"max_delay": 2 ** 40}, {"max_advance": 2 ** 40}, {"window_samples": 2 ** 63},
               {"seed": -1}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            PlannerConfig(**kw)


def test_cli_capacity_overflow_is_one_line_naming_the_flag(capsys):
    rc, err = _cli(capsys, "compare", "--lengths", "bimodal-sft", "--samples", "50",
                   "--capacity", str(2 ** 63 - 1), "--strategies", "sequential")
    assert rc == 2 and err.count("\n") == 1
    assert "--capacity 9223372036854775807" in err and "1099511627776" in err
    rc, err = _cli(capsys, "compare", "--lengths", "bimodal-sft", "--samples", "50",
                   "--capacity", "8192", "--global-batch-tokens", "-5",
                   "--strategies", "sequential")
    assert rc == 2 and err.count("\n") == 1 and "--global-batch-tokens -5" in err


def test_packing_wrappers_bound_capacity():
    from packing.validate import check_capacity
    with pytest.raises(ValueError, match=r"capacity 9223372036854775807 exceeds"):
        check_capacity(np.array([5], np.int64), 2 ** 63 - 1)


# ---- calibration observations ------------------------------------------------------------------
def test_calibrate_observations_errors_name_the_file(tmp_path, capsys):
    p = tmp_path / "obs.json"
    p.write_text("{not json")
    rc, err = _cli(capsys, "calibrate", "--observations", str(p), "--out", str(tmp_path / "m.yaml"))
    assert rc == 2 and err.count("\n") == 1 and "obs.json: not valid JSON" in err
    rc, err = _cli(capsys, "calibrate", "--observations", str(tmp_path / "missing.json"),
                   "--out", str(tmp_path / "m.yaml"))
    assert rc == 2 and err.count("\n") == 1 and "missing.json" in err
    p.write_text(json.dumps({"microbatches": [[5], [7]], "forward": [0.1, float("nan")],
                             "backward": [0.2, 0.3]}).replace("NaN", "NaN"))
    rc, err = _cli(capsys, "calibrate", "--observations", str(p), "--out", str(tmp_path / "m.yaml"))
    assert rc == 2 and err.count("\n") == 1
    assert "obs.json: forward time of microbatch 1 is nan" in err
    assert not (tmp_path / "m.yaml").exists()


# ---- a --lengths file that cannot be read: one line naming it, never a traceback ----------------
def _obj_npy(p):
    np.save(p, np.array([1, "a"], dtype=object), allow_pickle=True)


BAD_FILES = [
    ("missing", None, r"lengths\.npy: no such file"),
    ("zero bytes", lambda p: p.write_bytes(b""), r"lengths\.npy: not a \.npy file"),
    ("text", lambda p: p.write_text("hello\n"), r"lengths\.npy: not a \.npy file"),
    ("truncated", lambda p: p.write_bytes(_npy_bytes(np.arange(1, 100))[:90]),
     r"lengths\.npy: not a \.npy file"),
    ("data cut short", lambda p: p.write_bytes(_npy_bytes(np.arange(1, 100))[:300]),
     r"lengths\.npy: not a \.npy file or cut short"),
    ("pickled objects", _obj_npy, r"lengths\.npy: .*object"),
    ("a directory", lambda p: p.mkdir(), r"lengths\.npy: not a file"),
]


def _npy_bytes(arr) -> bytes:
    import io
    b = io.BytesIO()
    np.save(b, arr)
    return b.getvalue()


@pytest.mark.parametrize("make,msg", [b[1:] for b in BAD_FILES], ids=[b[0] for b in BAD_FILES])
def test_unreadable_lengths_file_is_one_line_naming_it(tmp_path, capsys, make, msg):
    p = tmp_path / "lengths.npy"
    if make is not None:
        make(p)
    for cmd in (["compare", "--strategies", "sequential"], ["report", "--out", str(tmp_path / "r")],
                ["precompute", "--out", str(tmp_path / "plan"), "--no-progress"]):
        rc, err = _cli(capsys, *cmd, "--lengths", str(p), "--capacity", "8192")
        assert rc == 2, (cmd, err)
        assert err.startswith("error: ") and err.count("\n") == 1, err
        assert __import__("re").search(msg, err), err
    from balancer import workloads
    with pytest.raises(ValueError, match=msg):
        workloads.load(str(p))
