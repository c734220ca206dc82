"""Run test bodies on several CPU processes joined by gloo, with a hard deadline on each.

Starting a rank costs seconds (importing ``torch.distributed.tensor`` pulls in dynamo), so a
:class:`RankPool` starts ``world_size`` processes once, joins them in a gloo group through a
``file://`` rendezvous (no ports: parallel test runs never clash), and runs one job after another
on all of them: ``pool.run(worker, *args)`` calls ``worker(rank, world_size, *args)`` on every
rank and returns what each returned (picklable), by rank. The parent asserts on the results, so a
failure reads as a normal pytest assertion. No hang can block CI:

- every collective times out after the job timeout (the process group's ``timeout``), which
  raises on the waiting rank, and its traceback becomes the test's failure;
- a rank stuck elsewhere dumps its Python stacks (to stderr, which pytest shows with the failed
  test) and exits, 5 s later (``faulthandler.dump_traceback_later``);
- the parent waits for each job with a deadline 10 s past the job timeout, watching for ranks
  that died; on a raise, a dead rank or the deadline, it kills the ranks and fails the test with
  the ranks' tracebacks and exit codes. The next job starts a fresh pool.

``worker`` must be a module-level function (the ``spawn`` start method pickles it by name).

Example::

    @pytest.fixture(scope="module")
    def ranks(tmp_path_factory):
        with RankPool(tmp_path_factory.mktemp("ranks")) as pool:
            yield pool

    def test_x(ranks):
        for rank, result in enumerate(ranks.run(_worker, 3)):
            ...
"""

from __future__ import annotations

import datetime
import faulthandler
import queue
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2
JOB_TIMEOUT_S = 30.0
START_TIMEOUT_S = 40.0  # the first job also waits for the ranks' imports (a busy 2-core machine)


class RankPool:
    """``world_size`` gloo ranks on CPU, kept for several jobs (see the module docstring)."""

    def __init__(
        self, tmp_dir: Path, world_size: int = WORLD_SIZE, timeout_s: float = JOB_TIMEOUT_S
    ) -> None:
        self.tmp_dir, self.world_size, self.timeout_s = Path(tmp_dir), world_size, timeout_s
        self._procs: list[Any] = []
        self._jobs: list[Any] = []
        self._results: Any = None
        self._starts = 0

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, worker: Callable[..., Any], *args: Any) -> list[Any]:
        """``worker(rank, world_size, *args)`` on every rank; the results by rank."""
        if not dist.is_available() or not dist.is_gloo_available():
            pytest.skip("torch.distributed with gloo is not available")
        timeout_s = self.timeout_s
        if not self._procs:
            self._start()
            timeout_s += START_TIMEOUT_S
        for jobs in self._jobs:
            jobs.put((worker, args))
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s + 10
        while len(results) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=0.2)
            except queue.Empty:
                exited = {
                    r: p.exitcode for r, p in enumerate(self._procs) if p.exitcode is not None
                }
                if exited or time.monotonic() > deadline:
                    what = f"ranks exited, {{rank: code}} {exited}" if exited else "deadline passed"
                    self._kill()
                    pytest.fail(f"{worker.__name__}: {what} (job timeout {timeout_s:.0f} s)")
                continue
            if not ok:  # the peers may wait on the failed rank forever: stop them all
                time.sleep(0.5)  # a peer's own error, if it comes at once, tells more
                errors = {rank: value}
                while not self._results.empty():
                    r, ok, value = self._results.get()
                    if not ok:
                        errors[r] = value
                codes = {r: p.exitcode for r, p in enumerate(self._procs)}
                self._kill()
                pytest.fail(f"{worker.__name__} raised (exit codes {codes}):{_describe(errors)}")
            results[rank] = value
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Ask the ranks to leave the group and exit; kill those that do not."""
        if not self._procs:
            return
        for jobs in self._jobs:
            jobs.put(None)
        for p in self._procs:
            p.join(timeout=10)
        self._kill()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._starts += 1
        init_file = self.tmp_dir / f"rendezvous{self._starts}"
        self._jobs = [ctx.SimpleQueue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(rank, self.world_size, str(init_file), self._jobs[rank], self._results),
                kwargs={"timeout_s": self.timeout_s},
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
            p.join()
        self._procs, self._jobs = [], []


def _describe(errors: dict[int, str]) -> str:
    return "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))


def _serve(
    rank: int, world_size: int, init_file: str, jobs: Any, results: Any, *, timeout_s: float
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    while (job := jobs.get()) is not None:
        worker, args = job
        faulthandler.dump_traceback_later(timeout_s + 5, exit=True, file=sys.stderr)
        try:
            results.put((rank, True, worker(rank, world_size, *args)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
            return  # no barrier: the parent kills the peers
        finally:
            faulthandler.cancel_dump_traceback_later()
    # Every rank is done with every collective. Without the barrier, destroying the group while
    # the peer still used it aborted the process ("terminate called without an active
    # exception").
    dist.barrier()
    dist.destroy_process_group()
