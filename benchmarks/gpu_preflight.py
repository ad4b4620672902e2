"""Before any engine of the GPU check: where the CUDA toolkit is, whether SGLang's JIT can link against it,
whether SGLang's bundled Rust radix-tree extension loads under this torch, and the JIT builds themselves.

Two parts:
- `prepare_env(env, tmp)` (no CUDA needed, milliseconds; benchmarks/gpu_check.py calls it in its own
  process so that every later step inherits it):
  * the toolkit: CUDA_HOME / CUDA_PATH, else `nvcc` on PATH, else /usr/local/cuda, else the pip layout
    (site-packages/nvidia/cu*/bin/nvcc). tvm-ffi, which builds SGLang's JIT kernels, links them with
    `-L$CUDA_HOME/lib64 -lcudart`; a pip-style toolkit has lib/ and only `libcudart.so.<major>`, so the
    link fails with "cannot find -lcudart". Then a shim folder stands in for CUDA_HOME: every entry of
    the real toolkit linked, and lib64/ holding links to its libraries plus `libcudart.so` ->
    `libcudart.so.<major>` (the built module records the soname, which torch has already loaded).
  * `SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python`: SGLang's radix cache builds its tree with a bundled
    Rust extension linked against libtorch (built for SGLang's pinned torch, the image has 2.11); the
    Python tree core does the same job, so the check's engines keep their radix cache and do not
    depend on that binary. `probe_rust_tree_core` still reports whether it loads, by name.
  * TRITON_F32_DEFAULT=ieee (SGLang's triton attention calls tl.dot with no precision: TF32 in fp32)
    and PYTHONUNBUFFERED=1.
- `python benchmarks/gpu_preflight.py --out DIR` (a step of the check): the Rust extension probe, and on
  CUDA the JIT builds (KV store; EAGLE tree kernels, which have no fallback), each with its log tail.
  On a CPU machine with nvcc the same builds run for an H200 (sm_90a; torch told it has one) into an
  empty JIT cache, with the prepared CUDA_HOME: compiled and linked as on the device, not run.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]
RADIX_ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"


# ----------------------------------------------------------------------------------- toolkit
def _site_dirs() -> list[str]:
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    dirs += [p for p in sys.path if p.endswith("site-packages")]
    return list(dict.fromkeys(d for d in dirs if d and os.path.isdir(d)))


def toolkit_candidates(env: dict, site_dirs: list[str] | None = None,
                       system: tuple[str, ...] = ("/usr/local/cuda",)) -> list[tuple[str, str]]:
    """(source, folder) in the order tvm-ffi / SGLang look (CUDA_HOME, CUDA_PATH, nvcc on PATH,
    /usr/local/cuda), then the pip layout of the nvidia-* wheels (nvidia/cu13, nvidia/cuda_nvcc)."""
    out = [(k, env[k]) for k in ("CUDA_HOME", "CUDA_PATH") if env.get(k)]
    nvcc = shutil.which("nvcc", path=env.get("PATH", ""))
    if nvcc:
        out.append(("nvcc on PATH", str(Path(os.path.realpath(nvcc)).parent.parent)))
        target = wrapped_nvcc(nvcc)
        if target:
            out.append(("the nvcc the one on PATH runs", str(Path(target).parent.parent)))
    out += [(d, d) for d in system]
    for site in site_dirs if site_dirs is not None else _site_dirs():
        for pattern in ("nvidia/cu*", "nvidia/cuda_nvcc"):
            out += [("pip layout", d) for d in sorted(glob.glob(os.path.join(site, pattern)))]
    return out


def wrapped_nvcc(path: str) -> str | None:
    """The nvcc a wrapper script on PATH runs (`exec /opt/cuda/bin/nvcc "$@"`): tvm-ffi takes the
    wrapper's folder for the toolkit, which has no libraries."""
    try:
        head = Path(path).read_bytes()[:2000]
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    for token in head.decode(errors="replace").split():
        token = token.strip("'\"")
        if token.endswith("/bin/nvcc") and os.path.realpath(token) != os.path.realpath(path) and os.path.isfile(token):
            return token
    return None


