"""`flashdraft env`: what this installation sees, for bug reports and benchmark records.

Versions, the GPU, the kernel configuration that the given flags make (every field, defaults
included), where models and the tuned launch table are cached, and which of the two
environment variables flashdraft reads are set.
"""
from __future__ import annotations

import platform
from dataclasses import fields

from ..config import KernelConfig

# The only variables flashdraft itself reads (besides the usual CUDA_VISIBLE_DEVICES, HF_HOME).
ENVIRONMENT_VARIABLES = {"FLASHDRAFT_CACHE": "where example models, the tuned table and step costs live",
                         "FLASHDRAFT_API_KEY": "the server's API key, when --api-key is not given"}


def describe(kc: KernelConfig) -> str:
    import os

    import torch

    from .. import __version__
    from ..backends import kernels
    from ..loading.examples import cache_dir

    lines = [f"flashdraft {__version__}", f"python {platform.python_version()} "
             f"({platform.platform()})", f"torch {torch.__version__} (CUDA {torch.version.cuda})"]
    lines.append(f"triton {kernels.triton.__version__}" if kernels.available()
                 else "triton: not installed (the PyTorch paths serve)")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.1f} GiB, compute "
                         f"capability {p.major}.{p.minor}, {p.multi_processor_count} SMs")
    else:
        lines.append("GPU: none seen by torch (CPU only)")
    lines.append("kernel configuration:")
    lines += [f"  {f.name} = {getattr(kc, f.name)!r}" for f in fields(kc)]
    lines.append(f"model cache: {cache_dir()}")
    if kc.tuned_table is None:
        lines.append(f"tuned launch table: {kernels.user_table()} over the shipped "
                     f"{kernels.SHIPPED_TABLE}")
    else:
        lines.append(f"tuned launch table: {kc.tuned_table}")
    for name, what in ENVIRONMENT_VARIABLES.items():
        state = "set" if os.environ.get(name) else "not set"
        lines.append(f"${name}: {state} ({what})")
    return "\n".join(lines)
