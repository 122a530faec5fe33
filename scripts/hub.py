#!/usr/bin/env python3
"""Release builds as versions of a kernel repo: into a local Hugging Face cache, or to the Hub.

    # lay build/ into a local cache as version N (branch vN; --main also points main at it)
    python scripts/hub.py lay --cache .hub-cache --repo-id kda-org/kda-kernels --version 2 --build build --main

    # publish to the Hub (maintainers): branch vN gets build/, main gets README (and build/ with --builds-on-main)
    python scripts/hub.py publish --repo-id kda-org/kda-kernels --version 2 --build build --dry-run

Versions follow the kernels library: get_kernel(repo_id, version=N) picks branch vN, revision="main" picks main.
Each variant's metadata.json must carry the version it is released as; both commands refuse a mismatch.

The local cache has the layout huggingface_hub's snapshot_download leaves (repo type kernel):
    <cache>/kernels--<org>--<name>/refs/{main,v1,...}        40-hex commit ids, no trailing newline
    <cache>/kernels--<org>--<name>/snapshots/<commit>/build/<variant>/...
so that with HF_HUB_OFFLINE=1 and KERNELS_CACHE=<cache> (read when `kernels` is imported) the real kernels
library loads get_kernel(repo_id, version=N) and get_kernel(repo_id, revision="main").
"""
import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def log(msg):
    print(f"[hub] {msg}", flush=True)


def variants_of(build):
    build = Path(build)
    if not build.is_dir():
        raise SystemExit(f"[hub] build directory {build} does not exist: run scripts/build.py first")
    found = sorted(p for p in build.iterdir() if (p / "metadata.json").is_file())
    if not found:
        raise SystemExit(f"[hub] no build variants (dirs with metadata.json) in {build}")
    return found


def check_versions(variants, version):
    for v in variants:
        meta = json.loads((v / "metadata.json").read_text())
        if meta.get("version") != version:
            raise SystemExit(f"[hub] {v.name}/metadata.json has version {meta.get('version')}, but it is being "
                             f"released as version {version}: rebuild with scripts/build.py --version {version}")


def tree_commit(variants, version):
    """A deterministic 40-hex id for the laid snapshot (the Hub would assign the real commit id)."""
    h = hashlib.sha1(f"v{version}".encode())
    for v in variants:
        for p in sorted(v.rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts:
                h.update(str(p.relative_to(v.parent)).encode())
                h.update(p.read_bytes())
    return h.hexdigest()


def repo_folder(cache, repo_id):
    org, name = repo_id.split("/")
    return Path(cache) / f"kernels--{org}--{name}"


def lay(cache, repo_id, version, build, main):
    variants = variants_of(build)
    check_versions(variants, version)
    commit = tree_commit(variants, version)
    folder = repo_folder(cache, repo_id)
    snap = folder / "snapshots" / commit
    if snap.exists():
        shutil.rmtree(snap)
    (snap / "build").mkdir(parents=True)
    for v in variants:
        shutil.copytree(v, snap / "build" / v.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    readme = ROOT / "README.md"
    if readme.exists():
        shutil.copy2(readme, snap / "README.md")
    refs = folder / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    (refs / f"v{version}").write_text(commit)
    if main:
        (refs / "main").write_text(commit)
    log(f"laid {repo_id} v{version} ({', '.join(v.name for v in variants)}) at {commit[:10]}"
        + (" (also main)" if main else "") + f" in {folder}")
    return commit


def publish_plan(repo_id, version, build, builds_on_main):
    variants = variants_of(build)
    check_versions(variants, version)
    plan = [
        ("create_repo", dict(repo_id=repo_id, repo_type="kernel", exist_ok=True)),
        ("create_branch", dict(repo_id=repo_id, repo_type="kernel", branch=f"v{version}", exist_ok=True)),
        ("upload_folder", dict(repo_id=repo_id, repo_type="kernel", revision=f"v{version}",
                               folder_path=str(Path(build).resolve()), path_in_repo="build",
                               commit_message=f"Release v{version}: {', '.join(v.name for v in variants)}")),
        ("upload_file", dict(repo_id=repo_id, repo_type="kernel", revision="main",
                             path_or_fileobj=str(ROOT / "README.md"), path_in_repo="README.md",
                             commit_message=f"README for v{version}")),
    ]
    if builds_on_main:
        plan.append(("upload_folder", dict(repo_id=repo_id, repo_type="kernel", revision="main",
                                           folder_path=str(Path(build).resolve()), path_in_repo="build",
                                           commit_message=f"Builds of v{version} on main")))
    return plan


def publish(repo_id, version, build, builds_on_main, dry_run):
    plan = publish_plan(repo_id, version, build, builds_on_main)
    for i, (call, kwargs) in enumerate(plan, 1):
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        print(f"{i}. HfApi().{call}({args})")
    if dry_run:
        log("dry run: nothing was sent")
        return
    from huggingface_hub import HfApi

    api = HfApi()
    for call, kwargs in plan:
        getattr(api, call)(**{k: v for k, v in kwargs.items() if v is not None})
    log(f"published {repo_id} v{version}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("lay", "publish"):
        p = sub.add_parser(name)
        p.add_argument("--repo-id", required=True, help="org/name, e.g. kda-org/kda-kernels")
        p.add_argument("--version", type=int, required=True)
        p.add_argument("--build", type=Path, default=ROOT / "build")
        if name == "lay":
            p.add_argument("--cache", type=Path, required=True)
            p.add_argument("--main", action="store_true", help="point main at this version too")
        else:
            p.add_argument("--dry-run", action="store_true")
            p.add_argument("--builds-on-main", action="store_true",
                           help="also upload build/ to main so revision='main' loads the newest release")
    args = ap.parse_args(argv)
    if "/" not in args.repo_id or args.repo_id.count("/") != 1:
        ap.error(f"--repo-id must be org/name, got {args.repo_id!r}")
    if args.version < 1:
        ap.error("--version must be >= 1")
    if args.cmd == "lay":
        lay(args.cache, args.repo_id, args.version, args.build, args.main)
    else:
        publish(args.repo_id, args.version, args.build, args.builds_on_main, args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
