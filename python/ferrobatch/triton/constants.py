"""Names PyTriton's callables and decorators agree on (``pytriton.constants``)."""

#: The keyword argument :func:`~ferrobatch.triton.decorators.triton_context`
#: passes, and the attribute a bound callable carries its context in
#: (``__triton_context__``).
TRITON_CONTEXT_FIELD_NAME = "triton_context"
TRITON_CONTEXT_ATTRIBUTE = "__triton_context__"
#: The header that carries an access token to restricted API groups
#: (PyTriton's ``pytriton.triton.TRITON_ACCESS_HEADER``; over gRPC with
#: Triton's ``triton-grpc-protocol-`` prefix).
TRITON_ACCESS_HEADER = "triton-access-token"
