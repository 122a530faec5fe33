"""The kernels library picks the torch-neuron variant when torch.neuron exists (stand-in module here), and the
built torch-neuron variant loads through get_kernel(version=N) from a local hub cache with the NKI simulator
standing in for the `nki` package."""
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from kernels.variants import VariantAccepted, VariantRejected, get_variants_local, resolve_variant

ROOT = Path(__file__).resolve().parents[1]
REPO = "kda-test-org/kda-kernels-neuron"


def _fake_build(tmp_path):
    tag = "torch{}{}".format(*torch.__version__.split("+")[0].split(".")[:2])
    names = ["torch-neuron", "torch-universal", f"{tag}-cxx11-cpu-x86_64-linux", f"{tag}-cxx11-cu128-x86_64-linux"]
    for name in names:
        (tmp_path / "build" / name).mkdir(parents=True)
    return tmp_path / "build", names


def test_neuron_variant_selected_when_torch_neuron_exists(tmp_path, monkeypatch):
    build, names = _fake_build(tmp_path)
    monkeypatch.setattr(torch, "neuron", types.ModuleType("torch.neuron"), raising=False)
    best, trace = resolve_variant(get_variants_local(build))
    assert best is not None and best.variant_str == "torch-neuron"
    accepted = [d.variant.variant_str for d in trace if isinstance(d, VariantAccepted)]
    assert accepted == ["torch-neuron", "torch-universal"]          # noarch neuron before universal
    rejected = {d.variant.variant_str: d.reason for d in trace if isinstance(d, VariantRejected)}
    assert all("neuron" in reason for reason in rejected.values()), rejected   # cpu/cuda arch builds refused


def test_neuron_variant_refused_without_torch_neuron(tmp_path, monkeypatch):
    build, _ = _fake_build(tmp_path)
    monkeypatch.delattr(torch, "neuron", raising=False)
    best, trace = resolve_variant(get_variants_local(build))
    assert best is not None and best.variant_str != "torch-neuron"
    reasons = {d.variant.variant_str: d.reason for d in trace if isinstance(d, VariantRejected)}
    assert "torch-neuron" in reasons and "neuron" in reasons["torch-neuron"]


def _sh(*args, env=None):
    res = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


@pytest.mark.skipif(not (ROOT / "scripts" / "build.py").is_file() or not (ROOT / "scripts" / "hub.py").is_file(),
                    reason="scripts/build.py and scripts/hub.py are the lead's; this test needs both")
def test_get_kernel_loads_built_neuron_variant_offline(tmp_path):
    out = tmp_path / "build"
    _sh(ROOT / "scripts/build.py", "--backends", "universal,neuron", "--version", 1, "--out", out)
    meta = json.loads((out / "torch-neuron" / "metadata.json").read_text())
    assert meta["backend"]["type"] == "neuron" and "nki" in meta["python-depends"]
    assert (out / "torch-neuron" / "nki" / "kda_chunk_fwd.py").is_file()
    _sh(ROOT / "scripts/hub.py", "lay", "--cache", tmp_path / "cache", "--repo-id", REPO, "--version", 1,
        "--build", out)
    code = f"""
        import sys, types
        import torch
        torch.neuron = types.ModuleType("torch.neuron")          # what torch-neuronx provides on Trainium
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        import nki_sim
        nki_sim.install(force=True)                              # the simulator stands in for the nki package
        from kernels import get_kernel
        m = get_kernel({REPO!r}, version=1)
        from ref_delta import ref_delta_rule, assert_close
        ops_mod = sys.modules[m.__name__ + "._ops"]
        assert ops_mod.BACKEND == "neuron", ops_mod.BACKEND
        ns = ops_mod.NAMESPACE
        for fam in ("kda", "gdn"):
            for op in ("chunk_fwd", "chunk_bwd", "recurrent_fwd", "recurrent_bwd", "recurrent_serve"):
                assert torch._C._dispatch_has_kernel_for_dispatch_key(f"{{ns}}::{{fam}}_{{op}}", "PrivateUse1")
        wr = sys.modules[m.__name__ + ".nki.torch_wrappers"]
        q = torch.randn(1, 20, 1, 32); k = torch.nn.functional.normalize(torch.rand(1, 20, 1, 32), dim=-1)
        v = torch.randn(1, 20, 1, 32); g = torch.nn.functional.logsigmoid(torch.randn(1, 20, 1, 32))
        b = torch.rand(1, 20, 1)
        o, s = wr.kda_chunk_fwd(q, k, v, g, b, 32 ** -0.5, None, None)
        ro, rs = ref_delta_rule(q, k, v, g, b)
        assert_close("o", ro, o, 1e-5)
        assert_close("state", rs, s, 1e-5)
        print("OK", ops_mod.VARIANT)
    """
    env = dict(os.environ, HF_HUB_OFFLINE="1", KERNELS_CACHE=str(tmp_path / "cache"))
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                         cwd=tmp_path)
    assert res.returncode == 0 and "OK torch-neuron" in res.stdout, res.stdout + res.stderr
