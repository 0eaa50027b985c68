"""XLA:CPU compile settings for the test suite: compile fast, run a little slower.

The suite's programs are small and each runs a few steps, so most of its time is XLA:CPU
compiling them, and most of that is LLVM optimising the generated code. These flags turn LLVM's
optimisation down (``--xla_backend_optimization_level=0``) and its costliest passes off. They
change no HLO pass: the same fusions, schedules, collectives and buffer assignment (so every
``memory_analysis()`` the tests read) as a default compile, only slower machine code. Measured
on the 2-core CI machine: ``tests/nn/test_llama_blocks.py`` 57 s -> 36 s, ``tests/dp/
test_fsdp_unrolled.py`` with ``tests/nn/test_tensor_layers.py`` 126 s -> 95 s.

Set for the tests' own process (conftest), the processes the multi-process tests start and the
docs pages' sessions. Imports nothing: conftest reads it before JAX is imported.
"""

from jaxcoll._xla_flags import merge_flags  # imports nothing

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def with_fast_compile(xla_flags: str) -> str:
    """``xla_flags`` with :data:`FAST_COMPILE` added where it sets neither flag itself."""
    return merge_flags(xla_flags, FAST_COMPILE.split())
