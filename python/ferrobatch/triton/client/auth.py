"""PyTriton's ``pytriton.client.auth``: the headers that carry an access
token to a server whose API groups are restricted (see
:class:`ferrobatch.triton.triton.TritonSecurityConfig`), spelled per
protocol: as it is over HTTP, with Triton's ``triton-grpc-protocol-``
prefix over gRPC."""

from __future__ import annotations

from collections.abc import Mapping

from ..constants import TRITON_ACCESS_HEADER

__all__ = ["create_auth_headers", "extract_access_token_from_headers"]

#: The token's header over gRPC.
GRPC_ACCESS_HEADER = "triton-grpc-protocol-" + TRITON_ACCESS_HEADER


def create_auth_headers(access_token: str | None, protocol: str) -> dict[str, str]:
    """The header carrying ``access_token`` over ``protocol`` (``"http"`` or
    ``"grpc"``, any case); ``ValueError`` for no token or another protocol."""
    if not access_token:
        raise ValueError("access_token cannot be None or empty")
    kind = protocol.lower()
    if kind == "http":
        return {TRITON_ACCESS_HEADER: access_token}
    if kind == "grpc":
        return {GRPC_ACCESS_HEADER: access_token}
    raise ValueError(f"Invalid protocol '{protocol}'. Must be 'http' or 'grpc'")


def extract_access_token_from_headers(headers: Mapping[str, str] | None) -> str | None:
    """The token ``headers`` carry, in either protocol's header (None: none);
    ``ValueError`` when both are there with different tokens."""
    if not headers:
        return None
    http, grpc = headers.get(TRITON_ACCESS_HEADER), headers.get(GRPC_ACCESS_HEADER)
    if http is not None and grpc is not None and http != grpc:
        raise ValueError(
            f"Conflicting authentication headers found: '{TRITON_ACCESS_HEADER}' and '{GRPC_ACCESS_HEADER}'"
            " hold different tokens; send one token"
        )
    return http or grpc
