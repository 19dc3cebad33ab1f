"""Benchmarks of norm_optim, run from the repository root (``python -m benchmarks.param_norm``).

A regular package, so that no installed distribution that ships a top-level ``benchmarks``
can shadow it (a namespace package loses to any regular one on ``sys.path``).
"""
