"""Transformers models on kda-kernels through `kernels.kernelize` (issue #4, docs/transformers.md).

Tiny random-init Kimi-Linear, Qwen3-Next and Qwen3.5 models (built from a config, nothing downloaded, fixed
seeds) must give the same logits, parameter gradients and greedy generations with our layers as with
Transformers' own torch implementation, and packed sequences (cu_seqlens) must match running each sequence
alone. Every comparison first checks that our layers were actually called.

The kernel under test is whichever variant the kernels library picks, as it would for a user, among the
variants that run here built from the current sources (see the kda_repo fixture): the native cpu one when
kernels_src/cpu builds, else torch-universal. test_kernel_under_test prints which. KDA_KERNELS_TEST_REPO=DIR
(a directory holding build/<variant>/) overrides this.
"""
import contextlib
import filecmp
import json
import os
import shutil
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import kda_hub_mapping  # noqa: E402

transformers = pytest.importorskip("transformers")
kernels = pytest.importorskip("kernels")
from kernels import Mode, kernelize, use_kernel_mapping  # noqa: E402

PKG = ROOT / "torch-ext" / "kda_kernels"

# DESIGN.md section 6: fp32 ratio RMS(ref - out) / RMS(ref) <= 1e-5. Logits meet it end to end. Parameter
# gradients pass through a chunked backward that sums in a different order from Transformers' torch code;
# measured ratios are <= ~3e-6 for the weights that matter (see test_*_gradients), so 1e-5 holds for those too.
TOL = 1e-5


# ----------------------------------------------------------------------------- the kernel under test
def _fresh(variant_dir):
    """True when every package file of variant_dir equals the source tree's (the build is current)."""
    for src in PKG.rglob("*.py"):
        if "__pycache__" in src.parts:
            continue
        dst = variant_dir / src.relative_to(PKG)
        if not dst.is_file() or not filecmp.cmp(src, dst, shallow=False):
            return False
    return True


@pytest.fixture(scope="session")
def kda_repo(tmp_path_factory):
    """A directory holding build/<variant>/ for every variant that runs on this machine, built from the current
    sources: the shared per-source-hash builds of tests/conftest.py when it is there (so the native cpu
    variant is built once for all test files), else a snapshot of build/'s current variants plus a fresh
    torch-universal build. The kernels library then picks among them as it would for a user."""
    if os.environ.get("KDA_KERNELS_TEST_REPO"):
        return Path(os.environ["KDA_KERNELS_TEST_REPO"])
    out = tmp_path_factory.mktemp("kda_repo")
    (out / "build").mkdir()
    try:
        import conftest as shared
    except ImportError:
        shared = None
    if shared is not None and hasattr(shared, "build_variant"):
        for backend in getattr(shared, "TEST_BACKENDS", ("universal",)):
            if shared._BUILD.buildable(backend, torch)[0]:
                path = shared.build_variant(backend)
                (out / "build" / path.name).symlink_to(path, target_is_directory=True)
        return out
    for v in sorted((ROOT / "build").glob("*")):
        if (v / "metadata.json").is_file() and _fresh(v):
            shutil.copytree(v, out / "build" / v.name, ignore=shutil.ignore_patterns("__pycache__"))
    if not (out / "build" / "torch-universal").is_dir():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "build.py"), "--backends", "universal",
                        "--out", str(out / "build")], check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def kda(kda_repo):
    from kernels import get_local_kernel

    return get_local_kernel(kda_repo)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="kda-kernels: no native")
        yield


# ----------------------------------------------------------------------------- tiny models
def tiny_kimi(layer_types=("linear_attention", "full_attention", "linear_attention")):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    cfg = KimiLinearConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=len(layer_types),
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        linear_head_dim=16, linear_num_heads=2, linear_conv_kernel_dim=4, layer_types=list(layer_types),
        mlp_layer_types=["dense"] + ["sparse"] * (len(layer_types) - 1), pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(cfg)
    _randomize_linear_params(model)
    return model


def tiny_qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts_per_tok=2, num_experts=4,
        layer_types=["linear_attention", "full_attention", "linear_attention"], pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(cfg)
    _randomize_linear_params(model)
    return model


def tiny_qwen3_5():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(cfg)
    _randomize_linear_params(model)
    return model


