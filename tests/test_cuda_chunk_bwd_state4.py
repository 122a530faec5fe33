"""The backward's state_fwd4 (kernels_src/cuda/delta_chunk_bwd_state_fwd4.cuh, KDA_CUDA_CHUNK_BWD_STATE_FWD=5, off
by default) against the default state_fwd3 (tf32, =4), and state_bwd4 (delta_chunk_bwd_state_bwd4.cuh,
KDA_CUDA_CHUNK_BWD_STATE_BWD=5 tf32 / 6 3xTF32, off by default) against state_bwd3 (=4 / =3), and all of them
against autograd through the float64 reference (tests/ref_delta.py) at DESIGN.md section 6 tolerances. The v4
kernels compute the v3 kernels' products in the same order (only their operand copies and fragment loads differ),
so the gradients must agree to fp32 rounding.

Needs a CUDA GPU: without one the module is skipped with the reason. The CPU emulation of the new index math is
tests/test_cuda_state_fwd4_emu.py.
"""
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False): the CUDA chunked-backward tests need an "
                "NVIDIA GPU", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
from ref_delta import assert_close  # noqa: E402
from test_cuda_chunk_bwd import _run, bwd_default_and_knob  # noqa: E402

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


@pytest.mark.parametrize("family", ["kda", "gdn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ["varlen_empty", "gva_4x", "odd_dims", "v200_blocks_varlen", "T200_gates_1e4",
                                  "extreme_gates", "T1000", "T1", "T63"])
def test_state_fwd4_matches_state_fwd3(family, case, dtype, monkeypatch):
    # default state_fwd3 (tf32) on the first call, state_fwd4 on the second; the same inputs, initial state and
    # cotangents. Same products in the same order: the fp32 outputs to 1e-6 (fp32 rounding of any reduction
    # order downstream), the bf16/fp16 ones to 1e-3 (a flipped last bit would be ~4e-3 on one element)
    monkeypatch.setenv("KDA_CUDA_CHUNK_BWD_STATE_FWD", "4")
    a, b = bwd_default_and_knob(family, case, dtype, 23, "STATE_FWD=5", monkeypatch)
    for name, x, y in zip(NAMES, a, b):
        assert torch.isfinite(x).all(), name
        assert torch.isfinite(y).all(), name
        assert_close(name, x.double().cpu(), y.double().cpu(), 1e-6 if name in ("dg", "dbeta", "dh0") else 1e-3)


@pytest.mark.parametrize("family", ["kda", "gdn"])
@pytest.mark.parametrize("case", ["random_T65", "varlen_empty", "gva_4x", "extreme_gates", "T200_correlated",
                                  "odd_dims", "T1000"])
def test_state_fwd4_reference(family, case, monkeypatch):
    # state_fwd4 in the whole backward against the float64 reference (bf16 inputs: the path it runs for)
    monkeypatch.setenv("KDA_CUDA_CHUNK_BWD_STATE_FWD", "5")
    _run(family, case, torch.bfloat16)


@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_state_fwd4_reference_without_state(family, monkeypatch):
    monkeypatch.setenv("KDA_CUDA_CHUNK_BWD_STATE_FWD", "5")
    _run(family, "varlen_empty", torch.bfloat16, with_state=False)
    _run(family, "random_T65", torch.float16, with_state=False)


@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_state_fwd4_fp32_inputs_fall_back(family, monkeypatch):
    # fp32 inputs run the fp32 SIMT state_fwd2 whatever the knob: the default's gradients to fp32 rounding (a tf32
    # kernel would move them by ~1e-4)
    monkeypatch.setenv("KDA_CUDA_CHUNK_BWD_STATE_FWD", "4")
    a, b = bwd_default_and_knob(family, "varlen_empty", torch.float32, 29, "STATE_FWD=5", monkeypatch)
    for name, x, y in zip(NAMES, a, b):
        assert_close(name, x.double().cpu(), y.double().cpu(), 1e-6)


STATE_BWD_PAIRS = [("4", "5"), ("3", "6")]  # (state_bwd3 mode, state_bwd4 mode): tf32, 3xTF32


@pytest.mark.parametrize("family", ["kda", "gdn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ["varlen_empty", "gva_4x", "odd_dims", "v200_blocks_varlen", "T200_gates_1e4",
                                  "extreme_gates", "T1000", "T1", "T63"])
@pytest.mark.parametrize("modes", STATE_BWD_PAIRS, ids=["tf32", "3xtf32"])
def test_state_bwd4_matches_state_bwd3(family, case, dtype, modes, monkeypatch):
    # state_bwd3 on the first call, state_bwd4 with the same products on the second (state_fwd3 both times)
    monkeypatch.setenv("KDA_CUDA_CHUNK_BWD_STATE_FWD", "4")
    monkeypatch.setenv("KDA_CUDA_CHUNK_BWD_STATE_BWD", modes[0])
    a, b = bwd_default_and_knob(family, case, dtype, 31, f"STATE_BWD={modes[1]}", monkeypatch)
    for name, x, y in zip(NAMES, a, b):
        assert torch.isfinite(x).all(), name
        assert torch.isfinite(y).all(), name
        assert_close(name, x.double().cpu(), y.double().cpu(), 1e-6 if name in ("dg", "dbeta", "dh0") else 1e-3)


@pytest.mark.parametrize("family", ["kda", "gdn"])
@pytest.mark.parametrize("case", ["random_T65", "varlen_empty", "gva_4x", "extreme_gates", "T200_correlated",
                                  "odd_dims"])
@pytest.mark.parametrize("mode", ["5", "6"])
def test_state_bwd4_reference(family, case, mode, monkeypatch):
    # state_bwd4 (with state_fwd4) in the whole backward against the float64 reference, bf16 inputs
    monkeypatch.setenv("KDA_CUDA_CHUNK_BWD_STATE_FWD", "5")
    monkeypatch.setenv("KDA_CUDA_CHUNK_BWD_STATE_BWD", mode)
    _run(family, case, torch.bfloat16)


@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_state_bwd4_reference_without_state(family, monkeypatch):
    monkeypatch.setenv("KDA_CUDA_CHUNK_BWD_STATE_FWD", "5")
    monkeypatch.setenv("KDA_CUDA_CHUNK_BWD_STATE_BWD", "5")
    _run(family, "varlen_empty", torch.bfloat16, with_state=False)
    _run(family, "random_T65", torch.float16, with_state=False)


@pytest.mark.parametrize("family", ["kda", "gdn"])
def test_state_bwd4_fp32_inputs_fall_back(family, monkeypatch):
    # fp32 inputs run the fp32 SIMT state_bwd2 whatever the knob
    monkeypatch.setenv("KDA_CUDA_CHUNK_BWD_STATE_BWD", "4")
    a, b = bwd_default_and_knob(family, "varlen_empty", torch.float32, 37, "STATE_BWD=5", monkeypatch)
    for name, x, y in zip(NAMES, a, b):
        assert_close(name, x.double().cpu(), y.double().cpu(), 1e-6)
