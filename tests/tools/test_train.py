"""The demo trainer end to end: 2 gloo ranks train from the drop-in loader, the log has per-rank
compute times, the loss falls, and the first step's reduced gradient equals the unpacked global
batch's token-mean gradient computed in one process."""
import pytest
import json
from pathlib import Path

import torch

from tools import train  # noqa: E402
from tools.tiny_lm import TinyLM, token_loss_sum  # noqa: E402


@pytest.mark.slow
def test_two_ranks_train_log_and_gradient_equivalence(tmp_path):
    args = train.parse_args([
        "--world", "2", "--samples", "300", "--scale", "0.02", "--capacity", "512",
        "--microbatches", "2", "--steps", "3", "--dim", "32", "--layers", "1", "--heads", "2",
        "--vocab", "64", "--num-workers", "0", "--data", str(tmp_path / "data"),
        "--log", str(tmp_path / "log.json"), "--dump-grads", str(tmp_path / "grads.pt"),
        "--timeout", "120"])
    log = train.run(args)
    assert json.loads((tmp_path / "log.json").read_text()) == json.loads(json.dumps(log))
    steps = log["steps"]
    assert len(steps) == 3 and log["world"] == 2 and log["strategy"] == "balanced"
    for e in steps:
        assert len(e["compute_s"]) == 2 and min(e["compute_s"]) > 0
        assert e["microbatches"][0] == e["microbatches"][1]
    assert steps[-1]["loss"] < steps[0]["loss"]

    # the first step, unpacked: every document alone, token-mean loss over the global batch
    ds = train.load_dataset(Path(args.data_path))
    refs = []
    for r in range(2):
        sampler, _ = train.build_loader(args, ds, r, 2)
        sampler = type(sampler)(sampler.samples, sampler.cost, sampler.layout, sampler.config,
                                dp_rank=r)
        refs += [x for x in sampler if x.step == 0]
    torch.manual_seed(args.seed)
    model = TinyLM(args.vocab, args.dim, args.layers, args.heads)
    losses, count = [], 0
    for ref in refs:
        for s, a, n in zip(ref, ref.starts.tolist(), ref.lengths.tolist()):
            ids = torch.tensor(ds[s]["input_ids"][a:a + n], dtype=torch.int64)
            labels = torch.cat([ids[1:], torch.tensor([-100])])
            logits = model(ids, torch.arange(n), torch.tensor([0, n], dtype=torch.int32), n)
            losses.append(token_loss_sum(logits, labels))
            count += n - 1
    assert count == steps[0]["step_loss_tokens"]
    (torch.stack(losses).sum() / count).backward()
    got = torch.load(tmp_path / "grads.pt")
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_whole_epochs_and_held_out_loss(tmp_path):
    # --steps 0 trains every epoch to its end; rank 0 evaluates the fixed held-out set every
    # 2 steps and after the very last step
    args = train.parse_args([
        "--world", "1", "--samples", "120", "--scale", "0.02", "--capacity", "512",
        "--microbatches", "1", "--steps", "0", "--epochs", "2", "--dim", "32", "--layers", "1",
        "--heads", "2", "--vocab", "64", "--eval-every", "2", "--eval-docs", "8",
        "--timeout", "120"])
    log = train.run(args)
    steps = log["steps"]
    epochs = [e["epoch"] for e in steps]
    assert epochs == sorted(epochs) and set(epochs) == {0, 1}
    evaluated = [i for i, e in enumerate(steps) if "eval_loss" in e]
    want = sorted({i for i in range(len(steps)) if (i + 1) % 2 == 0} | {len(steps) - 1})
    assert evaluated == want
    assert steps[-1]["eval_loss"] < steps[evaluated[0]]["eval_loss"]


@pytest.mark.slow
def test_calibrate_online_two_ranks(tmp_path):
    # the closed loop end to end on 2 gloo ranks: the log's online_calibration block, the
    # refits (every 3 steps and once after the last), the ranks' agreement and the JSON lines;
    # the figures themselves depend on the machine and are not asserted
    args = train.parse_args([
        "--world", "2", "--samples", "300", "--scale", "0.02", "--capacity", "512",
        "--microbatches", "2", "--steps", "7", "--dim", "32", "--layers", "1", "--heads", "2",
        "--vocab", "64", "--data", str(tmp_path / "data"), "--timeout", "120",
        "--calibrate-online", "--refit-every", "3", "--refit-skip", "1", "--window-samples",
        "40", "--online-clock", "cpu", "--measured", str(tmp_path / "m.jsonl"),
        "--log", str(tmp_path / "log.json")])
    log = train.run(args)
    on = log["online_calibration"]
    assert on["ranks_agree"] is True and on["template"] == "quadratic-64k"
    assert [r["step"] for r in on["refits"]] == [3, 6, 7]
    for r in on["refits"]:
        assert r["first_replanned_step"] >= r["step"] and min(r["forward"] + r["backward"]) >= 0
    assert on["prediction_error_first"] >= 0 and on["prediction_error_last"] >= 0
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["type"] == "step"] == list(range(7))
    assert len(log["steps"]) == 7
    # every timed microbatch of every rank, with its documents (the proof scores plans on them)
    obs = on["observations"]
    assert len(obs["step"]) == sum(sum(e["microbatches"]) for e in log["steps"])
    assert sorted(set(obs["rank"])) == [0, 1] and sorted(set(obs["step"])) == list(range(7))
    assert all(len(x) >= 1 for x in obs["lengths"]) and min(obs["seconds"]) > 0