def _randomize_linear_params(model):
    """Give the gate parameters (A_log, dt_bias: often constant at init) values that make decays differ per
    head and channel, so the comparison exercises real per-channel / per-head decay."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen) * 3.0 - 3.0)
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen))


MODELS = {"kimi_linear": tiny_kimi, "qwen3_next": tiny_qwen3_next, "qwen3_5": tiny_qwen3_5}
KDA_KEYS = ("chunk_kda", "fused_recurrent_kda")
GDN_KEYS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")


def chunk_key(name):
    return "chunk_kda" if name == "kimi_linear" else "chunk_gated_delta_rule"


def recurrent_key(name):
    return "fused_recurrent_kda" if name == "kimi_linear" else "fused_recurrent_gated_delta_rule"


def n_linear_layers(model):
    return sum(t == "linear_attention" for t in model.config.layer_types)


# ----------------------------------------------------------------------------- routing
@contextlib.contextmanager
def _quiet_logs():
    with kda_hub_mapping.quiet_kernelize():
        yield


def use_ours(model, repo, mode):
    """Route model to kda-kernels (our layers for the 4 delta-rule functions + the varlen conv)."""
    kda_hub_mapping.kernelize(model, device="cpu", mode=mode, local_path=repo)
    routed = kda_hub_mapping.routed_layers(model)
    keys = {k for m in model.modules() for k in getattr(m, "_kernel_funcs", {})}
    want = {k for k in keys if k in kda_hub_mapping.DELTA_LAYERS or k in kda_hub_mapping.CONV_LAYERS}
    assert want and set(routed) == want, (routed, want)
    return model


def use_transformers(model, mode):
    """Route model back to Transformers' own torch implementation (kernelize with an empty mapping)."""
    with use_kernel_mapping({}, inherit_mapping=False), _quiet_logs():
        kernelize(model, mode=mode, device="cpu", use_fallback=True)
    assert kda_hub_mapping.routed_layers(model) == {}
    return model


def count_calls(model):
    """Wrap each routed function's forward once; returns a Counter of calls per layer key."""
    calls = Counter()
    seen = set()
    for module in model.modules():
        for key, fn in getattr(module, "_kernel_funcs", {}).items():
            if id(fn) in seen:
                continue
            seen.add(id(fn))
            inner = fn.forward

            def counted(*args, _inner=inner, _key=key, **kwargs):
                calls[_key] += 1
                return _inner(*args, **kwargs)

            fn.forward = counted
    return calls


def ratio(ref, out):
    ref, out = ref.double(), out.double()
    den = ref.pow(2).mean().sqrt()
    return ((ref - out).pow(2).mean().sqrt() / den).item() if den > 0 else (ref - out).abs().max().item()


def inputs(vocab, B=2, T=70, seed=0):
    """T=70 crosses one chunk boundary (64) of the chunked algorithms."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (B, T), generator=gen)


# ----------------------------------------------------------------------------- tests
def test_kernel_under_test(kda):
    print(f"kernel under test: {kda.VARIANT} (backend {kda.BACKEND})")
    assert kda.layers.__name__.endswith(".layers")


def test_layers_match_transformers_signatures(kda):
    """kernels accepts each of our layers for the Transformers function it replaces (count and kinds of params,
    stateless), and the classes carry the names Transformers' hub mapping uses."""
    from kernels.layer.layer import _validate_layer
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q35
    from transformers.models.qwen3_next import modeling_qwen3_next as qn

    pairs = [(kimi.chunk_kimi_delta_attention, "chunk_kimi_delta_attention"),
             (kimi.recurrent_kimi_delta_attention, "recurrent_kimi_delta_attention"),
             (kimi.causal_conv1d_fn, "causal_conv1d_fn")]
    for mod in (qn, q35):
        pairs += [(mod.torch_chunk_gated_delta_rule, "chunk_gated_delta_rule"),
                  (mod.torch_recurrent_gated_delta_rule, "recurrent_gated_delta_rule"),
                  (mod.causal_conv1d_fn, "causal_conv1d_fn")]
    for fn, name in pairs:
        layer = getattr(kda.layers, name)
        assert fn.kernel_layer_name in kda_hub_mapping.DELTA_LAYERS or fn.kernel_layer_name == name
        _validate_layer(check_cls=type(fn), cls=layer, repo=name)
        assert layer.has_backward and layer.can_torch_compile
    hub = transformers.integrations.hub_kernels.get_kernel_mapping_transformers()
    for key, layer_name in kda_hub_mapping.DELTA_LAYERS.items():
        repos = hub[key]["cuda"]
        assert {r.layer_name for r in repos.values()} == {layer_name}, key


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_transformers(name, kda_repo):
    model = MODELS[name]().eval()
    ids = inputs(model.config.vocab_size)
    with torch.no_grad():
        ref = use_transformers(model, Mode.INFERENCE)(ids, use_cache=False).logits
        use_ours(model, kda_repo, Mode.INFERENCE)
        calls = count_calls(model)
        out = model(ids, use_cache=False).logits
    assert calls[chunk_key(name)] == n_linear_layers(model), calls
    assert torch.isfinite(out).all()
    assert ratio(ref, out) <= TOL, ratio(ref, out)


