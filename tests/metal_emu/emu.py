"""Build and drive the CPU emulator of the Metal backend (tests only).

build(flavor, metal_files, defines) compiles the .metal files UNCHANGED as C++ against the metal_stdlib shim in
tests/metal_emu/include, plus generated glue (kernel table with each parameter's [[buffer(i)]] index and name, taken
from the preprocessed source) and the runtime (emu_runtime.cpp). Flavors:
  asan: AddressSanitizer + UBSan (every buffer is its own allocation, so an out-of-bounds access is reported)
  tsan: ThreadSanitizer; the runtime tells TSan about happens-before only at barriers, so a missing barrier is
        reported as a data race.
Executables are cached under <repo>/.build-tmp/metal_emu/<hash of sources and flags>/.
run_op() executes one core op through the host plan (kernels_src/metal/delta_plan.h), like delta_ops.mm does.
"""
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
METAL_DIR = REPO / "kernels_src" / "metal"
INCLUDE = HERE / "include"
CACHE = REPO / ".build-tmp" / "metal_emu"
KERNEL_METAL = sorted(METAL_DIR.glob("*.metal"))
CXX = os.environ.get("CXX", "g++")

FLAVORS = {
    "asan": dict(kernel=["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                         "-fno-sanitize-recover=all"],
                 runtime=["-O2", "-g"], link=["-fsanitize=address,undefined"]),
    "tsan": dict(kernel=["-O1", "-g", "-fsanitize=thread"], runtime=["-O2", "-g", "-DEMU_TSAN=1"],
                 link=["-fsanitize=thread"]),
    "fast": dict(kernel=["-O2"], runtime=["-O2"], link=[]),
}
COMMON = ["-std=c++20", "-Wall", "-Wno-attributes", "-Wno-unused-variable", "-Wno-unused-but-set-variable",
          "-I", str(INCLUDE), "-I", str(METAL_DIR)]

POSITION_ATTRS = {
    "threadgroup_position_in_grid", "thread_position_in_threadgroup", "thread_position_in_grid",
    "threads_per_threadgroup", "threadgroups_per_grid", "thread_index_in_threadgroup",
    "thread_index_in_simdgroup", "simdgroup_index_in_threadgroup", "simdgroups_per_threadgroup",
    "threads_per_simdgroup",
}


def _split_top(s, sep=","):
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "([<{":
            depth += 1
        elif ch in ")]>}":
            depth -= 1
        if ch == sep and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur))
    return out


def parse_kernels(preprocessed):
    """[(name, [(index or None, name, type, attr)])] for every `kernel void NAME(...)` in preprocessed source."""
    kernels = []
    for m in re.finditer(r"\[\[emu::kernel\]\]\s*void\s+(\w+)\s*\(", preprocessed):
        i, depth = m.end(), 1
        while depth:
            depth += {"(": 1, ")": -1}.get(preprocessed[i], 0)
            i += 1
        params = []
        for p in _split_top(preprocessed[m.end():i - 1]):
            p = " ".join(p.split())
            pm = re.match(r"^(.*?)\s*\[\[\s*(\w+)\s*(?:\(\s*(\d+)\s*\))?\s*\]\]$", p)
            if not pm:
                raise ValueError(f"kernel {m.group(1)}: parameter without attribute: {p!r}")
            decl, attr, idx = pm.group(1), pm.group(2), pm.group(3)
            nm = re.match(r"^(.*?)(\w+)$", decl)
            ptype, pname = nm.group(1).strip(), nm.group(2)
            if attr == "buffer":
                params.append((int(idx), pname, ptype, attr))
            elif attr in POSITION_ATTRS:
                params.append((None, pname, ptype, attr))
            else:
                raise ValueError(f"kernel {m.group(1)}: unsupported attribute [[{attr}]]")
        kernels.append((m.group(1), params))
    return kernels


def preprocess(metal_file, defines=()):
    cmd = [CXX, "-E", "-P", "-x", "c++"] + COMMON + [f"-D{d}" for d in defines] + [str(metal_file)]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def kernel_signatures(metal_files=None, defines=()):
    sigs = {}
    for f in metal_files or KERNEL_METAL:
        for name, params in parse_kernels(preprocess(f, defines)):
            sigs[name] = params
    return sigs


