"""Route Transformers' Kimi-Linear / Qwen3-Next / Qwen3.5 delta-rule layers to kda-kernels, on any device.

A standalone helper (it needs only `kernels`; copy it next to your code, or use the snippet in
docs/transformers.md). It lives outside the kernel package on purpose: you need the mapping before the
kernel is loaded, and `kernelize` then loads the kernel itself, picking the build variant for the device
(native cpu / cuda / metal / neuron, or the pure-PyTorch torch-universal one).

    import kda_hub_mapping
    from kernels import Mode, kernelize

    kda_hub_mapping.register(repo_id="kda-org/kda-kernels", version=2)       # or local_path="path/to/repo"
    kernelize(model, mode=Mode.INFERENCE, device="cpu")                      # or Mode.TRAINING; cuda, mps, neuron

Why not Transformers' own switches: its default mapping knows only cuda and xpu (kernels-community/fla), and
`KernelConfig` rejects device "cpu". The kernels library itself accepts any of its device types, so this
registers our layers for cpu, cuda, mps and neuron under the layer keys Transformers' modeling code declares.
After `register(...)`, `model.set_use_kernels(True)` also works on cpu / mps / neuron (Transformers re-registers
its cuda defaults first, so on cuda call `kernels.kernelize` yourself, or use `use(...)` around it).
"""
import contextlib
import logging
from pathlib import Path

# Transformers layer key -> our layer class (torch-ext/kda_kernels/layers.py)
DELTA_LAYERS = {
    "chunk_kda": "chunk_kimi_delta_attention",
    "fused_recurrent_kda": "recurrent_kimi_delta_attention",
    "chunk_gated_delta_rule": "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule": "recurrent_gated_delta_rule",
}
# The varlen-aware causal conv in front of the delta rule (needed for packed sequences without the
# causal-conv1d package). Registered by default only where Transformers has no native one.
CONV_LAYERS = {"causal_conv1d_fn": "causal_conv1d_fn"}
DEVICES = ("cpu", "cuda", "mps", "neuron")
CONV_DEVICES = ("cpu", "mps", "neuron")
DEFAULT_REPO_ID = "kda-org/kda-kernels"


def mapping(repo_id=DEFAULT_REPO_ID, *, version=None, revision=None, local_path=None, devices=DEVICES,
            conv_devices=CONV_DEVICES, trust_remote_code=False):
    """The kernel mapping {layer key: {device: repository}} for `kernels.register_kernel_mapping`.

    Exactly one source: `version=N` (branch vN of repo_id on the Hub or in the offline cache), `revision=`
    (branch, tag or commit), or `local_path=` (a directory holding build/<variant>/, e.g. this repo after
    scripts/build.py). The repositories carry no mode, so they serve inference, training and torch.compile.
    """
    from kernels import LayerRepository, LocalLayerRepository

    if sum(x is not None for x in (version, revision, local_path)) != 1:
        raise ValueError("[kda_hub_mapping] pass exactly one of version=, revision= or local_path=")
    unknown = set(devices) - set(DEVICES) | set(conv_devices) - set(DEVICES)
    if unknown:
        raise ValueError(f"[kda_hub_mapping] devices must be among {DEVICES}, got {sorted(unknown)}")

    def repo(layer_name):
        if local_path is not None:
            return LocalLayerRepository(repo_path=Path(local_path), layer_name=layer_name)
        if version is not None:
            return LayerRepository(repo_id=repo_id, layer_name=layer_name, version=version,
                                   trust_remote_code=trust_remote_code)
        return LayerRepository(repo_id=repo_id, layer_name=layer_name, revision=revision,
                               trust_remote_code=trust_remote_code)

    out = {key: {dev: repo(name) for dev in devices} for key, name in DELTA_LAYERS.items()}
    for key, name in CONV_LAYERS.items():
        if conv_devices:
            out[key] = {dev: repo(name) for dev in conv_devices}
    return out


def register(repo_id=DEFAULT_REPO_ID, **kwargs):
    """Register the mapping globally (kernels.register_kernel_mapping). Returns it. Same arguments as mapping()."""
    from kernels import register_kernel_mapping

    m = mapping(repo_id, **kwargs)
    register_kernel_mapping(m)
    return m


def use(repo_id=DEFAULT_REPO_ID, **kwargs):
    """Context manager: the mapping on top of the current one (kernels.use_kernel_mapping)."""
    from kernels import use_kernel_mapping

    return use_kernel_mapping(mapping(repo_id, **kwargs))


@contextlib.contextmanager
def quiet_kernelize():
    """Silence kernelize's "No kernel mapping found for layer `RMSNorm`" warnings for the layers we don't map."""
    log = logging.getLogger("kernels.layer.layer")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def kernelize(model, *, device, mode=None, repo_id=DEFAULT_REPO_ID, **kwargs):
    """One call: kernelize `model` for `device` with our layers (mapping on top of the registered one).

    mode defaults to Mode.TRAINING if model.training else Mode.INFERENCE. Other arguments go to mapping().
    Note that the replaced functions are module-level objects of Transformers' modeling code: kernelizing one
    model routes every model of that architecture in the process.
    """
    from kernels import Mode
    from kernels import kernelize as _kernelize

    if mode is None:
        mode = Mode.TRAINING if model.training else Mode.INFERENCE
    with use(repo_id, **kwargs), quiet_kernelize():
        # fall back for layers we don't map (RMSNorm, ...), but raise if our kernel fails to load
        _kernelize(model, mode=mode, device=device, use_fallback=True)
    wanted = {key for m in model.modules() for key in getattr(m, "_kernel_funcs", {}) if key in DELTA_LAYERS}
    missing = wanted - set(routed_layers(model))
    if missing:
        raise RuntimeError(f"[kda_hub_mapping] kernelize left {sorted(missing)} on Transformers' own "
                           f"implementation (device {device!r}, mode {mode})")
    return model


def routed_layers(model):
    """{Transformers layer key: our layer class name} for each function of `model` now routed to kda-kernels."""
    ours = {**DELTA_LAYERS, **CONV_LAYERS}
    found = {}
    for module in model.modules():
        for key, fn in getattr(module, "_kernel_funcs", {}).items():
            impl = getattr(getattr(fn, "forward", None), "__func__", None)
            cls = getattr(impl, "__qualname__", "").split(".")[0]
            if key in ours and cls == ours[key] and getattr(impl, "__module__", "").endswith(".layers"):
                found[key] = cls
    return found
