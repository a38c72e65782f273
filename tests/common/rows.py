"""Row sources of the streaming tests (tests/runtime)."""
import torch


class ListRows(torch.utils.data.IterableDataset):
    """Rows of the given lengths, ids 0..n-1 (no state_dict: resumed by skipping)."""

    def __init__(self, lengths):
        self.lengths = list(lengths)

    def __iter__(self):
        for k, n in enumerate(self.lengths):
            yield {"input_ids": list(range(1, n + 1)), "id": k}
