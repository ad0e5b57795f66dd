"""Only the compiled loops of the metric engine; everything else is in pyproject.toml.

The extension is optional: without a C compiler the install goes on and the engine runs its
torch implementation (see mismatch_monitor/engine/native.py).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "mismatch_monitor.engine._native",
            sources=["mismatch_monitor/engine/_native.c"],
            # no errno from math functions and no FP traps: lets comparisons vectorize; the
            # loops never read errno or FP exception flags
            extra_compile_args=["-O3", "-fno-math-errno", "-fno-trapping-math"],
            optional=True,
        )
    ]
)
