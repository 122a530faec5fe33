"""Host-side (CPU) check of the CUDA chunked backward's helpers (kernels_src/cuda/delta_chunk_bwd.cuh: c2_intra,
the in-sub-block intra-chunk decay terms of grad3_ch2, back_subst_col of grad3_wy, and grad3's tile helpers)
against the direct float64 definition. (The whole-kernel CPU emulation of grad2 against grad3, emu_grad3.cpp, went
with grad2 and grad3_ch in session 9: the GPU tests check the grad3 kernels against the float64 reference.) The
helpers are __host__ __device__, so tests/cuda_host/check_grad2_c2.cu compiles them with nvcc as host code and
runs them thread by thread; no GPU needed. Skipped when nvcc is not installed. The GPU tests (tests/test_cuda_chunk_bwd.py) check the kernels themselves.
"""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed: the host check compiles with nvcc")
@pytest.mark.parametrize("check", ["check_grad2_c2", "check_grad3_mma"])
def test_grad_helpers_match_float64(check, tmp_path):
    # check_grad2_c2: the C2 helpers left (c2_intra, back_subst_col); check_grad3_mma: grad3's tile helpers
    exe = tmp_path / check
    subprocess.run(["nvcc", "-std=c++17", "-O2", "-x", "cu", f"-I{ROOT / 'kernels_src' / 'cuda'}",
                    str(ROOT / "tests" / "cuda_host" / f"{check}.cu"), "-o", str(exe)], check=True)
    r = subprocess.run([str(exe)], capture_output=True, text=True)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
