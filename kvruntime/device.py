"""The torch device a worker actor runs on, from its role's config (``workers.prefill.device`` /
``workers.decode.device``: auto | cpu | cuda) and what the actor sees: whether torch finds a GPU
and which GPUs Ray gave this actor (none when the role's ``num_gpus`` is 0, or outside Ray)."""
from __future__ import annotations

from kvruntime.config.workers import WorkerConfig


def ray_gpu_ids() -> list:
    """The GPU ids Ray assigned to the calling actor; [] outside a Ray worker."""
    try:
        import ray
        return list(ray.get_gpu_ids()) if ray.is_initialized() else []
    except Exception:      # no Ray runtime here (tests, one process): no GPU assigned
        return []


def actor_device(role: WorkerConfig) -> str:
    """``cuda`` or ``cpu`` (see :meth:`WorkerConfig.resolve_device`)."""
    import torch
    return role.resolve_device(cuda_available=torch.cuda.is_available(), gpu_ids=ray_gpu_ids())