def _glue(metal_file, defines):
    kernels = parse_kernels(preprocess(metal_file, defines))
    tag = re.sub(r"\W", "_", Path(metal_file).stem)
    out = [f'#include "{Path(metal_file).resolve()}"', "#include <type_traits>", "namespace {",
           "template <typename T> struct Arg;",
           "template <typename T> struct Arg<T*> { static T* get(void* p) { return static_cast<T*>(p); } };",
           "template <typename T> struct Arg<T&> { static T& get(void* p) { return *static_cast<std::remove_reference_t<T>*>(p); } };",
           "template <typename T> T pos(emu::Vec3 v) { if constexpr (std::is_same_v<T, uint3>) return uint3(v.x, v.y, v.z);"
           " else if constexpr (std::is_same_v<T, uint2>) return uint2(v.x, v.y); else return T(v.x); }",
           "template <typename T> T pos(unsigned u) { return T(u); }"]
    for name, params in kernels:
        args = []
        for idx, pname, ptype, attr in params:
            if idx is not None:
                args.append(f"Arg<{ptype}>::get(b[{idx}])")
            else:
                args.append(f"pos<{ptype}>(tp.{attr})")
        out.append(f"void glue_{name}(void** b, const emu::ThreadPos& tp) {{ {name}({', '.join(args)}); }}")
        plist = ", ".join(f'{{{-1 if idx is None else idx}, "{pname}", "{ptype}", "{attr}"}}'
                          for idx, pname, ptype, attr in params)
        out.append(f"const emu::ParamInfo params_{name}[] = {{{plist}}};")
        out.append(f'emu::Register reg_{name}(emu::KernelInfo{{"{name}", &glue_{name}, params_{name}, '
                   f'{len(params)}}});')
    out.append("}  // namespace")
    return "\n".join(out) + "\n", tag


def _sources_hash(metal_files, flavor, defines):
    h = hashlib.sha256()
    files = list(metal_files) + sorted(METAL_DIR.glob("*.h")) + sorted(INCLUDE.glob("*")) + [
        HERE / "emu_runtime.cpp", Path(__file__)]
    for f in files:
        h.update(str(f).encode())
        h.update(Path(f).read_bytes())
    h.update(repr((flavor, sorted(defines), FLAVORS[flavor], COMMON, CXX)).encode())
    return h.hexdigest()[:16]


def build(flavor="asan", metal_files=None, defines=()):
    """Returns the path of the emulator executable for these sources, building it if needed."""
    metal_files = [Path(f) for f in (metal_files or KERNEL_METAL)]
    key = _sources_hash(metal_files, flavor, defines)
    prefix = flavor + "".join("-" + re.sub(r"\W", "_", d) for d in sorted(defines)) + \
        ("" if metal_files == KERNEL_METAL else "-" + "_".join(f.stem for f in metal_files))
    out_dir = CACHE / f"{prefix}-{key}"
    exe = out_dir / "emu_run"
    if exe.exists():
        return exe
    for old in CACHE.glob(f"{prefix}-*"):  # stale builds of the same configuration
        if old.is_dir() and len(old.name) == len(prefix) + 17:
            shutil.rmtree(old, ignore_errors=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    fl = FLAVORS[flavor]
    dflags = [f"-D{d}" for d in defines]
    jobs = []
    for f in metal_files:
        src, tag = _glue(f, defines)
        gpath = out_dir / f"glue_{tag}.cpp"
        gpath.write_text(src)
        jobs.append([CXX] + COMMON + fl["kernel"] + dflags + ["-c", str(gpath), "-o", str(out_dir / f"glue_{tag}.o")])
    jobs.append([CXX] + COMMON + fl["runtime"] + ["-c", str(HERE / "emu_runtime.cpp"), "-o",
                                                  str(out_dir / "emu_runtime.o")])

    def run(cmd):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"compile failed: {' '.join(cmd)}\n{r.stderr[-6000:]}")

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as ex:
        list(ex.map(run, jobs))
    objs = [str(p) for p in sorted(out_dir.glob("*.o"))]
    tmp_exe = out_dir / "emu_run.tmp"
    run([CXX] + fl["link"] + objs + ["-pthread", "-o", str(tmp_exe)])
    os.replace(tmp_exe, exe)
    return exe


SAN_ENV = {
    "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=23",
    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1:exitcode=24",
    "TSAN_OPTIONS": "halt_on_error=1:exitcode=66:report_signal_unsafe=0:history_size=4",
}


class EmuError(RuntimeError):
    def __init__(self, rc, stderr):
        super().__init__(f"emulator exited with {rc}:\n{stderr[-4000:]}")
        self.rc, self.stderr = rc, stderr


def run_job(exe, job_text, env=None, timeout=600):
    with tempfile.NamedTemporaryFile("w", suffix=".job", delete=False) as f:
        f.write(job_text)
        path = f.name
    try:
        e = dict(os.environ)
        e.update(SAN_ENV)
        e.update(env or {})
        r = subprocess.run([str(exe), path], capture_output=True, text=True, env=e, timeout=timeout)
    finally:
        os.unlink(path)
    if r.returncode != 0:
        raise EmuError(r.returncode, r.stderr)
    return r


