"""Verify: the loop that compiles a plan, checks XLA's own memory analysis against the
budget and plans again until one fits, and the on-disk cache of verified plans.

Above the planners and the config; the decorator (``jaxmem.optimize``) sits on top of it.
"""
