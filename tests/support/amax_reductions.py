"""Counts amax reductions in the multi-process workers: every ``all_reduce`` with MAX is one
(Lightning's, Accelerate's and the loss scaler's reductions use SUM). Importing this module
wraps ``torch.distributed.all_reduce`` for the whole process: import it only from a worker."""

import torch.distributed as dist

MAX_ALL_REDUCES: list[int] = []  # the element count of each MAX all-reduce, in call order
_all_reduce = dist.all_reduce


def _counting_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    if op == dist.ReduceOp.MAX:
        MAX_ALL_REDUCES.append(tensor.numel())
    return _all_reduce(tensor, op=op, group=group, async_op=async_op)


dist.all_reduce = _counting_all_reduce
