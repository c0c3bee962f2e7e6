"""The literature's planners, kept as baselines for the bench: checkpoints by threshold
search and Chen et al.'s √N segments (``sublinear``, ``chen``), vDNN's offloading
(``vdnn_*``), Q-learning swap scheduling (``qlearn``) and operation ordering (``order_*``).

They plan through the same registry and rules as the product's planners
(:mod:`jaxmem.planners`), and build on :mod:`jaxmem.planners._shared`.
"""
