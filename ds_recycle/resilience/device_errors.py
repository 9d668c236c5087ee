"""Sticky device errors: a GPU fault after which the process cannot go on, but the job can.

CUDA's runtime documents a set of errors after which the process's CUDA context is unusable: every later CUDA call
returns the same error, and only a new process can use the device again (CUDA Runtime API, ``cudaError``
enumeration: ``cudaErrorIllegalAddress``, ``cudaErrorLaunchTimeout``,
``cudaErrorHardwareStackError``, ``cudaErrorIllegalInstruction``, ``cudaErrorMisalignedAddress``,
``cudaErrorInvalidAddressSpace``, ``cudaErrorInvalidPc``, ``cudaErrorLaunchFailure``), to which this module adds the
uncorrectable memory and link errors (``cudaErrorECCUncorrectable``, ``cudaErrorNvlinkUncorrectable``). A worker
that meets one is a lost worker, like a killed one: it leaves with the launcher's *lost* exit code
(:func:`ds_recycle.launcher.bootstrap.main`), its peers re-route its micro-batches, and the launcher's restart
brings it back as a rejoiner on a fresh CUDA context.

A device-side assert (``cudaErrorAssert``) is sticky too, but it is the program's own error: the same micro-batch
would assert again on whichever peer ran it, so it stays an error that fails the job.

Torch raises these as ``torch.AcceleratorError`` (a ``RuntimeError``) with the CUDA code in ``error_code``, and
older versions as a plain ``RuntimeError`` whose message starts ``CUDA error: <cudaGetErrorString text>``: both
are recognised, also when another exception wraps them (``raise ... from``).
"""
from __future__ import annotations

from collections.abc import Mapping

__all__ = ["STICKY_CUDA_ERRORS", "sticky_device_error"]

STICKY_CUDA_ERRORS: Mapping[int, str] = {
    214: "uncorrectable ECC error encountered",
    220: "uncorrectable NVLink error detected during the execution",
    700: "an illegal memory access was encountered",
    702: "the launch timed out and was terminated",
    714: "hardware stack error",
    715: "an illegal instruction was encountered",
    716: "misaligned address",
    717: "operation not supported on global/shared address space",
    718: "invalid program counter",
    719: "unspecified launch failure",
}
"""CUDA error code -> ``cudaGetErrorString`` text, for the errors a worker leaves on as lost."""


def sticky_device_error(exc: BaseException | None) -> str | None:
    """The sticky CUDA error (its text) that ``exc`` is or was raised from, or None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        code = getattr(exc, "error_code", None)
        if isinstance(code, int) and code in STICKY_CUDA_ERRORS:
            return STICKY_CUDA_ERRORS[code]
        if isinstance(exc, RuntimeError):
            message = str(exc)
            if "CUDA error" in message:
                for text in STICKY_CUDA_ERRORS.values():
                    if text in message:
                        return text
        exc = exc.__cause__ or exc.__context__
    return None
