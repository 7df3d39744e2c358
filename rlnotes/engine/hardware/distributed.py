"""Several processes on one run (torchrun): which rank this is, its part of the batch, and the few
collectives that keep the ranks in step. With one process every function returns at once, so a
single-process run does exactly what it did without this module.

How W processes share a run (hardware.strategy):
  ddp   every rank holds the whole model and trains on its own 1/W of the global batch. Each
        rank's loss is its share of the global batch's loss (token means divide by the global
        token count, sequence means by the global number of sequences), so summing the ranks'
        gradients, in one flat all-reduce before the optimizer step, gives the gradient one
        process would compute on the whole batch;
  fsdp  the same, with parameters, gradients and optimizer state sharded across ranks by
        PyTorch's FSDP2 (fully_shard, see rlnotes.engine.hardware.fsdp), for models whose training state
        does not fit one device.

Backends: gloo on CPU; on GPUs NCCL for CUDA tensors with gloo beside it for the small CPU-side
exchanges (metrics, flags, objects). The process group starts once per process and is kept until
the process exits, across every job of a Hydra multirun.
"""

from __future__ import annotations

import atexit
import math
import os
import sys
from contextlib import contextmanager
from datetime import datetime
from typing import Dict, Iterable, Iterator, List, NoReturn, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist

from rlnotes.core.errors import ConfigError
from rlnotes.notes import masked_mean, masked_sum

T = TypeVar("T")

# Elements per all-reduce when gradients are summed: large enough for few calls, small enough
# that the flat copy stays a fraction of the gradients' memory.
BUCKET = 1 << 25


