"""``ds_recycle.initialize``'s DeepSpeed arguments that concern the process group, honoured as DeepSpeed does."""
from __future__ import annotations

import pytest
import torch.distributed as dist


def test_initialize_without_an_initialized_world_and_dist_init_required_false_says_how() -> None:
    """As ``deepspeed.initialize``: ``dist_init_required=False`` means the script initialised torch.distributed."""
    from ds_recycle.api import _init_distributed

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="dist_init_required=None or True"):
        _init_distributed(29500, False)
