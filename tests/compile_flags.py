"""XLA:CPU compile settings for the test suite: compile fast, run a little slower.

The suite's programs are small and each runs a few steps, so most of its time is XLA:CPU
compiling them, and most of that is LLVM generating and optimising machine code (the HLO passes
took 0.6 s of the 10 s of compiling in ``tests/dp/test_semisync.py``, read from XLA's pass
timings). These flags turn LLVM's optimisation down (``--xla_backend_optimization_level=0``)
and its costliest passes off, and have XLA:CPU emit its fusions with its older emitters
(``--xla_cpu_use_fusion_emitters=false``), which generate far less code than the MLIR-based
ones. The first two change no HLO pass; the third changes which elementwise ops XLA:CPU fuses
(a 6-layer FSDP step: 17 fusions instead of 22), not the collectives, the schedule or the
buffer sizes (its ``memory_analysis()`` and a scanned step's were byte for byte the same),
so every collective and memory check of the tests reads what a default compile gives.
Measured on the 2-core CI machine: ``tests/nn/test_llama_blocks.py`` 57 s -> 36 s,
``tests/dp/test_fsdp_unrolled.py`` with ``tests/nn/test_tensor_layers.py`` 126 s -> 95 s
(the first two); the whole suite 1689 s -> 1148 s with the third, XLA's compile time in the
tests' own processes 1358 s -> 608 s.

Set for the tests' own process (conftest), the processes the multi-process tests start and the
docs pages' sessions. Imports nothing: conftest reads it before JAX is imported.
"""

from jaxcoll._xla_flags import merge_flags  # imports nothing

FAST_COMPILE = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
    "--xla_cpu_use_fusion_emitters=false"
)


def with_fast_compile(xla_flags: str) -> str:
    """``xla_flags`` with each flag of :data:`FAST_COMPILE` it does not set itself."""
    return merge_flags(xla_flags, FAST_COMPILE.split())
