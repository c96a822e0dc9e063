"""Micro-batch feed: keeps inputs (first stage) and labels (last stage) paired across calls.

The first and last stage load micro-batch ``m`` at different ticks: with ``P >= 3``
stages the last stage's loads for one ``train_batch`` spill into the next call. If
the user passes a new iterator to each call, reading "the current iterator" on the
last stage would pair the labels of one batch with the inputs of another. The feed
instead records, per call, which iterator supplies its ``M`` micro-batches; each
stage consumes that queue in order, so micro-batch ``m`` comes from the same
position of the same iterator on both stages.
"""

from collections import deque


class MicroBatchFeed:

    def __init__(self):
        self._queue = deque()  # [iterator, micro-batches still owed]
        self.consumed = 0

    def push(self, iterator, count):
        """The next ``count`` micro-batches come from ``iterator``."""
        if count > 0:
            self._queue.append([iterator, count])

    def clear(self):
        self._queue.clear()

    def next(self):
        while self._queue and self._queue[0][1] == 0:
            self._queue.popleft()
        if not self._queue:
            raise RuntimeError("ds_paci: a stage asked for more micro-batches than train_batch() provided "
                               "(internal error: the streams of the first and last stage disagree)")
        entry = self._queue[0]
        try:
            batch = next(entry[0])
        except StopIteration:
            raise RuntimeError(f"the training data iterator ran out after {self.consumed} micro-batches; wrap it in "
                               "deepspeed.utils.RepeatingLoader or give train_batch() more data") from None
        entry[1] -= 1
        self.consumed += 1
        return batch
