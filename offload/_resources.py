"""What a manager holds that must be closed: its executor, tiers and host pool claim, made at
its first step; and how they are closed (by ``close()``, or by the finalizer when a manager is
dropped without it, maybe inside a GC pass on any thread).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any

import torch

from offload import storage
from offload._config import OffloadConfig
from offload._device import RoomProbe, room_probe
from offload._executor import Executor
from offload.storage._transfer import close_later, in_gc_pass, start_closer


def _make_executor(
    config: OffloadConfig,
    device: torch.device,
    *,
    cpu_budget_default: bool,
    engine: storage.CopyEngine | None,
    room: RoomProbe | None,
) -> tuple[Executor, list[storage.Tier], list[Any]]:
    """The executor of a manager with ``config``, its tiers, and every resource to close
    (the executor first, then the tiers, then the claim on the shared host pool)."""
    cfg = config
    inflight = cfg.max_inflight_bytes  # 0: the executor's automatic bound
    # NVMe records pass through pinned staging on their way out and back in: the pool holds
    # room for that (copies out in flight plus the reload window) beyond the host tier's
    # cpu_budget, so a full host tier can still spill.
    staging = 2 * (inflight or 256 << 20) if "nvme" in cfg.tiers else 0
    # The process-wide pool, with room for this manager's own budget beside the others'
    # (pipeline stages on one rank each have a manager); its free slabs go back to the host
    # when the last manager closes. Staging room is claimed for at least 256 MiB each way
    # (the automatic in-flight bound's floor): a record larger than a small explicit bound
    # still goes out, alone.
    share = storage.claim_shared_host_pool(
        cfg.cpu_budget_bytes,
        staging_bytes=max(staging, 2 * (256 << 20)) if staging else 0,
        default=cpu_budget_default,
        pin_memory=device.type == "cuda",
    )
    pool = share.pool
    tiers: list[storage.Tier] = []
    try:
        for name in cfg.tiers:
            if name == "cpu":
                tiers.append(storage.HostTier(pool, copy_engine=engine))
            else:
                assert cfg.nvme_dir is not None
                # File writes can stall for long: a close from a GC pass hands its wait
                # to the closer, started here, where starting a thread is safe.
                start_closer()
                tiers.append(
                    storage.NvmeTier(
                        cfg.nvme_dir,
                        pool=pool,
                        copy_engine=engine,
                        # Its I/O threads wait on this device's events: see cuda_device.
                        cuda_device=device.index if device.type == "cuda" else None,
                    )
                )
        ex = Executor(
            device=device,
            tiers=tiers,
            cpu_budget_bytes=cfg.cpu_budget_bytes,
            max_inflight_bytes=inflight,
            prefetch_bytes=inflight,
            pool=pool,
            staging_bytes=staging,
            room=room if room is not None else room_probe(device),
        )
    except BaseException:
        # Nothing holds these yet (an nvme_dir removed since the manager was made, say):
        # each later step would try again and claim room on the shared pool again.
        _close_all([*tiers, share])
        raise
    return ex, tiers, [ex, *tiers, share]


def _close_resources(handles: list[Any], resources: list[Any], recompute: dict[str, Any]) -> None:
    for h in handles:
        with contextlib.suppress(Exception):
            h.remove()
    _uninstall_forwards(recompute)
    close = functools.partial(_close_all, resources)
    # Closing waits for the transfers in flight. In a GC pass, which runs on whatever thread
    # allocated (the training thread, mid-step), a stalled disk write held it there: the wait
    # goes to the background closer (NOTE [ Closing in the background ] in storage/_transfer.py).
    running = any(isinstance(r, storage.Tier) and r.transfers_running for r in resources)
    if running and in_gc_pass() and close_later(close):
        return
    # A GC pass on one of storage's threads may run this: closing waits for the transfers in
    # flight, that thread's own among them (a deadlock), so it goes to a thread of its own.
    if not storage.finish_elsewhere(close):
        close()


def _close_all(resources: list[Any]) -> None:
    for r in resources:  # the executor first, then the tiers
        # The executor's close waits on its events, maybe on the closer thread, which has no
        # current CUDA device: there it would create a context on device 0 (see NvmeTier's
        # cuda_device), so its device is made current for it.
        cuda = getattr(r, "cuda", False) is True
        with (
            contextlib.suppress(Exception),
            torch.cuda.device(r.device) if cuda else contextlib.nullcontext(),
        ):
            r.close()


def _uninstall_forwards(
    installed: dict[str, tuple[weakref.ref[Any], weakref.ref[Any], bool]],
) -> None:
    """Give modules their own forward back where a RecomputeForward still stands in for it: the
    one set on the instance if there was one (dropping it ran the class's forward instead), else
    the class's."""
    for mod_ref, wrapper_ref, own in installed.values():
        mod, wrapper = mod_ref(), wrapper_ref()
        if mod is not None and wrapper is not None and mod.__dict__.get("forward") is wrapper:
            if own:
                mod.forward = wrapper.forward
            else:
                del mod.forward
    installed.clear()
