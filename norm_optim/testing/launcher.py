"""Run a function on N gloo ranks, each a fresh child process, and collect the results.

Fresh processes per call keep megatron's global parallel state from leaking between tests.
``fork`` is the default: when the parent has already imported megatron, a world of 8 starts
in about a second on 2 cores, against ~20 s with ``spawn`` (each child re-imports megatron).

Failures never hang the caller: an exception on a rank is re-raised in the parent with the
rank and the child's traceback; a rank that dies without reporting (``os._exit``, a signal)
is reported with its exit code (and, for a fatal signal, the Python stacks it printed); a run
that outlives ``timeout`` has every child's Python stack dumped and is then killed.

``torch.compile`` is off in the ranks unless asked for: a forked child traces again every
compiled function megatron calls (the MoE router's, the fusions'), a second or more per rank
on a CPU, for kernels no norm depends on.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RankFailedError", "RankTimeoutError", "init_parallel", "run_ranks"]

# How long hung children get to write their stacks after SIGUSR1, before they are killed.
_STACK_DUMP_GRACE_S = 1.0
# How long ranks that reported a result get to destroy their process groups.
_TEARDOWN_GRACE_S = 5.0
_GLOO_TIMEOUT_MARGIN_S = 60.0
# How long a rank's error waits for a dead peer's exit to show (the kernel closes a dying
# process's sockets, which the peer's collective fails on, just before it reaps it).
_DEATH_GRACE_S = 0.2


class RankFailedError(RuntimeError):
    """A rank raised, or died without reporting a result.

    Attributes:
        rank: the failing rank.
        remote_traceback: the child's formatted traceback (or why there is none).
    """

    def __init__(self, rank: int, message: str, remote_traceback: str) -> None:
        super().__init__(
            f"rank {rank} failed: {message}\n\n--- rank {rank} traceback ---\n{remote_traceback}"
        )
        self.rank = rank
        self.remote_traceback = remote_traceback


class _RankKilledError(RankFailedError):
    """A rank died of a signal before reporting (``signum``): native code crashed under it."""

    def __init__(self, rank: int, signum: int, stacks: str) -> None:
        try:
            name: object = signal.Signals(signum).name
        except ValueError:
            name = signum
        super().__init__(
            rank,
            f"process died with exit code {-signum} (signal {name})",
            stacks or "(no traceback: the process was killed before it could print one)",
        )
        self.signum = signum


class RankTimeoutError(TimeoutError):
    """The run did not finish within its timeout; the message holds the hung ranks' stacks."""

    def __init__(self, timeout: float, pending: list[int], stacks: dict[int, str]) -> None:
        dumps = "".join(f"\n--- rank {r} stacks ---\n{stacks.get(r) or '(none)'}" for r in pending)
        super().__init__(f"ranks {pending} did not finish within {timeout:g} s; killed.{dumps}")
        self.pending = pending
        self.stacks = stacks


@dataclass(frozen=True)
class _ChildSpec:
    rank: int
    world_size: int
    workdir: str
    cpu_shim: bool
    timeout: float
    compile: bool = False

    @property
    def stack_file(self) -> Path:
        return Path(self.workdir) / f"rank{self.rank}.stacks"


def init_parallel(
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    vpp: int | None = None,
    num_distributed_optimizer_instances: int = 1,
    **extra: Any,
) -> None:
    """Initialize megatron's parallel state in a child (the data-parallel size is implied).

    Args:
        tp, pp, cp, ep, etp, vpp: tensor, pipeline, context, expert, expert-tensor and virtual
            pipeline parallel sizes (``etp=None`` means equal to ``tp``).
        num_distributed_optimizer_instances: replicas of the distributed optimizer.
        extra: passed on to ``parallel_state.initialize_model_parallel``.
    """
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
        **extra,
    )


def _teardown() -> None:
    try:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    except ImportError:
        pass
    if dist.is_initialized():
        dist.destroy_process_group()


