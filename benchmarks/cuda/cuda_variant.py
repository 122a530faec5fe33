"""Load this repo's built variants without the kernels library (the GPU machine lacks it) for the benchmarks, and
set the CUDA host code's knobs around a measurement."""
import contextlib
import importlib.util
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def load_variant_dir(path, module_name):
    """Import the built variant directory `path` as the package `module_name`."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(module_name, path / "__init__.py",
                                                  submodule_search_locations=[str(path)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_cuda_variant(module_name="kda_cuda_bench"):
    """Import build/<this torch's CUDA variant> as `module_name`; fails unless its native CUDA library loaded."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    path = ROOT / "build" / f"torch{major}{minor}-cxx11-cu{torch.version.cuda.replace('.', '')[:3]}-x86_64-linux"
    mod = load_variant_dir(path, module_name)
    assert mod.BACKEND == "cuda" and mod.NATIVE, f"{path}: not a CUDA build with its native library loaded"
    return mod


@contextlib.contextmanager
def knobs_set(knobs):
    """Sets the environment variables `knobs` (name -> value; the CUDA host code reads them at every call) for the
    body, then restores what was there before."""
    saved = {kn: os.environ.get(kn) for kn in knobs}
    os.environ.update(knobs)
    try:
        yield
    finally:
        for kn, val in saved.items():
            if val is None:
                os.environ.pop(kn, None)
            else:
                os.environ[kn] = val