@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_match_transformers(name, kda_repo):
    model = MODELS[name]().train()
    ids = inputs(model.config.vocab_size, seed=1)

    def grads():
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    use_transformers(model, Mode.TRAINING)
    ref_loss, ref = grads()
    use_ours(model, kda_repo, Mode.TRAINING)
    calls = count_calls(model)
    loss, out = grads()
    assert calls[chunk_key(name)] == n_linear_layers(model), calls
    assert ratio(ref_loss, loss) <= TOL
    assert ref.keys() == out.keys()
    # every parameter of the delta-rule layers and upstream of them gets a gradient through our backward
    assert any("A_log" in n for n in out) and any("dt_bias" in n for n in out)
    bad = {n: ratio(ref[n], out[n]) for n in ref if ratio(ref[n], out[n]) > TOL}
    assert not bad, bad


@pytest.mark.parametrize("name", ["kimi_linear", "qwen3_next"])
def test_generate_same_tokens(name, kda_repo):
    """Greedy generation with a cache: prefill through the chunked op, decode through the recurrent op;
    one row left-padded, so padding goes through both too."""
    model = MODELS[name]().eval()
    ids = inputs(model.config.vocab_size, B=2, T=20, seed=2)
    mask = torch.ones_like(ids)
    ids[1, :5] = model.config.pad_token_id
    mask[1, :5] = 0
    new = 8
    kw = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
              output_scores=True, return_dict_in_generate=True, pad_token_id=model.config.pad_token_id)
    with torch.no_grad():
        ref = use_transformers(model, Mode.INFERENCE).generate(ids, **kw)
        use_ours(model, kda_repo, Mode.INFERENCE)
        calls = count_calls(model)
        out = model.generate(ids, **kw)
    L = n_linear_layers(model)
    assert calls[chunk_key(name)] == L, calls  # one prefill
    assert calls[recurrent_key(name)] == (new - 1) * L, calls  # one decode step per further token
    assert torch.equal(ref.sequences, out.sequences), (ref.sequences, out.sequences)
    for step, (a, b) in enumerate(zip(ref.scores, out.scores)):
        finite = torch.isfinite(a)  # min_new_tokens sets eos to -inf
        assert torch.equal(finite, torch.isfinite(b))
        assert ratio(a[finite], b[finite]) <= TOL, (step, ratio(a[finite], b[finite]))


@pytest.mark.parametrize("name,packing_kwarg", [("qwen3_next", "cu_seq_lens_q"), ("kimi_linear", "cu_seq_lens_q"),
                                                 ("kimi_linear", "cu_seqlens")])
def test_packed_matches_separate(name, packing_kwarg, kda_repo):
    """Three sequences packed into one row (cu_seqlens + restarting position_ids) give each sequence's logits
    as if it ran alone. Transformers' torch path refuses packed input for the delta rule; ours keeps the
    sequences apart in the delta rule and in the causal conv in front of it."""
    model = MODELS[name]().eval()
    lens = [13, 70, 5]
    seqs = [inputs(model.config.vocab_size, B=1, T=n, seed=10 + i) for i, n in enumerate(lens)]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    packed_kw = {packing_kwarg: cu, "position_ids": torch.cat([torch.arange(n) for n in lens])[None],
                 "use_cache": False}
    if packing_kwarg == "cu_seq_lens_q":
        packed_kw.update(cu_seq_lens_k=cu, max_length_q=max(lens), max_length_k=max(lens))
    with torch.no_grad():
        ref = [use_transformers(model, Mode.INFERENCE)(s, use_cache=False).logits for s in seqs]
        use_ours(model, kda_repo, Mode.INFERENCE)
        calls = count_calls(model)
        packed = model(torch.cat(seqs, 1), **packed_kw).logits
    assert calls[chunk_key(name)] == n_linear_layers(model)
    assert calls["causal_conv1d_fn"] == n_linear_layers(model)
    for i, (r, p) in enumerate(zip(ref, packed.split(lens, dim=1))):
        assert ratio(r, p) <= TOL, (i, ratio(r, p))


