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
@pytest.mark.parametrize("check", ["check_grad2_c2", "check_grad3_mma"])
def test_grad_helpers_match_float64(check, tmp_path):
    # check_grad2_c2: grad2's C2 helpers; check_grad3_mma: grad3's tile helpers, element by element
    exe = tmp_path / check
    subprocess.run(["nvcc", "-std=c++17", "-O2", "-x", "cu", f"-I{ROOT / 'kernels_src' / 'cuda'}",
                    str(ROOT / "tests" / "cuda_host" / f"{check}.cu"), "-o", str(exe)], check=True)
    r = subprocess.run([str(exe)], capture_output=True, text=True)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr


def _cuda_include():
    for d in ([Path(shutil.which("nvcc")).resolve().parent.parent / "include"] if shutil.which("nvcc") else []) + \
             [Path("/usr/local/cuda/include")]:
        if (d / "cuda_bf16.h").exists():
            return d
    return None


@pytest.mark.skipif(shutil.which("g++") is None or _cuda_include() is None,
                    reason="g++ or the CUDA headers (cuda_bf16.h) not installed: the emulation compiles the kernels "
                           "with g++")
def test_grad3_kernels_match_grad2_emulated(tmp_path):
    # the whole grad2_kernel and the five grad3 launches run on the CPU (tests/cuda_host/emu_grad3.cpp: the kernel
    # source compiled by g++, each block's threads as coroutines switched at __syncthreads), same random work
    # buffers, both families, K=V=128 and odd K/V with a partial chunk, mild gates and gates at -1e4
    exe = tmp_path / "emu_grad3"
    subprocess.run(["g++", "-std=c++17", "-O1", "-w", f"-I{_cuda_include()}", f"-I{ROOT / 'kernels_src' / 'cuda'}",
                    str(ROOT / "tests" / "cuda_host" / "emu_grad3.cpp"), "-o", str(exe)], check=True)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
