"""Shared fixtures: build-and-load the package's variants.

`variant` is parametrized over the variants that can run on this machine (torch-universal always, the native
CPU variant when kernels_src/cpu has sources); the test id names the variant. Each is built by
scripts/build.py into a cache under .build-tmp/test-variants/, keyed by a hash of its sources, so a test
always runs the current sources and never races a concurrent rebuild of build/. A variant whose sources
exist but fail to build fails the test; one whose sources do not exist yet is skipped with that reason.
Set KDA_TEST_BUILD_DIR=build to load the variants already built there instead.
`kda_universal` is the torch-universal variant alone.
"""
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".build-tmp" / "test-variants"
TEST_BACKENDS = ("universal", "cpu")  # the backends whose variants run on this CPU-only machine


def _build_script():
    spec = importlib.util.spec_from_file_location("_kda_build_script", ROOT / "scripts" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_BUILD = _build_script()


def variant_name(backend):
    return _BUILD.variant_name(backend, torch)


def _sources_hash(backend):
    files = [p for p in (ROOT / "torch-ext").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    files += [ROOT / "scripts" / "build.py", ROOT / "metadata.json"]
    if backend != "universal":
        files += [p for p in (ROOT / "kernels_src" / backend).rglob("*") if p.is_file()]
    h = hashlib.sha1(torch.__version__.encode())
    for p in sorted(files):
        h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:12]


def build_variant(backend):
    """Build `backend` (cached by source hash). Returns the variant's directory; raises RuntimeError on failure."""
    name = variant_name(backend)
    if os.environ.get("KDA_TEST_BUILD_DIR"):
        path = Path(os.environ["KDA_TEST_BUILD_DIR"]).resolve() / name
        if not (path / "metadata.json").is_file():
            raise RuntimeError(f"{path} holds no built variant (KDA_TEST_BUILD_DIR)")
        return path
    out = CACHE / f"{backend}-{_sources_hash(backend)}"
    if (out / name / "metadata.json").is_file():
        return out / name
    CACHE.mkdir(parents=True, exist_ok=True)
    # one build at a time across concurrent test runs (build.py shares its object dir per variant)
    with open(CACHE / f".{backend}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / name / "metadata.json").is_file():
            return out / name
        tmp = CACHE / f"{out.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        res = subprocess.run([sys.executable, str(ROOT / "scripts" / "build.py"), "--backends", backend,
                              "--out", str(tmp)], capture_output=True, text=True, cwd=ROOT)
        if res.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"scripts/build.py --backends {backend} failed (exit {res.returncode}):\n"
                               f"{res.stdout[-4000:]}{res.stderr[-8000:]}")
        try:
            tmp.rename(out)
        except OSError:  # built meanwhile by a run that did not take the lock: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
        _prune(backend, keep=out)
    return out / name


def _prune(backend, keep, max_age_s=3600):
    """Drop cached builds of `backend` unused for an hour (sources change often while kernels are written)."""
    now = time.time()
    for p in CACHE.glob(f"{backend}-*"):
        if p != keep and now - p.stat().st_mtime > max_age_s:
            shutil.rmtree(p, ignore_errors=True)


def load_variant(path):
    """Import a built variant directory as a package named after its torch.ops namespace (metadata id)."""
    ns = json.loads((Path(path) / "metadata.json").read_text())["id"]
    if ns in sys.modules:
        return sys.modules[ns]
    spec = importlib.util.spec_from_file_location(ns, Path(path) / "__init__.py",
                                                  submodule_search_locations=[str(path)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[ns] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[ns]
        raise
    return mod


_loaded = {}


def get_variant(backend):
    """The loaded module of `backend`'s variant; skips when its sources do not exist, fails when it won't build."""
    if backend not in _loaded:
        ok, why = _BUILD.buildable(backend, torch)
        if not ok:
            _loaded[backend] = ("skip", f"{variant_name(backend)} not built: {why}")
        else:
            try:
                mod = load_variant(build_variant(backend))
                if backend != "universal" and not mod.NATIVE:
                    _loaded[backend] = ("skip", f"{mod.VARIANT}: native library not loaded on this machine")
                else:
                    _loaded[backend] = ("ok", mod)
            except Exception as e:  # noqa: BLE001 - reported as the test's failure
                _loaded[backend] = ("fail", f"{variant_name(backend)} failed to build or load: {e}")
    state, val = _loaded[backend]
    if state == "skip":
        pytest.skip(val)
    if state == "fail":
        pytest.fail(val, pytrace=False)
    return val


@pytest.fixture(scope="session", params=TEST_BACKENDS, ids=[variant_name(b) for b in TEST_BACKENDS])
def variant(request):
    """Each variant that runs here, built from the current sources; the test id names it."""
    return get_variant(request.param)


@pytest.fixture(scope="session")
def kda_universal():
    return get_variant("universal")
