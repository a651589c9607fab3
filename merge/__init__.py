"""Task-vector merging: MonoSoup, SVD soup, OPCM, TIES/DARE and the K-Merge LoRA pool.

Nothing lives here yet: the merge methods arrive with the MonoSoup training callback (issue 3)
and the merge toolkit (issue 7).
"""