DT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def _to_bytes(t):
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def _from_bytes(data, dtype, shape):
    if dtype == torch.bfloat16:
        return torch.from_numpy(np.frombuffer(data, dtype=np.int16).copy()).view(torch.bfloat16).reshape(shape)
    npdt = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64}[dtype]
    return torch.from_numpy(np.frombuffer(data, dtype=npdt).copy()).reshape(shape)


def run_op(op, q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None, grad_o=None,
           grad_final_state=None, flavor="asan", exe=None, env=None, shrink=None):
    """Runs core op `op` (docs/ops.md names) in the emulator; returns a dict of output tensors."""
    exe = exe or build(flavor)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = (len(cu_seqlens) - 1) if cu_seqlens is not None else B
    dt = DT[q.dtype]
    with tempfile.TemporaryDirectory() as d:
        lines = [f"op {op}", f"dtype {dt}", f"shape {B} {T} {H} {HV} {K} {V} {N}", f"scale {float(scale)!r}",
                 f"outdir {d}"]
        ins = dict(q=q, k=k, v=v, g=g.float(), beta=beta.float(), initial_state=initial_state,
                   cu_seqlens=cu_seqlens, grad_o=grad_o, grad_final_state=grad_final_state)
        for name, t in ins.items():
            if t is None:
                continue
            if name == "cu_seqlens":
                t = t.to(torch.int64)
            elif name in ("initial_state", "grad_final_state"):
                t = t.float()
            p = os.path.join(d, name + ".in")
            with open(p, "wb") as f:
                f.write(_to_bytes(t))
            lines.append(f"input {name} {p}")
        for name, nbytes in (shrink or {}).items():
            lines.append(f"shrink {name} {nbytes}")
        lines.append("execute")
        r = run_job(exe, "\n".join(lines) + "\n", env=env)
        gshape = tuple(g.shape)
        shapes = dict(o=(q.dtype, (B, T, HV, V)), final_state=(torch.float32, (N, HV, K, V)),
                      dq=(q.dtype, (B, T, H, K)), dk=(q.dtype, (B, T, H, K)), dv=(q.dtype, (B, T, HV, V)),
                      dg=(torch.float32, gshape), dbeta=(torch.float32, (B, T, HV)),
                      dh0=(torch.float32, (N, HV, K, V)))
        out = {"_stderr": r.stderr}
        for name, (dtype, shape) in shapes.items():
            p = os.path.join(d, name + ".bin")
            if os.path.exists(p):
                with open(p, "rb") as f:
                    out[name] = _from_bytes(f.read(), dtype, shape)
        return out


def run_serve(op, q, k, v, g, beta, scale, state_pool, ssm_state_indices, num_accepted_tokens=None,
              cu_seqlens=None, state_v_first=False, exe=None, env=None):
    """Runs {kda,gdn}_recurrent_serve in the emulator on a copy of state_pool; returns (o, updated pool)."""
    exe = exe or build("asan")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = (len(cu_seqlens) - 1) if cu_seqlens is not None else B
    idx = ssm_state_indices.to(torch.int64)
    idx_cols = idx.shape[1] if idx.dim() == 2 else 0
    with tempfile.TemporaryDirectory() as d:
        lines = [f"op {op}", f"dtype {DT[q.dtype]}", f"shape {B} {T} {H} {HV} {K} {V} {N}",
                 f"scale {float(scale)!r}", f"outdir {d}",
                 f"serve {idx_cols} {int(bool(state_v_first))} {state_pool.shape[0]} {DT[state_pool.dtype]}"]
        ins = dict(q=q, k=k, v=v, g=g.float(), beta=beta.float(), state_pool=state_pool, ssm_state_indices=idx,
                   num_accepted_tokens=None if num_accepted_tokens is None else num_accepted_tokens.to(torch.int64),
                   cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(torch.int64))
        for name, t in ins.items():
            if t is None:
                continue
            p = os.path.join(d, name + ".in")
            with open(p, "wb") as f:
                f.write(_to_bytes(t))
            lines.append(f"input {name} {p}")
        lines.append("execute")
        run_job(exe, "\n".join(lines) + "\n", env=env)
        with open(os.path.join(d, "o.bin"), "rb") as f:
            o = _from_bytes(f.read(), q.dtype, (B, T, HV, V))
        with open(os.path.join(d, "state_pool.bin"), "rb") as f:
            pool = _from_bytes(f.read(), state_pool.dtype, tuple(state_pool.shape))
    return o, pool
