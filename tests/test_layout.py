"""The repository's build description stays true: build.toml lists every kernel source and agrees with metadata.json."""
import json
import re
import tomllib

from conftest import ROOT

SUFFIXES = {"cpu": (".cpp", ".h"), "cuda": (".cu", ".cuh", ".h", ".cpp"), "metal": (".metal", ".mm", ".h")}


def build_toml():
    return tomllib.loads((ROOT / "build.toml").read_text())


def test_build_toml_matches_metadata():
    cfg, meta = build_toml(), json.loads((ROOT / "metadata.json").read_text())
    assert cfg["general"]["name"] == meta["name"]
    assert cfg["general"]["version"] == meta["version"]
    assert re.fullmatch(r"[a-z][-a-z0-9]*[a-z0-9]", meta["name"])
    assert set(cfg["general"]["backends"]) == {"cpu", "cuda", "metal", "neuron"}


def test_build_toml_lists_every_kernel_source():
    cfg = build_toml()
    listed = {backend: set() for backend in SUFFIXES}
    for kernel in cfg.get("kernel", {}).values():
        listed[kernel["backend"]].update(kernel["src"])
    for backend, suffixes in SUFFIXES.items():
        present = {str(p.relative_to(ROOT)) for p in (ROOT / "kernels_src" / backend).glob("*")
                   if p.suffix in suffixes}
        assert listed[backend] == present, f"build.toml [kernel.*] for {backend} is out of date"
    assert "torch-ext/torch_binding.cpp" in cfg["torch"]["src"]