def _encode_error(exc: BaseException) -> tuple[str, str, bytes | None]:
    try:
        pickled: bytes | None = pickle.dumps(exc)
    except Exception:  # an unpicklable exception still reports its type and traceback
        pickled = None
    return f"{type(exc).__name__}: {exc}", traceback.format_exc(), pickled


def _child_main(
    spec: _ChildSpec, conn: Connection, fn: Callable[..., Any], args: tuple, kwargs: dict
) -> None:
    # Before any torch op: a forked child using the parent's thread count was seen to hang.
    torch.set_num_threads(1)
    if not spec.compile:
        torch._dynamo.config.disable = True  # compiled functions run as written
    with open(spec.stack_file, "w") as stacks:
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        faulthandler.enable(file=stacks, all_threads=True)  # a fatal signal's stacks
        try:
            os.environ.update(
                RANK=str(spec.rank),
                LOCAL_RANK=str(spec.rank),
                WORLD_SIZE=str(spec.world_size),
                LOCAL_WORLD_SIZE=str(spec.world_size),
            )
            if spec.cpu_shim:
                from norm_optim.testing.cpu import install_cpu_shim

                install_cpu_shim()
            dist.init_process_group(
                "gloo",
                init_method=f"file://{spec.workdir}/store",
                rank=spec.rank,
                world_size=spec.world_size,
                # Longer than the run's timeout, so a hang is reported by the parent with every
                # rank's stack, rather than as a gloo timeout on whichever rank gives up first.
                timeout=timedelta(seconds=spec.timeout + _GLOO_TIMEOUT_MARGIN_S),
            )
            # Pickle here, so that an unpicklable result is this rank's error, not a lost rank.
            message: tuple = ("ok", pickle.dumps(fn(*args, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
            message = ("error", *_encode_error(exc))
        conn.send(message)
        conn.close()
        _teardown()


def _death(rank: int, code: int, spec: _ChildSpec) -> RankFailedError:
    """The error for a rank that exited (``code``) without reporting."""
    if code < 0:  # killed by a signal
        stacks = spec.stack_file.read_text() if spec.stack_file.exists() else ""
        return _RankKilledError(rank, -code, stacks)
    return RankFailedError(
        rank,
        f"process died with exit code {code}",
        "(no traceback: the process exited without reporting)",
    )


def _raise_for_death(
    procs: list[multiprocessing.process.BaseProcess],
    conns: list[Connection],
    specs: list[_ChildSpec],
    ranks: list[int],
) -> None:
    """Raise for the first of ``ranks`` that died without reporting.

    Looked for before a rank's error is raised: a dead rank's closed connections are what its
    peers' collectives fail on, and a peer may report that first. (The ranks' results are
    not needed any more: an error is raised either way.)
    """
    deadline = time.monotonic() + _DEATH_GRACE_S
    for rank in ranks:
        procs[rank].join(max(0.0, deadline - time.monotonic()))
        code = procs[rank].exitcode
        if code is not None and not _reported(conns[rank]):
            raise _death(rank, code, specs[rank])


def _reported(conn: Connection) -> bool:
    """Whether a dead rank sent its message before it died (reading it, to know)."""
    try:
        conn.recv()
    except EOFError:
        return False
    return True


def _raise_for_error(rank: int, message: tuple) -> None:
    _, summary, remote_tb, pickled = message
    error = RankFailedError(rank, summary, remote_tb)
    original = None
    if pickled is not None:
        try:
            original = pickle.loads(pickled)
        except Exception:
            original = None
    raise error from original


def _stop(procs: list[multiprocessing.process.BaseProcess], ranks: list[int]) -> None:
    for rank in ranks:
        procs[rank].kill()
    for rank in ranks:
        procs[rank].join()


def _dump_stacks(
    procs: list[multiprocessing.process.BaseProcess], specs: list[_ChildSpec], ranks: list[int]
) -> dict[int, str]:
    for rank in ranks:
        pid = procs[rank].pid
        if pid is not None and procs[rank].is_alive():
            os.kill(pid, signal.SIGUSR1)
    time.sleep(_STACK_DUMP_GRACE_S)
    return {
        rank: specs[rank].stack_file.read_text()
        for rank in ranks
        if specs[rank].stack_file.exists()
    }


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    start_method: str = "fork",
    timeout: float = 120.0,
    cpu_shim: bool = True,
    compile: bool = False,
    crash_retries: int = 1,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks and return the results by rank.

    Each rank is a fresh child process that sets one torch thread, turns ``torch.compile`` off
    (unless ``compile=True``), installs the megatron CPU shim (unless ``cpu_shim=False``), joins
    a gloo process group through a private FileStore (so concurrent runs never collide on a
    port), runs ``fn``, then destroys megatron's parallel state and the process group. ``fn``
    reads its rank from ``torch.distributed.get_rank()``. With ``start_method="spawn"``,
    ``fn``, its arguments and results must be picklable.

    A world in which a rank was killed by a signal before it reported (a crash in native code:
    gloo, a forked child's thread pools) runs again, from the start, up to ``crash_retries``
    times, each with a ``RuntimeWarning`` that names the rank, the signal and its stacks; an
    exception, an exit code or a timeout is never retried.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``; results must be picklable.

    Raises:
        RankFailedError: the first rank to fail, with its traceback (chained from the original
            exception when that could be pickled), or a rank that died without a result.
        RankTimeoutError: not every rank finished within ``timeout`` seconds; all are killed.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    try:
        return _run_world(fn, world_size, args, kwargs, start_method, timeout, cpu_shim, compile)
    except _RankKilledError as crash:
        if crash_retries <= 0:
            raise
        warnings.warn(f"{crash}\n(running all {world_size} ranks again)", RuntimeWarning)
    return run_ranks(
        fn,
        world_size,
        *args,
        start_method=start_method,
        timeout=timeout,
        cpu_shim=cpu_shim,
        compile=compile,
        crash_retries=crash_retries - 1,
        **kwargs,
    )


def _run_world(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    kwargs: dict,
    start_method: str,
    timeout: float,
    cpu_shim: bool,
    compile: bool,
) -> list[Any]:
    """One run of every rank (:func:`run_ranks` without its retries)."""
    ctx: Any = multiprocessing.get_context(start_method)
    workdir = tempfile.mkdtemp(prefix="norm_optim_ranks_")
    specs = [
        _ChildSpec(r, world_size, workdir, cpu_shim, timeout, compile) for r in range(world_size)
    ]
    procs, conns = [], []
    try:
        for spec in specs:
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child_main,
                args=(spec, send, fn, args, kwargs),
                name=f"rank{spec.rank}",
                daemon=True,
            )
            proc.start()
            send.close()  # the parent keeps only the read end, so a dead child reads as EOF
            procs.append(proc)
            conns.append(recv)
        results = _collect(procs, conns, specs, timeout)
        for proc in procs:  # every rank has reported; let them tear down, but not for long
            proc.join(_TEARDOWN_GRACE_S)
        return results
    finally:
        _stop(procs, [r for r, p in enumerate(procs) if p.is_alive()])
        for conn in conns:
            conn.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _collect(
    procs: list[multiprocessing.process.BaseProcess],
    conns: list[Connection],
    specs: list[_ChildSpec],
    timeout: float,
) -> list[Any]:
    """Wait for one message per rank; raise on the first error, death or the deadline."""
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    pending = {conn: rank for rank, conn in enumerate(conns)}
    while pending:
        ready: list[Any] = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            ranks = sorted(pending.values())
            raise RankTimeoutError(timeout, ranks, _dump_stacks(procs, specs, ranks))
        for conn in ready:
            rank = pending.pop(conn)
            try:
                message = conn.recv()
            except EOFError:
                message = None
            if message is None:  # it died without reporting
                procs[rank].join()
                raise _death(rank, procs[rank].exitcode or 0, specs[rank])
            if message[0] == "error":
                _raise_for_death(procs, conns, specs, list(pending.values()))  # its cause
                _raise_for_error(rank, message)
            results[rank] = pickle.loads(message[1])
    return [results[rank] for rank in range(len(procs))]
