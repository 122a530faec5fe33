"""Import kernels_src/nki as a package (named `kda_nki` here) with `nki` resolved to the real package if present,
else to this simulator."""
import importlib.util
import sys
from pathlib import Path

from . import install

ROOT = Path(__file__).resolve().parents[2]


def load_kernels(name="kda_nki", force_sim=False):
    install(force=force_sim)
    if name in sys.modules:
        return sys.modules[name]
    src = ROOT / "kernels_src" / "nki"
    spec = importlib.util.spec_from_file_location(name, src / "__init__.py", submodule_search_locations=[str(src)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    importlib.import_module(f"{name}.torch_wrappers")
    return mod