def test_packed_needs_the_varlen_conv(kda_repo):
    """Without our conv layer, the torch conv mixes the packed sequences: the conv layer is load-bearing."""
    model = tiny_qwen3_next().eval()
    lens = [13, 20]
    seqs = [inputs(model.config.vocab_size, B=1, T=n, seed=20 + i) for i, n in enumerate(lens)]
    cu = torch.tensor([0, 13, 33], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    with torch.no_grad():
        use_transformers(model, Mode.INFERENCE)
        ref = model(seqs[1], use_cache=False).logits
        kda_hub_mapping.kernelize(model, device="cpu", mode=Mode.INFERENCE, local_path=kda_repo, conv_devices=())
        assert "causal_conv1d_fn" not in kda_hub_mapping.routed_layers(model)
        packed = model(torch.cat(seqs, 1), position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=20,
                       max_length_k=20, use_cache=False).logits
    assert ratio(ref, packed[:, 13:]) > 1e-3


@pytest.mark.parametrize("device", ["mps", "neuron"])
def test_registration_for_other_devices(device, kda_repo):
    """The mapping registers our layers for mps and neuron too: kernelize for those device types routes the
    layers (run here on CPU tensors; the kernel's variant is picked by the kernels library per machine)."""
    model = tiny_qwen3_next().eval()
    ids = inputs(model.config.vocab_size, T=9)
    with torch.no_grad():
        ref = use_transformers(model, Mode.INFERENCE)(ids, use_cache=False).logits
        kda_hub_mapping.kernelize(model, device=device, mode=Mode.INFERENCE, local_path=kda_repo)
        assert set(kda_hub_mapping.routed_layers(model)) >= set(GDN_KEYS)
        out = model(ids, use_cache=False).logits
    assert ratio(ref, out) <= TOL
    m = kda_hub_mapping.mapping(local_path=kda_repo)
    for key in kda_hub_mapping.DELTA_LAYERS:
        assert set(m[key]) == {"cpu", "cuda", "mps", "neuron"}
    assert set(m["causal_conv1d_fn"]) == {"cpu", "mps", "neuron"}


_HUB_SCRIPT = r"""
import json, os, sys, torch
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])
import kda_hub_mapping
from kernels import get_kernel
import test_transformers as t
version = int(sys.argv[3])
kda = get_kernel("kda-test/kda-kernels", version=version)
model = t.tiny_kimi().eval()
ids = t.inputs(model.config.vocab_size, T=40)
with torch.no_grad():
    ref = model(ids, use_cache=False).logits
    kda_hub_mapping.register(repo_id="kda-test/kda-kernels", version=version)
    model.set_use_kernels(True)  # Transformers' own switch, on cpu, with our mapping registered
    routed = kda_hub_mapping.routed_layers(model)
    out = model(ids, use_cache=False).logits
print(json.dumps({"variant": kda.VARIANT, "routed": sorted(routed), "ratio": t.ratio(ref, out)}))
"""


def test_offline_hub_cache_and_use_kernels(kda_repo, tmp_path):
    """The user's route: a version laid into an offline hub cache, LayerRepository(version=N) through
    kda_hub_mapping.register, and Transformers' model.set_use_kernels(True) on cpu. A subprocess, because
    HF_HUB_OFFLINE and KERNELS_CACHE are read when huggingface_hub / kernels are imported."""
    build = kda_repo / "build"
    version = json.loads(next(build.glob("*/metadata.json")).read_text())["version"]
    cache = tmp_path / "cache"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "hub.py"), "lay", "--cache", str(cache), "--repo-id",
                    "kda-test/kda-kernels", "--version", str(version), "--build", str(build), "--main"],
                   check=True, capture_output=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", KERNELS_CACHE=str(cache), KDA_KERNELS_QUIET_FALLBACK="1")
    res = subprocess.run([sys.executable, "-c", _HUB_SCRIPT, str(ROOT), str(ROOT / "tests"), str(version)],
                         env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(got["routed"]) >= set(KDA_KEYS), got
    assert got["ratio"] <= TOL, got
