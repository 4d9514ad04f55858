"""vLLM tensor parallel, pure: the device counts a model can be split over.

vLLM shards every attention layer's heads over its `--tensor-parallel-size` workers, so the
size must divide the model's attention heads (vLLM refuses to start otherwise). The engine
passes these sizes to the policy as `Want.split_sizes`, so it never plans a split vLLM refuses.
"""

from __future__ import annotations

__all__ = ["tensor_parallel_sizes"]


def tensor_parallel_sizes(attention_heads: int | None, n_devices: int) -> frozenset[int]:
    """The device counts (1..n_devices) that divide `attention_heads`; {1} when the heads are
    unknown (no config.json, or one that does not say): one device is always possible."""
    if n_devices < 1:
        return frozenset()
    if attention_heads is None or attention_heads < 1:
        return frozenset({1})
    return frozenset(k for k in range(1, n_devices + 1) if attention_heads % k == 0)
