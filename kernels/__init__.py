"""Compute kernels: Triton implementations for CUDA, plain torch references, and dispatch functions.

The model calls only the dispatch functions; on CPU they run torch code paths.
"""
