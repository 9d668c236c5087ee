"""Tuple payloads between stages: the header, and two ranks exchanging them through both channels."""
from __future__ import annotations

import pytest
import torch

from ds_recycle.engine.p2p import decode_header, encode_header, header_checks_order
from tests.engine.spawn import REPO, spawn


@pytest.mark.parametrize("payload", [
    torch.zeros(2, 3),
    torch.zeros((), dtype=torch.bfloat16),
    (torch.zeros(2, 3, 4), torch.ones(2, 3, dtype=torch.bool)),
    (torch.zeros(1, dtype=torch.int64), torch.zeros(2, 1, 1, 1, 1, 7, dtype=torch.float16), torch.zeros(5)),
])
def test_header_round_trip(payload: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
    is_tuple, specs = decode_header(encode_header(payload), peer=0)
    tensors = payload if isinstance(payload, tuple) else (payload,)
    assert is_tuple == isinstance(payload, tuple)
    assert specs == [(tuple(t.shape), t.dtype) for t in tensors]
    assert not header_checks_order(encode_header(payload)) and header_checks_order(encode_header(payload, True))


@pytest.mark.parametrize(("payload", "words"), [
    (tuple(torch.zeros(1) for _ in range(8)), "tuple of 1 to 7"),
    ((), "tuple of 1 to 7"),
    ((torch.zeros(1), [torch.zeros(1)]), "tuple of 1 to 7 tensors"),
    (torch.zeros(2, dtype=torch.complex64), "dtype torch.complex64"),
    (torch.zeros([1] * 7), "at most 6 dims"),
])
def test_header_refuses_what_it_cannot_describe(payload: object, words: str) -> None:
    with pytest.raises(TypeError, match=words):
        encode_header(payload)  # type: ignore[arg-type]


def test_malformed_header_is_reported_with_the_peer() -> None:
    meta = encode_header((torch.zeros(1), torch.zeros(1)))
    meta[8] = 99  # dtype id out of range
    with pytest.raises(RuntimeError, match="rank 3"):
        decode_header(meta, peer=3)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["peer", "bounded"])
def test_two_ranks_exchange_tuples_and_their_gradients(mode: str) -> None:
    outs = spawn(2, [str(REPO / "tests" / "engine" / "_tuple_p2p_job.py"), mode], timeout=90)
    assert [o.strip().splitlines()[-1] for o in outs] == ["OK 0", "OK 1"], outs


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("mode", "refusal"), [
    ("misordered", "message order broken: rank 0's next message to this worker is the activation of micro-batch 0.0, "
                   "iteration 0; this worker expected the activation of micro-batch 0.1, iteration 0"),
    ("mixed", "rank 0 names its messages and this worker does not: set DS_RECYCLE_CHECK_ORDER alike"),
])
def test_a_message_taken_out_of_order_is_refused_naming_both(mode: str, refusal: str) -> None:
    """Messages match per pair in posting order (no tags); with the order check on, asking for the second message
    first fails at once instead of filling the buffer with the first; so does a job whose workers disagree on the
    check."""
    outs = spawn(2, [str(REPO / "tests" / "engine" / "_tuple_p2p_job.py"), mode], timeout=90)
    assert f"REFUSED {refusal}" in outs[1], outs
