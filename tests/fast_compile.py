"""The XLA:CPU flags every process of the suite compiles with (imports nothing).

The suite's time is mostly XLA:CPU compiling small programs: LLVM's expensive passes off and
its lowest optimization level cut the CPU time of ``tests/dp/test_zero1.py`` from 34.2 s to
25.7 s (and 36.2 s to 27.8 s, run interleaved); the programs compute the same values. The
test process sets them (``conftest.py``), and so do the tests that start processes with an
``XLA_FLAGS`` of their own (the multi-process launcher, the docs' snippets).
"""

FAST_COMPILE = "--xla_llvm_disable_expensive_passes=true --xla_backend_optimization_level=0"
