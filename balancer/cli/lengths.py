"""``python -m balancer lengths``: token counts of a text dataset, for ``precompute --lengths``.

One parallel pass of the training tokenizer over the text column (``datasets.map`` over
``--num-proc`` processes, with its progress bar on stderr), writing the counts as an int64
``.npy`` (``--out``) and / or the dataset with a length column (``--save-dataset``, a
``save_to_disk`` directory that ``precompute --dataset`` reads zero-copy). Better still, keep
``len(input_ids)`` as a length column in the tokenization pass you already run (see
:mod:`balancer.text_lengths`).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from .commands import command


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", required=True,
                   help="saved HF dataset directory, or jsonl / parquet file(s) (comma-separated, "
                        "or a directory of them)")
    p.add_argument("--tokenizer", required=True,
                   help="the training tokenizer: a Hugging Face name or a local directory "
                        "(transformers.AutoTokenizer)")
    p.add_argument("--text-column", default="text", help="column holding the raw text")
    p.add_argument("--length-column", default="length",
                   help="name of the length column written with --save-dataset")
    p.add_argument("--num-proc", type=int, default=None, help="tokenizing processes")
    p.add_argument("--batch-size", type=int, default=1000, help="texts per tokenizer call")
    p.add_argument("--no-special-tokens", dest="special_tokens", action="store_false",
                   help="count without the tokenizer's special tokens (BOS/EOS)")
    p.add_argument("--out", help="write the lengths (int64, one per row) to this .npy file")
    p.add_argument("--save-dataset", help="write the dataset with its length column here "
                                          "(save_to_disk)")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no summary")


def _run(args) -> int:
    from ..text_lengths import load_tokenizer, token_lengths
    from ..samples import SampleTable
    from .args import open_dataset
    if not args.out and not args.save_dataset:
        raise ValueError("give --out LENGTHS.npy and / or --save-dataset DIR")
    if args.out and not args.out.endswith(".npy"):
        raise ValueError(f"--out {args.out}: expected a .npy file name")
    if args.num_proc is not None and args.num_proc < 1:
        raise ValueError(f"--num-proc {args.num_proc} must be >= 1")
    t0 = time.perf_counter()
    tok = load_tokenizer(args.tokenizer)
    ds = open_dataset(args.dataset)
    measured = token_lengths(ds, tok, args.text_column, length_column=args.length_column,
                             num_proc=args.num_proc, batch_size=args.batch_size,
                             add_special_tokens=args.special_tokens,
                             progress=not args.quiet and sys.stderr.isatty())
    lengths = SampleTable.from_dataset(measured, args.length_column).lengths
    if args.out:
        np.save(args.out, lengths)
    if args.save_dataset:
        measured.save_to_disk(args.save_dataset)
    if not args.quiet:
        n = len(lengths)
        print(f"lengths: {n:,} texts, {int(lengths.sum()):,} tokens (min {int(lengths.min())}, "
              f"mean {lengths.mean():.1f}, max {int(lengths.max())}) in "
              f"{time.perf_counter() - t0:.1f} s"
              + (f" -> {args.out}" if args.out else "")
              + (f" -> {args.save_dataset}" if args.save_dataset else ""))
    return 0


command("lengths", "count the tokens of a text dataset with the training tokenizer (for "
                   "precompute --lengths / --dataset)")((_args, _run))
