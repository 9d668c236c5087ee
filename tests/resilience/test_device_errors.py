"""Sticky CUDA errors are recognised, wrapped or not, and never taken for a peer's failure (no GPU needed: the
exceptions are the ones torch raises)."""
from __future__ import annotations

from typing import Any

import pytest

from ds_recycle.resilience.comm import bounded_wait
from ds_recycle.resilience.device_errors import STICKY_CUDA_ERRORS, sticky_device_error
from ds_recycle.resilience.errors import PeerFailure
from tests.harness import QuietDetector


class _CodedError(RuntimeError):
    """Stands for ``torch.AcceleratorError``, which carries the CUDA code."""

    def __init__(self, code: int) -> None:
        super().__init__(f"CUDA error {code}")
        self.error_code = code


def _wrapped(inner: BaseException) -> PeerFailure:
    try:
        try:
            raise inner
        except RuntimeError as e:
            raise PeerFailure("recv: broken") from e
    except PeerFailure as outer:
        return outer


@pytest.mark.parametrize(("error", "expected"), [
    (RuntimeError("CUDA error: uncorrectable ECC error encountered\nCUDA kernel errors might be ..."),
     "uncorrectable ECC error encountered"),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), "an illegal memory access was encountered"),
    (_CodedError(719), "unspecified launch failure"),
    (_wrapped(RuntimeError("CUDA error: unspecified launch failure")), "unspecified launch failure"),
    (RuntimeError("CUDA error: device-side assert triggered"), None),  # the program's error
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), None),
    (RuntimeError("[gloo] Connection closed by peer"), None),
    (_CodedError(710), None),  # cudaErrorAssert
    (ValueError("an illegal memory access was encountered"), None),  # not torch's error
])
def test_sticky_errors_are_named_and_others_are_not(error: BaseException, expected: str | None) -> None:
    assert sticky_device_error(error) == expected


def test_every_sticky_error_is_found_by_its_text() -> None:
    for code, text in STICKY_CUDA_ERRORS.items():
        assert sticky_device_error(RuntimeError(f"CUDA error: {text}")) == text, code


class _Work:
    def __init__(self, error: RuntimeError) -> None:
        self.error = error

    def wait(self, *args: Any) -> bool:
        raise self.error


def test_a_wait_that_meets_this_workers_gpu_error_raises_it_and_a_broken_pair_is_a_peer_failure() -> None:
    ecc = RuntimeError("CUDA error: uncorrectable ECC error encountered")
    with pytest.raises(RuntimeError) as raised:
        bounded_wait(_Work(ecc), QuietDetector(), "recv")
    assert raised.value is ecc
    with pytest.raises(PeerFailure, match="Connection closed"):
        bounded_wait(_Work(RuntimeError("[gloo] Connection closed by peer")), QuietDetector(), "recv")
