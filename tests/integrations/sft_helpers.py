"""The SFT harness of the integration tests (issue 24): an offline chat tokenizer (a word-level
vocabulary and a chat template with ``{% generation %}`` markers, built in memory: nothing is
downloaded), a chat dataset with ``assistant_masks`` and a prompt/completion dataset with
``completion_mask``, their packed plan, and the unpacked reference: the documents of one planned
step run one per row, right-padded, with the library's masking applied independently of the
collator, giving the float64 first-step gradient every stack must match."""
from __future__ import annotations

import numpy as np
import torch

from integration_helpers import VOCAB

SPECIAL = ["<pad>", "</s>", "<user>", "<assistant>", "<system>"]
WORDS = VOCAB - len(SPECIAL)
PAD_ID = WORDS  # "<pad>"
IGNORE = -100
#: user / system turns as they are, the assistant's content and its end-of-turn token inside
#: {% generation %} (what return_assistant_tokens_mask marks as trained)
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<assistant> {% generation %}{{ m['content'] }} </s> "
    "{% endgeneration %}"
    "{% else %}<{{ m['role'] }}> {{ m['content'] }} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}")


def chat_tokenizer():
    """A ``PreTrainedTokenizerFast`` over ``w0 .. w{WORDS-1}`` and the special tokens, with
    :data:`CHAT_TEMPLATE`; ids < :data:`integration_helpers.VOCAB`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate([f"w{i}" for i in range(WORDS)] + SPECIAL)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")
    t.chat_template = CHAT_TEMPLATE
    return t


def _words(rng, n):
    return " ".join(f"w{i}" for i in rng.integers(0, WORDS, n))


def conversations(n=36, seed=0, long_every=9):
    """``n`` conversations (lists of ``{"role", "content"}``): 1-3 user/assistant exchanges,
    sometimes a system turn; every ``long_every``-th is long (cut into pieces by a small
    capacity); conversation 5 has no assistant turn (no trained token: allowed and counted)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        scale = 6 if long_every and i % long_every == long_every - 1 else 1
        msgs = [{"role": "system", "content": _words(rng, rng.integers(1, 6))}] \
            if rng.random() < 0.3 else []
        for _ in range(rng.integers(1, 4)):
            msgs.append({"role": "user", "content": _words(rng, scale * rng.integers(1, 12))})
            if i != 5:
                msgs.append({"role": "assistant",
                             "content": _words(rng, scale * rng.integers(1, 14))})
        out.append(msgs)
    return out


def chat_dataset(tokenizer, n=36, seed=4):
    """``datasets.Dataset`` with ``messages`` (TRL's conversational format), ``input_ids`` and
    ``assistant_masks`` from ``tokenizer.apply_chat_template(..., return_assistant_tokens_mask=
    True)``, as a user tokenizes raw conversations."""
    import datasets
    rows = {"messages": [], "input_ids": [], "assistant_masks": []}
    for msgs in conversations(n, seed):
        enc = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        rows["messages"].append(msgs)
        rows["input_ids"].append(list(enc["input_ids"]))
        rows["assistant_masks"].append(list(enc["assistant_masks"]))
    return datasets.Dataset.from_dict(rows)


def completion_dataset(tokenizer, n=36, seed=5):
    """``datasets.Dataset`` in TRL's prompt/completion format (``prompt``, ``completion`` text)
    with ``input_ids`` (prompt then completion tokens) and ``completion_mask`` (0 on the prompt,
    1 on the completion), as TRL's own tokenization builds them."""
    import datasets
    rng = np.random.default_rng(seed)
    rows = {"prompt": [], "completion": [], "input_ids": [], "completion_mask": []}
    for i in range(n):
        scale = 6 if i % 9 == 8 else 1
        p = _words(rng, scale * rng.integers(1, 20))
        c = _words(rng, scale * rng.integers(1, 20)) + " </s>"
        pi = tokenizer(p, add_special_tokens=False)["input_ids"]
        ci = tokenizer(c, add_special_tokens=False)["input_ids"]
        rows["prompt"].append(p)
        rows["completion"].append(c)
        rows["input_ids"].append(pi + ci)
        rows["completion_mask"].append([0] * len(pi) + [1] * len(ci))
    return datasets.Dataset.from_dict(rows)


def plan_parts(ds, dp=1, seed=0, microbatches=2, capacity=96):
    """``(samples, cost, layout, config)`` for ``ds``'s ``input_ids``: documents over
    ``capacity`` are cut into pieces (each piece keeps its slice of the mask)."""
    from balancer import CostModel, Layout, PlannerConfig, SampleTable
    lengths = np.array([len(r) for r in ds["input_ids"]], np.int64)
    return (SampleTable(lengths), CostModel.quadratic(4096),
            Layout(dp=dp, microbatches=microbatches, capacity=capacity),
            PlannerConfig(seed=seed, over_length="chunk"))


def step_pieces(samples, cost, layout, config, step=0, epoch=0):
    """``[(sample, start, length)]`` of every microbatch of planned step ``step`` over every DP
    rank, from the plan itself (the sampler's refs)."""
    from balancer import PackedBatchSampler
    out = []
    for r in range(layout.dp):
        s = PackedBatchSampler(samples, cost, layout, config, dp_rank=r)
        s.set_epoch(epoch)
        for pos in range(len(s)):
            ref = s.ref(pos)
            if ref.step == step:
                out += list(zip(list(ref), ref.starts.tolist(), ref.lengths.tolist()))
    return out


def reference_labels(tokens, mask):
    """The library's masking of one document (piece), computed here, not by the collator:
    ``labels[i]`` is token i where ``mask[i]`` is 1 and i > 0 (a document's first token is never
    predicted), -100 elsewhere. ``mask`` None trains every token."""
    tokens = np.asarray(tokens, np.int64)
    keep = np.ones(tokens.shape[0], bool) if mask is None else np.asarray(mask) == 1
    keep[:1] = False
    return np.where(keep, tokens, IGNORE)


def reference_step(model, ds, mask_column, pieces, labels_column=None):
    """``(grads, trained)``: the gradient of the step's loss (token-sum cross entropy of every
    trained token / ``trained``, the step's trained tokens) with the step's pieces run one per
    row of a right-padded batch, float64; ``mask_column`` (0/1) or ``labels_column`` (-100 where
    not trained) names the training signal, neither: every token."""
    rows, labs = [], []
    for s, a, n in pieces:
        tok = np.asarray(ds[s]["input_ids"][a:a + n])
        if labels_column is not None:
            user = np.asarray(ds[s][labels_column][a:a + n])
            lab = np.where(user == IGNORE, IGNORE, tok)
            lab[:1] = IGNORE
        else:
            lab = reference_labels(tok, None if mask_column is None
                                   else ds[s][mask_column][a:a + n])
        rows.append(tok)
        labs.append(lab)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, lab) in enumerate(zip(rows, labs)):
        ids[i, :len(r)] = torch.as_tensor(r)
        labels[i, :len(r)] = torch.as_tensor(lab)
        attn[i, :len(r)] = 1
    trained = int((labels != IGNORE).sum())
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).to(torch.float64),
        labels[:, 1:].reshape(-1), ignore_index=IGNORE, reduction="sum")
    (loss / max(trained, 1)).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}, trained


def rel_grad_diff(got: dict, ref: dict) -> float:
    """max |got - ref| over every parameter, relative to max |ref|."""
    assert got.keys() == ref.keys(), set(got) ^ set(ref)
    scale = max(float(v.abs().max()) for v in ref.values())
    return max(float((got[k].to(torch.float64) - ref[k]).abs().max()) for k in ref) / scale
