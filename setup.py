"""Only the compiled loops (the metric engine's, and the padded layout's row scan); everything
else is in pyproject.toml.

The extensions are optional: without a C compiler the install goes on, the engine runs its
torch implementation (see mismatch_monitor/engine/native.py) and padded batches take numpy
(mismatch_monitor/batch_layout.py).
"""

import os
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# Flags used where the compiler takes them: GCC's generic tuning turns vector gathers off (slow
# on some older CPUs); the histogram-bin lookups of the token pass are gathers, and on CPUs
# with fast gathers they take about 15% off the pass.
OPTIONAL_FLAGS = ["-mtune-ctrl=use_gather_2parts,use_gather_4parts,use_gather"]


class BuildExt(build_ext):
    def build_extensions(self) -> None:
        extra = [flag for flag in OPTIONAL_FLAGS if self._accepts(flag)]
        for ext in self.extensions:
            ext.extra_compile_args = list(ext.extra_compile_args) + extra
        super().build_extensions()

    def _accepts(self, flag: str) -> bool:
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "probe.c")
            with open(src, "w") as f:
                f.write("int main(void) { return 0; }\n")
            try:
                self.compiler.compile([src], output_dir=tmp, extra_postargs=["-Werror", flag])
            except Exception:
                return False
            return True


setup(
    ext_modules=[
        Extension(
            "mismatch_monitor.engine._native",
            sources=["mismatch_monitor/engine/_native.c", "mismatch_monitor/engine/_merge.c"],
            # no errno from math functions and no FP traps: lets comparisons vectorize; the
            # loops never read errno or FP exception flags. No fused multiply-adds the source does
            # not write: every compiler and every per-ISA build then rounds the same way and gives
            # bit-identical statistics (GCC contracts a * b + c by default, clang does not)
            extra_compile_args=["-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"],
            optional=True,
        ),
        # the padded layout's rows (mask scan and run copies), read by mismatch_monitor/batch_layout.py
        Extension("mismatch_monitor._padded", sources=["mismatch_monitor/_padded.c"], extra_compile_args=["-O3"],
                  optional=True),
    ],
    cmdclass={"build_ext": BuildExt},
)
