"""Load this repo's built CUDA variant (build/torch{XY}-cxx11-cu{NNN}-x86_64-linux) for the CUDA benchmarks."""
import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def load_cuda_variant(module_name="kda_cuda_bench"):
    """Import build/<this torch's CUDA variant> as `module_name`; fails unless its native CUDA library loaded."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    path = ROOT / "build" / f"torch{major}{minor}-cxx11-cu{torch.version.cuda.replace('.', '')[:3]}-x86_64-linux"
    spec = importlib.util.spec_from_file_location(module_name, path / "__init__.py",
                                                  submodule_search_locations=[str(path)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    assert mod.BACKEND == "cuda" and mod.NATIVE, f"{path}: not a CUDA build with its native library loaded"
    return mod
