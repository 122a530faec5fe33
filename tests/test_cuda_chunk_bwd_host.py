"""Host-side (CPU) check of the CUDA chunked backward's grad2 helpers (kernels_src/cuda/delta_chunk_bwd.cuh:
c2_intra / c2_rows / c2_cols, the sub-block form of the intra-chunk decay terms, and back_subst_col) against the
direct float64 definition. The helpers are __host__ __device__, so tests/cuda_host/check_grad2_c2.cu compiles
them with nvcc as host code and runs them thread by thread; no GPU needed. Skipped when nvcc is not installed.
The GPU tests (tests/test_cuda_chunk_bwd.py) check the kernels themselves.
"""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed: the host check compiles with nvcc")
def test_grad2_c2_helpers_match_float64(tmp_path):
    exe = tmp_path / "check_grad2_c2"
    subprocess.run(["nvcc", "-std=c++17", "-O2", "-x", "cu", f"-I{ROOT / 'kernels_src' / 'cuda'}",
                    str(ROOT / "tests" / "cuda_host" / "check_grad2_c2.cu"), "-o", str(exe)], check=True)
    r = subprocess.run([str(exe)], capture_output=True, text=True)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed: the host check compiles with nvcc")
def test_grad3_mma_helpers_match_float64(tmp_path):
    exe = tmp_path / "check_grad3_mma"
    subprocess.run(["nvcc", "-std=c++17", "-O2", "-x", "cu", f"-I{ROOT / 'kernels_src' / 'cuda'}",
                    str(ROOT / "tests" / "cuda_host" / "check_grad3_mma.cu"), "-o", str(exe)], check=True)
    r = subprocess.run([str(exe)], capture_output=True, text=True)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
