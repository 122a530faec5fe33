"""Find, build and load this repo's build variants for tests (through the kernels library's own loader)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build"


def built_variants():
    """Names of the variants present in build/ (dirs holding a metadata.json)."""
    if not BUILD.is_dir():
        return []
    return sorted(p.name for p in BUILD.iterdir() if (p / "metadata.json").is_file())


def ensure_built(backends="universal"):
    """Build the given backends into build/ if their variant is missing (CI builds everything up front)."""
    wanted = {"universal": "torch-universal"}
    missing = [b for b in backends.split(",") if b in wanted and wanted[b] not in built_variants()]
    if missing:
        subprocess.run([sys.executable, str(ROOT / "scripts" / "build.py"), "--backends", ",".join(missing)],
                       check=True)


def load(variant):
    """Load build/<variant> with kernels.get_local_kernel, as a user of a local build would."""
    from kernels import get_local_kernel

    return get_local_kernel(BUILD / variant)


def default_variant_name():
    """The variant the kernels library picks for this machine from build/."""
    from kernels import get_local_kernel

    mod = get_local_kernel(ROOT)
    return mod.VARIANT


def variant_backend(variant):
    return json.loads((BUILD / variant / "metadata.json").read_text())["backend"]["type"]
