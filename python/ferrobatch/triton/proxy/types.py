"""The request an inference callable gets (``pytriton.proxy.types``)."""

from .._binding import Request

__all__ = ["Request"]
