"""All of sinklab's multi-process plumbing (``torchrun`` / ``accelerate launch``): rank, world, reductions, failures.

The analyses call the small helpers below; in one process (no launcher, or ``WORLD_SIZE`` 1) every helper is a
no-op that returns its input, so single-process code paths are unchanged. Under a launcher:

- :func:`init` joins the process group the launcher describes in the environment (``RANK``, ``WORLD_SIZE``,
  ``MASTER_ADDR``/``MASTER_PORT``; gloo on CPU, NCCL on CUDA) with a collective timeout of
  :func:`timeout_seconds` (``SINKLAB_DIST_TIMEOUT``, default 300 s);
- :func:`batch_shares` splits whole batches contiguously over the ranks, so every sample is computed in
  exactly the batch it has in one process (same padding, same numbers);
- :func:`gather_rows` and :func:`all_reduce` combine per-sample statistics and sums/counts/maxima (never
  averages of averages): every cross-sample statistic is then computed from the full per-sample arrays by
  the same code as in one process;
- :func:`together` wraps a rank's local work: when any rank raises inside it, every rank raises (the
  failing one its own error, the others :class:`DistributedError` naming the failed ranks); a rank that
  dies or hangs makes the others' next collective fail after the timeout, and ``torchrun`` stops the
  remaining workers once one exits with an error — no run waits forever.
"""

from __future__ import annotations

import contextvars
import datetime
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from .errors import SinklabError

__all__ = ["DistributedError", "launched", "init", "active", "rank", "world_size", "is_main", "timeout_seconds",
           "local", "all_reduce", "gather_rows", "gather_objects", "broadcast_object", "batch_shares", "together",
           "barrier", "shutdown", "fsdp_root", "probe_ranks", "unwrap", "data_parallel", "local_device",
           "TIMEOUT_ENV", "DEFAULT_TIMEOUT_S"]

#: Environment variable with the collective timeout in seconds.
TIMEOUT_ENV = "SINKLAB_DIST_TIMEOUT"
#: Collective timeout when :data:`TIMEOUT_ENV` is not set.
DEFAULT_TIMEOUT_S = 300.0


class DistributedError(SinklabError):
    """Another rank failed, a collective timed out, or a command cannot run under a multi-process launcher."""


_LOCAL: contextvars.ContextVar[bool] = contextvars.ContextVar("sinklab_local", default=False)


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() else None


def launched() -> bool:
    """True when a launcher started this process as one of several (``WORLD_SIZE`` > 1 in the environment)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def timeout_seconds() -> float:
    """The collective timeout: ``SINKLAB_DIST_TIMEOUT`` seconds (default :data:`DEFAULT_TIMEOUT_S`)."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise DistributedError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise DistributedError(f"{TIMEOUT_ENV} must be > 0 seconds, got {raw}")
    return value


def init(device: str | torch.device | None = None) -> bool:
    """Join the launcher's process group (once); returns whether this run is multi-process.

    The backend is NCCL when ``device`` is a CUDA device, else gloo. Idempotent; a process group
    someone else initialised (``Trainer``, ``accelerate``) is used as it is.
    """
    dist = _dist()
    if dist is None or not launched():
        return active()
    if not dist.is_initialized():
        cuda = device is not None and torch.device(device).type == "cuda"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_seconds()))
    return active()


def active() -> bool:
    """True inside an initialised process group of more than one rank."""
    dist = _dist()
    return not _LOCAL.get() and dist is not None and dist.is_initialized() and dist.get_world_size() > 1


@contextmanager
def local() -> Iterator[None]:
    """Inside: this process works alone (:func:`active` is False, no sinklab collectives, :func:`world_size` 1).

    :func:`rank` and :func:`is_main` keep the launcher's answer."""
    token = _LOCAL.set(True)
    try:
        yield
    finally:
        _LOCAL.reset(token)


