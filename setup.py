"""The one compiled part of shardwise: its block-format kernels (src/shardwise/kernels/csrc).

Built by the package's own build with the system C compiler; nothing is downloaded and
torch is not a build requirement (the module takes data pointers as integers). Every ISA
variant is compiled into the one binary (per-function `#pragma GCC target`), and the
module picks among them at import by CPU features. `optional=True`: where it cannot be
built, the package installs without it and shardwise.kernels says in one line that it
runs the PyTorch fallback.
"""

from setuptools import Extension, setup

CSRC = "src/shardwise/kernels/csrc"

setup(
    ext_modules=[
        Extension(
            "shardwise.kernels._native",
            sources=[f"{CSRC}/{name}.c" for name in ("module", "act", "q32", "qk", "norm", "attn", "step", "f32")],
            depends=[f"{CSRC}/sw.h", f"{CSRC}/tile16.h"],
            extra_compile_args=["-O3", "-std=gnu11", "-fno-strict-aliasing", "-Wall", "-Wno-unused-function"],
            optional=True,
        )
    ]
)