def find_cudart(home: str, site_dirs: list[str] | None = None) -> str | None:
    """A libcudart.so* of the toolkit (lib64, lib, targets/*/lib) or of the nvidia-cuda-runtime wheel."""
    places = [os.path.join(home, d) for d in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib")]
    for site in site_dirs if site_dirs is not None else _site_dirs():
        places += sorted(glob.glob(os.path.join(site, "nvidia/cu*/lib"))) + [os.path.join(site, "nvidia/cuda_runtime/lib")]
    for place in places:
        names = sorted(glob.glob(os.path.join(place, "libcudart.so*")), key=len)  # libcudart.so first if there
        if names:
            return names[0]
    return None


def make_shim(home: str, cudart: str, shim: Path) -> Path:
    """A folder that is `home` to the JIT: links to every entry of the real toolkit but lib64, and a
    lib64/ with links to the libraries beside `cudart` and to home's own lib64/lib, plus libcudart.so."""
    shim.mkdir(parents=True, exist_ok=True)
    for entry in os.listdir(home):
        if entry != "lib64" and not (shim / entry).exists():
            (shim / entry).symlink_to(os.path.join(home, entry))
    lib64 = shim / "lib64"
    lib64.mkdir(exist_ok=True)
    for folder in dict.fromkeys([os.path.dirname(cudart), os.path.join(home, "lib64"), os.path.join(home, "lib")]):
        for f in glob.glob(os.path.join(folder, "*")) if os.path.isdir(folder) else []:
            if not (lib64 / os.path.basename(f)).exists():
                (lib64 / os.path.basename(f)).symlink_to(f)
    if not (lib64 / "libcudart.so").exists():
        (lib64 / "libcudart.so").symlink_to(cudart)
    return shim


def locate_toolkit(env: dict, tmp: Path, site_dirs: list[str] | None = None,
                   system: tuple[str, ...] = ("/usr/local/cuda",)) -> dict:
    """Where nvcc and libcudart are, and the CUDA_HOME the JIT should see (the toolkit itself when
    lib64/libcudart.so is there, else a shim under `tmp`). The first candidate with nvcc and its own
    libcudart wins, then one with nvcc and the runtime wheel's libcudart, then the first with nvcc. `home` None: no nvcc found (the JIT kernels cannot
    build; on a CPU machine that is expected)."""
    tried, found = [], []
    for source, home in toolkit_candidates(env, site_dirs, system):
        nvcc = os.path.join(home, "bin", "nvcc")
        has = os.path.isfile(nvcc)
        cudart = find_cudart(home, site_dirs) if has else None
        tried.append(f"{source}: {home}" + ("" if has else " (no bin/nvcc)") + ("" if cudart or not has else
                                                                                   " (no libcudart)"))
        if has:
            found.append((source, home, nvcc, cudart))
    if found:
        own = [f for f in found if f[3] and f[3].startswith(f[1].rstrip("/") + "/")]
        source, home, nvcc, cudart = (own or [f for f in found if f[3]] or found)[0]
        info = {"home": home, "source": source, "nvcc": nvcc, "cudart": cudart, "tried": tried}
        if os.path.exists(os.path.join(home, "lib64", "libcudart.so")):
            return {**info, "cuda_home": home, "layout": "lib64/libcudart.so present"}
        if cudart is None:
            return {**info, "cuda_home": home, "layout": "no libcudart found: the JIT link will fail"}
        shim = make_shim(home, cudart, Path(tmp) / "cuda_home")
        return {**info, "cuda_home": str(shim), "layout": f"no lib64/libcudart.so: shim {shim} (lib64/libcudart.so -> "
                                                           f"{cudart})"}
    return {"home": None, "cuda_home": None, "layout": "no nvcc found", "tried": tried}


def nvcc_version(nvcc: str | None) -> str | None:
    if not nvcc:
        return None
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return f"{type(err).__name__}: {err}"
    return next((ln.strip() for ln in out.splitlines() if "release" in ln), out.strip()[-200:])


def prepare_env(env: dict, tmp: Path, cuda: bool) -> dict:
    """Sets in `env` what every step of the check inherits; returns what it found (printed and saved)."""
    env[RADIX_ENV] = "python"
    env["PYTHONUNBUFFERED"] = "1"
    if cuda:
        env["TRITON_F32_DEFAULT"] = "ieee"
    kit = locate_toolkit(env, tmp)
    if kit["cuda_home"]:
        env["CUDA_HOME"] = kit["cuda_home"]
        env["PATH"] = os.path.join(kit["home"], "bin") + os.pathsep + env.get("PATH", "")
    kit["nvcc_version"] = nvcc_version(kit.get("nvcc"))
    return {"toolkit": kit, "env": {k: env.get(k) for k in (RADIX_ENV, "TRITON_F32_DEFAULT", "CUDA_HOME")}}


# -------------------------------------------------------------------------------- the probes
_RUST_PROBE = """
import torch
from sglang.srt.mem_cache.rust_tree_core.extension import bindings
print("LOADED", torch.__version__, bindings.__file__)
"""


def probe_rust_tree_core(timeout_s: int = 60) -> dict:
    """Loads SGLang's bundled Rust radix-tree extension in a child (an ABI mismatch can crash the
    process). The check does not depend on it (prepare_env selects the Python tree core)."""
    try:
        out = subprocess.run([sys.executable, "-c", _RUST_PROBE], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"loads": False, "error": f"timed out after {timeout_s} s"}
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("LOADED ")), None)
    if out.returncode == 0 and line:
        return {"loads": True, "detail": line}
    tail = (out.stderr or out.stdout).strip().splitlines()
    return {"loads": False, "exit": out.returncode, "error": tail[-1][:400] if tail else f"exit {out.returncode}",
            "log": (out.stdout + out.stderr)[-3000:]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", type=Path, default=None, help="folder for gpu_preflight.json (default: $OUT, else .)")
    p.add_argument("--build-timeout", type=int, default=150, help="seconds per JIT build")
    p.add_argument("--no-compile", action="store_true", help="cpu: do not compile the JIT kernels with nvcc")
    args = p.parse_args(argv)
    if "CUDA_HOME" not in os.environ:  # alone, not under gpu_check.py
        import tempfile

        prepare_env(os.environ, Path(tempfile.mkdtemp(prefix="specforge-cuda-home-")), cuda=args.device == "cuda")
    out = (args.out or Path(os.environ.get("OUT") or ".")) / "gpu_preflight.json"
    res: dict = {"device": args.device, "env": {k: os.environ.get(k) for k in (RADIX_ENV, "CUDA_HOME",
                                                                                 "TRITON_F32_DEFAULT")}}
    t0 = time.perf_counter()
    res["rust_tree_core"] = rust = probe_rust_tree_core()
    print(("INFO" if rust["loads"] else "WARN") + " SGLang's Rust radix-tree extension "
          + ("loads" if rust["loads"] else f"does NOT load ({rust['error']})")
          + f"; the check's engines use {RADIX_ENV}={os.environ.get(RADIX_ENV)}", flush=True)
    ok = True
    if args.device == "cuda":
        from _gpu_device import jit_preflight
        from gpu_targets import SMOLLM2

        row = SMOLLM2["num_key_value_heads"] * SMOLLM2["head_dim"]
        res["jit"] = jit = jit_preflight([2 * row, 4 * row], tree=True, timeout_s=args.build_timeout)
        for name, built in jit.items():
            status = "PASS" if built["built"] else ("WARN" if name == "kv_store" else "FAIL")
            ok &= status != "FAIL"
            print(f"{status} SGLang JIT {name} kernel: " + (f"built in {built['seconds']} s" if built["built"] else
                  "NOT built" + (" (torch fallback)" if name == "kv_store" else "; speculative decoding cannot run")),
                  flush=True)
            if not built["built"]:
                print(built["log"], flush=True)
    elif args.no_compile or not os.environ.get("CUDA_HOME"):
        res["jit"] = "not compiled: " + ("--no-compile" if args.no_compile else "no CUDA toolkit on this machine")
        print(f"SKIP SGLang JIT kernels on CPU: {res['jit']}", flush=True)
    else:  # what the device builds, built here for an H200 with this machine's nvcc and the prepared CUDA_HOME
        import tempfile

        from _gpu_device import jit_compile_on_cpu
        from gpu_targets import SMOLLM2

        row = SMOLLM2["num_key_value_heads"] * SMOLLM2["head_dim"]
        with tempfile.TemporaryDirectory(prefix="specforge-jit-") as cache:
            res["jit"] = jit = jit_compile_on_cpu([2 * row, 4 * row], cache, args.build_timeout)
        for name, built in jit.items():
            ok &= built["built"]
            print(f"{'PASS' if built['built'] else 'FAIL'} SGLang JIT {name} kernel compiled on CPU for sm_90a "
                  f"(CUDA_HOME {os.environ['CUDA_HOME']}): " + (f"{built['seconds']} s" if built["built"] else
                                                               "NOT built"), flush=True)
            if not built["built"]:
                print(built["log"], flush=True)
    res.update(ok=ok, wall_s=time.perf_counter() - t0)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}", flush=True)
    return res


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