def rank() -> int:
    """This process's rank (0 in one process). Inside :func:`local` still the launcher's rank."""
    dist = _dist()
    return dist.get_rank() if dist is not None and dist.is_initialized() else 0


def world_size() -> int:
    """Number of processes (1 in one process)."""
    return _dist().get_world_size() if active() else 1


def is_main() -> bool:
    """True on the process that writes files and prints (rank 0; the only process when not launched)."""
    return rank() == 0


def local_device(device: str | None) -> str | None:
    """``cuda`` without an index becomes this process's GPU (``cuda:LOCAL_RANK``) under a launcher."""
    if device is not None and launched() and device == "cuda":
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


def _comm_device() -> torch.device:
    dist = _dist()
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _collective(name: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except SinklabError:
        raise
    except (RuntimeError, ConnectionError, OSError) as exc:  # a peer died, or the timeout passed
        raise DistributedError(
            f"{name} on rank {rank()} of {world_size()} failed: another rank exited or did not answer within "
            f"{timeout_seconds():g} s ({TIMEOUT_ENV}); see the other ranks' errors. ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc


_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def all_reduce(tensor: Tensor, op: str = "sum") -> Tensor:
    """``tensor`` reduced over ranks with ``op`` (``sum``, ``max``, ``min``); a new tensor on ``tensor``'s device.

    No-op (``tensor`` itself) in one process. Booleans are reduced as integers (sum: counts; max: any). Waits
    at most :func:`timeout_seconds` (read at each call), then raises :class:`DistributedError`.
    """
    if not active():
        return tensor
    dist = _dist()
    work = tensor.to(_comm_device(), torch.int64 if tensor.dtype == torch.bool else tensor.dtype, copy=True)
    wait = datetime.timedelta(seconds=timeout_seconds())  # read now: the environment may have changed since init

    def reduce() -> None:
        dist.all_reduce(work, op=getattr(dist.ReduceOp, _OPS[op]), async_op=True).wait(timeout=wait)

    _collective("all_reduce", reduce)
    return work.to(tensor.device)


def gather_rows(local: Tensor, start: int, total: int) -> Tensor:
    """The ``[total, ...]`` tensor whose rows ``start : start + len(local)`` are this rank's ``local``.

    Every rank passes its own disjoint row range (together they cover ``0 … total − 1``); each gets the
    full tensor. Implemented as a sum of zero-filled tensors, which is exact (``x + 0 = x``, NaN and inf
    included). One process: ``local`` itself.
    """
    if not active():
        return local
    full = torch.zeros((total, *local.shape[1:]), dtype=torch.int64 if local.dtype == torch.bool else local.dtype)
    full[start : start + local.shape[0]] = local.to(full.dtype)
    out = all_reduce(full, "sum")
    return out.bool() if local.dtype == torch.bool else out


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order. One process: ``[obj]``."""
    if not active():
        return [obj]
    out: list[object] = [None] * world_size()
    _collective("all_gather_object", _dist().all_gather_object, out, obj)
    return out


def broadcast_object(obj: object, src: int = 0) -> object:
    """Rank ``src``'s ``obj`` on every rank. One process: ``obj``."""
    if not active():
        return obj
    box = [obj if rank() == src else None]
    _collective("broadcast_object_list", _dist().broadcast_object_list, box, src=src)
    return box[0]


def barrier() -> None:
    """Wait for every rank (no-op in one process)."""
    if active():
        all_reduce(torch.zeros(1), "sum")


def shutdown() -> None:
    """Leave the process group if one is initialised (end of a launched command)."""
    dist = _dist()
    if dist is not None and dist.is_initialized():
        dist.destroy_process_group()


def batch_shares(sizes: Sequence[int], world: int | None = None) -> list[tuple[int, int]]:
    """Contiguous batch ranges ``[(first, stop), …]`` per rank, balanced by sample count.

    ``sizes`` are the batch sizes in order. Rank ``r`` takes the batches whose first sample falls in the
    ``r``-th ``1/world`` of the samples, so whole batches move and sample order is kept. Raises
    :class:`DistributedError` when there are fewer batches than ranks.
    """
    world = world_size() if world is None else world
    n = len(sizes)
    if n < world:
        raise DistributedError(f"{n} batch(es) cannot be split over {world} processes: give more samples or a "
                               "smaller --batch-size (at least one batch per process)")
    total = sum(sizes)
    starts = [sum(sizes[:i]) for i in range(n)]
    bounds = [0]
    for r in range(1, world):  # first batch starting at or after r/world of the samples, ≥ 1 batch each
        target = next((i for i in range(n) if starts[i] * world >= r * total), n)
        bounds.append(min(max(target, bounds[-1] + 1), n - (world - r)))
    bounds.append(n)
    return [(bounds[r], bounds[r + 1]) for r in range(world)]


@contextmanager
def together(what: str) -> Iterator[None]:
    """Run a rank's local share of ``what``; if any rank raised inside, every rank raises on exit.

    The failing rank re-raises its own error (after telling the others); the other ranks raise
    :class:`DistributedError` naming the failed ranks. One process: runs the body unchanged.
    """
    if not active():
        yield
        return
    failed = torch.zeros(world_size(), dtype=torch.int64)
    try:
        yield
    except BaseException:
        failed[rank()] = 1
        try:
            all_reduce(failed, "sum")
        except DistributedError:
            pass
        raise
    failed = all_reduce(failed, "sum")
    if bool(failed.any()):
        ranks = failed.nonzero()[:, 0].tolist()
        raise DistributedError(f"{what}: rank(s) {ranks} of {world_size()} failed (see their error); "
                               f"rank {rank()} stops too")


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a ``DistributedDataParallel`` wrapper (any other model: itself)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def fsdp_root(model: nn.Module) -> nn.Module | None:
    """The outermost FSDP2 module of ``model`` (``torch.distributed.fsdp.fully_shard``), or None.

    A legacy ``FullyShardedDataParallel`` wrapper (flat parameters) raises :class:`DistributedError`.
    """
    dist = _dist()
    if dist is None:
        return None
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    for module in model.modules():
        if isinstance(module, FullyShardedDataParallel):  # pragma: no cover - legacy wrapper, not built in tests
            raise DistributedError("the model is wrapped in the legacy FullyShardedDataParallel (FSDP1); sinklab "
                                   "supports FSDP2: torch.distributed.fsdp.fully_shard (accelerate: fsdp_version 2)")
        if isinstance(module, FSDPModule):
            return module
    return None



@contextmanager
def probe_ranks(model: nn.Module) -> Iterator[bool]:
    """Context for an extra forward of a training model (a probe); yields whether this rank runs it.

    FSDP2 (:func:`fsdp_root`): every rank must run the forward (each layer's parameters are all-gathered
    when it runs), so every rank yields True; the root's own parameters (embeddings, final norm) are
    gathered for the duration (``unshard`` / ``reshard``), since a probe calls the base model below the
    root. Otherwise (one process, DDP, a plain model beside a launcher): only the main process runs it.
    """
    root = fsdp_root(model)
    if root is None:
        yield is_main()
        return
    root.unshard()  # type: ignore[operator]  # an FSDPModule method (nn.Module's typing sees a tensor or module)
    try:
        yield True
    finally:
        root.reshard()  # type: ignore[operator]


def data_parallel(model: nn.Module) -> nn.Module:
    """``model`` in ``DistributedDataParallel`` under a launcher (gradients averaged over ranks), else itself.

    The returned module is the one to call for training; ``model`` itself stays the plain module (a
    :class:`~sinklab.monitor.SinkMonitor` or a checkpoint writer uses it).
    """
    if not active():
        return model
    from torch.nn.parallel import DistributedDataParallel

    device = next(model.parameters()).device
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
