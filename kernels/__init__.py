"""Shared numerics of kvlab, installed as ``kvlab.kernels`` (see pyproject)."""
