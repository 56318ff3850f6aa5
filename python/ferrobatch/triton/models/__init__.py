"""Bound models (``pytriton.models``)."""
