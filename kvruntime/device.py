"""Which device a worker actor's engine runs on: ``device: auto | cpu | cuda`` per role in the config
(``prefill.device``, ``decode.device``), resolved inside the actor against what torch sees and what
Ray assigned it (``num_gpus`` reserves GPUs; Ray then sets ``CUDA_VISIBLE_DEVICES`` to them, so the
actor's ``cuda`` is its own GPU).

- ``auto``: ``cuda`` when ``torch.cuda.is_available()`` and Ray assigned this actor a GPU
  (``ray.get_gpu_ids()`` not empty), else ``cpu``; a GPU reserved but not usable (a CPU build of
  torch, a driver problem) is logged, and the actor runs on the CPU.
- ``cuda``: that, or :class:`DeviceUnavailable` naming what is missing (the actor fails to start
  with it, and ``start_workers`` reports the line).
- ``cpu``: the CPU, whatever is assigned.
"""
from __future__ import annotations

import logging
from typing import Callable

from kvruntime.config.workers import DEVICES    # the one list (the config checks it first)

log = logging.getLogger(__name__)


class DeviceUnavailable(ValueError):
    """``device: cuda`` was asked for and this process cannot use a GPU."""


def ray_gpu_ids() -> list | None:
    """The GPUs Ray assigned this process (``ray.get_gpu_ids()``); None outside a Ray worker."""
    try:
        import ray
        if not ray.is_initialized():
            return None
        return list(ray.get_gpu_ids())
    except Exception:      # Ray missing, or no worker context
        return None


def cuda_available() -> bool:
    import torch
    return bool(torch.cuda.is_available())


def resolve_device(requested: str, role: str = "worker", *, cuda: Callable[[], bool] = cuda_available,
                   gpu_ids: Callable[[], list | None] = ray_gpu_ids) -> str:
    """``"cuda"`` or ``"cpu"`` for a ``role`` actor configured with ``device: requested``.
    ``cuda``/``gpu_ids``: what torch sees and what Ray assigned (tests replace them).
    Raises :class:`DeviceUnavailable` for ``cuda`` without a usable GPU, ``ValueError`` for an
    unknown ``requested``."""
    if requested not in DEVICES:
        raise ValueError(f"{role}.device must be one of {', '.join(DEVICES)}, got {requested!r}")
    if requested == "cpu":
        return "cpu"
    ids = gpu_ids()
    has_cuda = cuda()
    if requested == "cuda":
        if not has_cuda:
            raise DeviceUnavailable(
                f"{role}.device is cuda but torch sees no CUDA device here (torch.cuda.is_available() is False; "
                f"GPUs Ray assigned: {ids if ids is not None else 'not under Ray'}): is this a CUDA build of "
                f"torch, and does the node have a GPU? Use device: auto to fall back to the CPU")
        if ids is not None and not ids:
            raise DeviceUnavailable(f"{role}.device is cuda but Ray assigned this actor no GPU: set "
                                    f"{role}.num_gpus (e.g. 1)")
        return "cuda"
    if has_cuda and ids:
        return "cuda"
    if ids and not has_cuda:
        log.warning("%s: Ray assigned GPU(s) %s but torch sees no CUDA device; the engine runs on the CPU "
                    "(device: auto)", role, ids)
    return "cpu"
