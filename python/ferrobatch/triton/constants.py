"""Names PyTriton's callables and decorators agree on (``pytriton.constants``)."""

#: The keyword argument :func:`~ferrobatch.triton.decorators.triton_context`
#: passes, and the attribute a bound callable carries its context in
#: (``__triton_context__``).
TRITON_CONTEXT_FIELD_NAME = "triton_context"
TRITON_CONTEXT_ATTRIBUTE = "__triton_context__"
