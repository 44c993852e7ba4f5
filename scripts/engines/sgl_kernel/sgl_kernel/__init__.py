"""A torch-native stand-in for `sgl_kernel` on hosts where no CPU build of it exists.

SGLang 0.5.23's CPU engine (SGLANG_USE_CPU_ENGINE=1) imports a few helpers from sgl_kernel
at import time, e.g. `assign_req_to_token_pool_cpu` (srt/mem_cache/allocation.py:45-46). The
index's sgl-kernel and sglang-kernel wheels hold CUDA libraries only. This package registers
no `torch.ops.sgl_kernel` op, so SGLang's checks for them
(srt/utils/common.py `_is_intel_amx_backend_available`: `convert_weight_packed`) fail and it
takes its torch-native paths; it only provides the helpers those paths still call. The
helpers of speculative decoding and of KV-cache moves are there by name (SGLang imports
them at import time) and say, when called, that the stand-in has none.
"""

from __future__ import annotations

import torch

__version__ = "0.1.0+areal.cpu"


def _missing(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: the torch-native sgl_kernel stand-in does not provide it "
            "(speculative decoding and KV-cache moves need a real CPU build of sgl-kernel)"
        )

    call.__name__ = name
    return call


# Imported at import time: kernels/ops/kvcache/cache_move.py:9-10,
# kernels/ops/speculative/cache_locs.py:27-31, spec_tree.py:39-43, and the speculative
# workers and the AMX attention backend (srt/layers/attention/intel_amx_backend.py:438).
for _name in (
    "copy_all_layer_kv_cache_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "build_draft_decode_metadata_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
):
    globals()[_name] = _missing(_name)
del _name


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new cache slots into its row of the token pool: request i
    takes the next end[i]-start[i] entries of `out_cache_loc` at columns start[i]..end[i]
    (the Triton kernel `assign_req_to_token_pool`, allocation.py, does the same)."""
    del pool_len  # the row length; req_to_token's shape says it
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n
