"""Which GPU a worker uses, and workers that share one.

DeepSpeed places a worker on the device numbered by its ``LOCAL_RANK``: ``PipelineModule`` moves its layers to
``get_accelerator().device_name(local_rank)`` and the engine calls ``get_accelerator().set_device(local_rank)``
(``deepspeed/runtime/pipe/module.py``, ``DeepSpeedEngine._set_distributed_vars``). A node running more workers
than it has GPUs (several stages on one GPU: a small job, a test, a check on a one-GPU machine) has no device
``cuda:<local_rank>``. There :func:`place_worker` installs a shared accelerator (:func:`shared_cuda_accelerator`) through DeepSpeed's
own extension point (``deepspeed.accelerator.set_accelerator``): it is DeepSpeed's CUDA accelerator with device
``i`` read as device ``i mod <GPUs>``, so every ``LOCAL_RANK`` names a real device and each GPU is shared by
the workers whose local ranks fall on it.

On a GPU, :func:`place_worker` also sets cuBLAS's fixed workspace (``CUBLAS_WORKSPACE_CONFIG``), which torch's
deterministic algorithms need there (``recycle.deterministic``).

Workers that share a GPU cannot share an NCCL communicator (NCCL needs one device per rank); their tensors
travel over gloo, staged through host memory (:mod:`ds_recycle.engine.devices`).
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["place_worker", "shared_cuda_accelerator", "worker_device_index", "workers_per_gpu"]


def worker_device_index(local_rank: int, devices: int) -> int:
    """The GPU of the worker with ``local_rank`` on a node whose workers see ``devices`` GPUs."""
    if devices < 1:
        raise ValueError(f"no CUDA device to place local rank {local_rank} on")
    return local_rank % devices


def shared_cuda_accelerator(devices: int) -> Any:
    """DeepSpeed's CUDA accelerator with device ``i`` read as ``i mod devices`` (DeepSpeed imported on use)."""
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    class SharedCudaAccelerator(CUDA_Accelerator):  # DeepSpeed's own CUDA accelerator, device numbers remapped
        """DeepSpeed's CUDA accelerator on a node with fewer GPUs than workers: device ``i`` is ``i mod devices``."""

        def _index(self, device_index: Any) -> Any:
            return device_index if device_index is None else worker_device_index(int(device_index), devices)

        def device_name(self, device_index: Any = None) -> str:
            return str(super().device_name(self._index(device_index)))

        def device(self, device_index: Any = None) -> Any:
            return super().device(self._index(device_index))

        def set_device(self, device_index: Any) -> None:
            super().set_device(self._index(device_index))

    return SharedCudaAccelerator()


def workers_per_gpu() -> int:
    """How many of this node's workers share each GPU (``LOCAL_WORLD_SIZE`` over the GPUs; 1 when none share)."""
    return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")) // max(torch.cuda.device_count(), 1), 1)


def place_worker(local_rank: int) -> torch.device | None:
    """Make this worker's GPU current (None on a CPU job). When the node runs more workers than it has GPUs
    (``LOCAL_WORLD_SIZE`` above the device count), DeepSpeed's accelerator becomes a
    :func:`shared_cuda_accelerator`, so that DeepSpeed's own placements land on the same GPU."""
    if not torch.cuda.is_available():
        return None
    # cuBLAS reads its workspace setting when its first handle is made: set before any kernel, so that
    # deterministic algorithms (recycle.deterministic, turned on by ds_recycle.initialize) can be deterministic
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    devices = torch.cuda.device_count()
    index = worker_device_index(local_rank, devices)
    torch.cuda.set_device(index)
    if workers_per_gpu() > 1:
        from deepspeed.accelerator import set_accelerator

        set_accelerator(shared_cuda_accelerator(devices))
        logger.info("%d workers share each of %d GPU(s): local rank %d on cuda:%d", workers_per_gpu(), devices,
                    local_rank, index)
    return torch.device("cuda", index)
