"""Task-vector merging: MonoSoup, SVD soup, OPCM, TIES/DARE and the K-Merge LoRA pool.

Plain functions on one parameter's tensors, free of Lightning, so that the training callback
(``train/callbacks.py``, issue 3) and the merge toolkit (issue 7) can stream a model tensor by tensor.
"""
from deltafleet.merge.soup import (
    MERGE_METHODS,
    RANK_MODES,
    choose_rank,
    merge_param,
    monosoup_update,
    summarize,
    svd_truncate,
)

__all__ = ["MERGE_METHODS", "RANK_MODES", "choose_rank", "merge_param", "monosoup_update", "summarize",
           "svd_truncate"]
