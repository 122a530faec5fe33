"""Versioned releases: builds laid into a local Hugging Face cache load offline through the real kernels library."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT

REPO = "kda-test-org/kda-kernels"


def sh(*args, env=None):
    res = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hub")
    for version in (1, 2):
        out = tmp / f"build-v{version}"
        sh(ROOT / "scripts/build.py", "--backends", "universal", "--version", version, "--out", out)
        meta = json.loads((out / "torch-universal" / "metadata.json").read_text())
        assert meta["version"] == version and meta["name"] == "kda-kernels"
        assert meta["id"].startswith("_kda_kernels_universal_")
        lay = [ROOT / "scripts/hub.py", "lay", "--cache", tmp / "cache", "--repo-id", REPO, "--version", version,
               "--build", out] + (["--main"] if version == 2 else [])
        sh(*lay)
    return tmp / "cache"


def offline(cache, code):
    env = dict(os.environ, HF_HUB_OFFLINE="1", KERNELS_CACHE=str(cache))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          cwd=ROOT)


def test_cache_layout(cache):
    folder = cache / "kernels--kda-test-org--kda-kernels"
    refs = {p.name: p.read_text() for p in (folder / "refs").iterdir()}
    assert set(refs) == {"v1", "v2", "main"}
    assert all(len(c) == 40 and c == c.strip() for c in refs.values())  # no trailing newline
    assert refs["main"] == refs["v2"] != refs["v1"]
    assert (folder / "snapshots" / refs["v1"] / "build" / "torch-universal" / "metadata.json").is_file()


def test_versions_resolve_to_different_builds_offline(cache):
    res = offline(cache, f"""
        import json
        from kernels import get_kernel
        v1 = get_kernel("{REPO}", version=1)
        v2 = get_kernel("{REPO}", version=2)
        main = get_kernel("{REPO}", revision="main")
        import torch
        q = torch.randn(1, 3, 1, 4); v = torch.randn(1, 3, 1, 4)
        o, _ = v2.chunk_gated_delta_rule(q, q, v, -torch.rand(1, 3, 1), torch.rand(1, 3, 1))
        print(json.dumps(dict(v1=[v1.__version__, v1.__name__, v1.__file__], v2=[v2.__version__, v2.__name__],
                              main=[main.__version__, main.__name__], shape=list(o.shape))))
        """)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["v1"][0] == 1 and got["v2"][0] == 2 and got["main"][0] == 2
    assert got["v1"][1] != got["v2"][1]  # different builds, different op namespaces
    assert got["main"][1] == got["v2"][1]
    assert "kernels--kda-test-org--kda-kernels/snapshots" in got["v1"][2]
    assert got["shape"] == [1, 3, 1, 4]


def test_unknown_version_or_revision_is_a_clear_error(cache):
    res = offline(cache, f"""
        from kernels import get_kernel
        for kw in (dict(version=3), dict(revision="no-such-branch")):
            try:
                get_kernel("{REPO}", **kw)
            except Exception as e:
                print(type(e).__name__, "|", e)
        """)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert lines[0].startswith("ValueError | Version 3 not found, available versions: 1, 2")
    assert lines[1].startswith("FileNotFoundError") and "no-such-branch" in lines[1]


def test_lay_refuses_version_mismatch(tmp_path):
    out = tmp_path / "b"
    sh(ROOT / "scripts/build.py", "--backends", "universal", "--version", 1, "--out", out)
    res = subprocess.run([sys.executable, ROOT / "scripts/hub.py", "lay", "--cache", tmp_path / "c", "--repo-id",
                          REPO, "--version", "5", "--build", out], capture_output=True, text=True)
    assert res.returncode != 0 and "released as version 5" in res.stderr + res.stdout


def test_publish_dry_run_prints_the_plan(tmp_path):
    out = tmp_path / "b"
    sh(ROOT / "scripts/build.py", "--backends", "universal", "--version", 3, "--out", out)
    text = sh(ROOT / "scripts/hub.py", "publish", "--repo-id", REPO, "--version", 3, "--build", out, "--dry-run",
              "--builds-on-main")
    lines = text.strip().splitlines()
    assert lines[0].startswith(f"1. HfApi().create_repo(repo_id='{REPO}', repo_type='kernel'")
    assert lines[1].startswith(f"2. HfApi().create_branch(repo_id='{REPO}', repo_type='kernel', branch='v3'")
    assert "upload_folder" in lines[2] and "revision='v3'" in lines[2] and "path_in_repo='build'" in lines[2]
    assert "upload_file" in lines[3] and "revision='main'" in lines[3] and "README.md" in lines[3]
    assert "upload_folder" in lines[4] and "revision='main'" in lines[4]
    assert lines[-1] == "[hub] dry run: nothing was sent"