def world_size() -> int:
    """Processes in the run: the process group's size, or torchrun's WORLD_SIZE before it starts."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    """The rank within this machine (torchrun's LOCAL_RANK): which GPU this process drives."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    """Rank 0: the one that logs, prints and saves."""
    return rank() == 0


def active() -> bool:
    """Whether collectives run: a process group of more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def init(device: torch.device) -> torch.device:
    """Join the process group when torchrun started several processes, once per process, and
    return this rank's device (cuda:LOCAL_RANK on GPUs)."""
    if world_size() <= 1:
        return device
    if device.type == "cuda":
        if local_rank() >= torch.cuda.device_count():
            raise ConfigError(f"{world_size()} processes on this machine but torch sees {torch.cuda.device_count()} "
                              "GPUs; start one process per GPU (hardware.nproc, torchrun's --nproc_per_node)")
        device = torch.device("cuda", local_rank())
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if device.type == "cuda":
            dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
        atexit.register(_leave)
    return device


def _leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def end_process(code: object) -> NoReturn:
    """End a process that joined a group of several, with `code` as sys.exit reads it (None is 0, a
    string is printed and exits 1): the exit handlers run while the interpreter is whole (the
    group is left, a user's own handlers run too), the streams are flushed, and the process ends
    without the interpreter's finalization. Threads of torch's gloo backend can still hold
    tensors whose release takes the GIL; during finalization that aborts a rank that has done
    all its work (SIGABRT, "Fatal Python error: Aborted" with no Python frame), and torchrun
    then reports the run as failed."""
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to say there
            pass
    os._exit(code)


def backend() -> str:
    return str(dist.get_backend()) if active() else "none"


# ---------------------------------------------------------------------------------------------
# Splitting a batch.


def shard_bounds(n: int) -> Tuple[int, int]:
    """[start, stop) of this rank's contiguous part of n items: rank r of W takes [r n/W, (r+1) n/W).
    Contiguous parts in rank order put the gathered results back in the batch's order."""
    w, r = world_size(), rank()
    return r * n // w, (r + 1) * n // w


def shard(items: Sequence[T]) -> List[T]:
    """This rank's part of `items` (all of them with one process)."""
    start, stop = shard_bounds(len(items))
    return list(items[start:stop])


# ---------------------------------------------------------------------------------------------
# Collectives on small CPU-side values.


def sum_over_ranks(values: Sequence[float]) -> List[float]:
    """Each value summed over the ranks (float64, one all-reduce)."""
    if not active():
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def sum_shares(shares: Dict[str, float]) -> Dict[str, float]:
    """Metrics each rank accumulated as its share of the global batch's value, summed over the
    ranks (one all-reduce): the global batch's values."""
    return dict(zip(shares, sum_over_ranks(list(shares.values()))))


def mean_over_ranks(value: float) -> float:
    """The mean of a value each rank measured on equally many items: the global batch's mean."""
    return sum_over_ranks([value])[0] / world_size() if active() else float(value)


def masked_mean_over_ranks(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(v m) / sum(m) over every rank's rows (rlnotes.notes.masked_mean with one process)."""
    if not active():
        return masked_mean(values, mask)
    total, count = sum_over_ranks([float(masked_sum(values, mask)), float((mask != 0).sum())])
    return torch.tensor(total / max(count, 1.0), dtype=values.dtype, device=values.device)


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on at least one."""
    return sum_over_ranks([float(flag)])[0] > 0 if active() else flag


def gather(obj: T) -> List[T]:
    """Every rank's `obj` (picklable), in rank order."""
    if not active():
        return [obj]
    out: List[T] = [None] * world_size()  # type: ignore[list-item]
    dist.all_gather_object(out, obj)
    return out


def gather_rows(t: torch.Tensor) -> torch.Tensor:
    """The ranks' tensors concatenated along dim 0 in rank order (their first dims may differ): the
    global batch's rows, for metrics that need all of them."""
    if not active():
        return t
    return torch.cat([part for part in gather(t.detach().cpu())]).to(t.device)


def broadcast(obj: T) -> T:
    """Rank 0's `obj` on every rank."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if active():
        dist.barrier()


@contextmanager
def main_first() -> Iterator[None]:
    """Rank 0 runs the block before the others do (they wait): a model converted or downloaded into
    a cache, or a dataset fetched, is then written once and read by the rest."""
    if not is_main():
        barrier()
    yield
    if is_main():
        barrier()


def agreed_now() -> datetime:
    """Rank 0's clock: the one timestamp every rank names its run dir by."""
    return broadcast(datetime.now())


def _mean(values: List[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else float("nan")


# How a metric that each rank measured on its own part of the batch becomes the batch's.
REDUCTIONS = {"sum": sum, "max": max, "mean": _mean}


def reduce_metrics(metrics: Dict[str, float], ops: Dict[str, str]) -> Dict[str, float]:
    """`metrics` with each key of `ops` combined over the ranks by its op (sum, max or mean, which
    leaves out NaN); other keys unchanged. One exchange, tolerant of keys some ranks lack."""
    if not active():
        return metrics
    mine = {k: float(metrics[k]) for k in ops if k in metrics}
    every = gather(mine)
    out = dict(metrics)
    for key, op in ops.items():
        values = [m[key] for m in every if key in m]
        if values:
            out[key] = REDUCTIONS[op](values)
    return out


# ---------------------------------------------------------------------------------------------
# Gradients and parameters.


def _is_sharded(p: torch.Tensor) -> bool:
    """A parameter FSDP owns (a DTensor): FSDP reduces its gradient itself."""
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def _buckets(params: Sequence[torch.nn.Parameter]) -> Iterable[List[torch.nn.Parameter]]:
    """Parameters grouped by dtype and device, in runs of at most BUCKET elements."""
    groups: Dict[tuple, List[torch.nn.Parameter]] = {}
    for p in params:
        groups.setdefault((p.dtype, p.device), []).append(p)
    for group in groups.values():
        bucket, size = [], 0
        for p in group:
            if bucket and size + p.numel() > BUCKET:
                yield bucket
                bucket, size = [], 0
            bucket.append(p)
            size += p.numel()
        if bucket:
            yield bucket


def sum_gradients(params: Sequence[torch.nn.Parameter]) -> None:
    """Replace each gradient by its sum over the ranks, in flat all-reduces. A parameter without a
    gradient here (a rank that had no rows to train on) adds zeros and then holds the sum."""
    if not active():
        return
    for bucket in _buckets([p for p in params if not _is_sharded(p)]):
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket])
        dist.all_reduce(flat)
        offset = 0
        for p in bucket:
            part = flat[offset:offset + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = part.clone()
            else:
                p.grad.copy_(part)
            offset += p.numel()


def clip_grad_norm(params: Sequence[torch.nn.Parameter], max_norm: Optional[float]) -> torch.Tensor:
    """torch's clip_grad_norm_ (no clipping for max_norm None), also for FSDP's sharded parameters
    beside whole ones (a value head): the norm of every gradient of the model, each counted once."""
    limit = max_norm if max_norm is not None else float("inf")
    sharded = [p.grad for p in params if _is_sharded(p) and p.grad is not None]
    if not sharded:
        return torch.nn.utils.clip_grad_norm_(params, limit)
    whole = [p.grad for p in params if not _is_sharded(p) and p.grad is not None]
    norm = torch.nn.utils.get_total_norm(sharded).full_tensor()
    if whole:
        norm = torch.linalg.vector_norm(torch.stack([norm, torch.nn.utils.get_total_norm(whole).to(norm.device)]))
    coef = min(limit / (float(norm) + 1e-6), 1.0)
    for g in sharded + whole:
        g.mul_(coef)
    return norm


def broadcast_parameters(params: Iterable[torch.nn.Parameter]) -> None:
    """Rank 0's values in every rank's parameters, so all ranks start from the same weights
    whatever their random streams did before."""
    if not active():
        return
    with torch.no_grad():
        for p in params:
            if not _is_sharded(p):
                dist.broadcast(p.data, src=0)


# ---------------------------------------------------------------------------------------------
# FSDP2's optimizer state (hardware.strategy=fsdp; the model's sharding is in rlnotes.engine.hardware.fsdp).


def _to_local(value):
    """Tensors of a (nested) state with every DTensor replaced by this rank's shard."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local().cpu()
    if isinstance(value, dict):
        return {k: _to_local(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_local(v) for v in value]
    return value


def sharded_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer steps FSDP-sharded parameters."""
    return any(_is_sharded(p) for group in optimizer.param_groups for p in group["params"])


def optimizer_shards(optimizer: torch.optim.Optimizer) -> Optional[List[dict]]:
    """Under FSDP, every rank's optimizer state (its shards, as plain tensors) gathered on every
    rank, in rank order; None without sharded parameters (the state is whole on each rank)."""
    return gather(_to_local(optimizer.state_dict())) if sharded_optimizer(optimizer) else None


def load_optimizer_shard(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load this rank's saved shard of the optimizer state, giving each sharded parameter's state
    its parameter's layout back."""
    from torch.distributed.tensor import DTensor

    optimizer.load_state_dict(state)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not _is_sharded(p):
                continue
            slots = optimizer.state.get(p, {})
            for key, value in slots.items():
                if torch.is_tensor(value) and not isinstance(value, DTensor) and value.shape == p.to_local().shape:
                    slots[key] = DTensor.from_local(value.to(p.device), p.device_mesh, p.placements, run_check=False,
                                                    shape=p.shape, stride=p.stride())
