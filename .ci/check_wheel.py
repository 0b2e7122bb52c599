"""Check a built kvoff wheel: its label and torch pin fit the torch it was built against, it
carries kvoff's compiled parts and data but no copy of torch's libraries, its extension finds
torch's libraries at run time, and both extensions use the shared C++ runtime (no static copy
of libstdc++: .ci/cxx_runtime.py).

    python3 .ci/check_wheel.py dist/kvoff-0.1.0+cpu-cp311-cp311-linux_x86_64.whl [--json FILE]

Run with the interpreter (and torch) the wheel was built with. Exit status 0 when every check
passes, 1 otherwise (each failure is printed). --json writes the wheel's name, size and the
checks' results.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Libraries that come with torch (or CUDA) and must be found there, never shipped by kvoff.
TORCH_LIBS = re.compile(r"(^|/)lib(torch|c10|gomp|cudart|cuda|shm|nvrtc|cublas)[^/]*\.so")


def _metadata_module():
    # kvoff/_build_metadata.py by path: importing the package would load the editable build.
    path = ROOT / "kvoff" / "_build_metadata.py"
    spec = importlib.util.spec_from_file_location("_build_metadata", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cxx_runtime_module():
    # .ci/cxx_runtime.py by path (this script is run as a file, not as a package module)
    path = Path(__file__).resolve().parent / "cxx_runtime.py"
    spec = importlib.util.spec_from_file_location("cxx_runtime", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _dynamic_section(path: Path) -> str:
    exe = shutil.which("readelf")
    if exe is None:
        raise SystemExit("check_wheel: readelf (binutils) is needed to inspect the extension")
    return subprocess.run([exe, "-d", str(path)], capture_output=True, text=True, check=True).stdout


def _gpu_code(so: Path) -> dict[str, list[str]] | str:
    """The GPU code embedded in a CUDA extension, from `cuobjdump --list-elf --list-ptx`:
    {"sass": ["sm_80", ...], "ptx": ["sm_120", ...]}; a string saying why when cuobjdump (part of
    the CUDA toolkit) is not available."""
    exe = shutil.which("cuobjdump")
    if exe is None:
        return "not checked: no cuobjdump on PATH"
    proc = subprocess.run(
        [exe, "--list-elf", "--list-ptx", str(so)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        return f"not checked: cuobjdump failed: {proc.stderr.strip()[:200]}"
    return parse_cuobjdump(proc.stdout)


def parse_cuobjdump(listing: str) -> dict[str, list[str]]:
    """Architectures of the cubins (`ELF file N: name.sm_90.cubin`) and PTX (`PTX file N:
    name.sm_120.ptx`) in a `cuobjdump --list-elf --list-ptx` listing."""
    sass = sorted(set(re.findall(r"\.(sm_\d+[af]?)\.cubin\b", listing)))
    ptx = sorted(set(re.findall(r"\.(sm_\d+[af]?)\.ptx\b", listing)))
    return {"sass": sass, "ptx": ptx}


def _missing_gpu_code(arch_list: str, code: dict[str, list[str]]) -> list[str]:
    """Failures for each entry of the recorded TORCH_CUDA_ARCH_LIST ("8.0 9.0 12.0+PTX") whose
    cubin (or, for +PTX, PTX) is not in the extension: a wheel without them fails at the first
    kernel launch on that GPU."""
    out = []
    for entry in arch_list.split():
        m = re.match(r"^(\d+)\.(\d)([af]?)(\+PTX)?$", entry)
        if m is None:
            out.append(f"recorded CUDA architecture {entry!r} is not MAJOR.MINOR[a|f][+PTX]")
            continue
        sm = f"sm_{m[1]}{m[2]}{m[3]}"
        if sm not in code["sass"]:
            out.append(f"kvoff/_C has no {sm} cubin although {entry} was asked for")
        if m[4] and sm not in code["ptx"]:
            out.append(f"kvoff/_C has no {sm} PTX although {entry} was asked for")
    return out


def check(wheel: Path) -> dict[str, object]:
    """Run every check; returns a record with 'failures' (empty when the wheel is good)."""
    import torch

    meta = _metadata_module()
    failures: list[str] = []
    name = wheel.name
    m = re.match(r"^kvoff-([^-]+)-([^-]+)-([^-]+)-([^-]+)\.whl$", name)
    if m is None:
        return {"wheel": name, "failures": [f"{name} is not a wheel file name"]}
    version = m[1]
    want_label = meta.local_label(torch.version.cuda)
    want_version = f"{meta.BASE_VERSION}+{want_label}"
    if version != want_version:
        failures.append(f"version {version}, expected {want_version} for torch {torch.__version__}")

    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta_files = [n for n in names if re.match(r"kvoff-[^/]+\.dist-info/METADATA$", n)]
        if len(meta_files) != 1:
            return {"wheel": name, "failures": [f"expected one METADATA, found {meta_files}"]}
        metadata = Parser().parsestr(zf.read(meta_files[0]).decode())
        requires = metadata.get_all("Requires-Dist") or []
        want_pin = meta.torch_requirement(torch.__version__)
        if want_pin not in requires:
            failures.append(f"Requires-Dist {requires} lacks the torch pin {want_pin!r}")
        if metadata["Version"] != version:
            failures.append(f"METADATA Version {metadata['Version']} != file name {version}")

        bundled = [n for n in names if TORCH_LIBS.search(n)]
        if bundled:
            failures.append(f"the wheel carries torch/CUDA libraries: {bundled}")
        for need in (
            "kvoff/__init__.py",
            "kvoff/_build_info.py",
            "kvoff/_build_metadata.py",
            "kvoff/data/traces/conversation_trace.jsonl",
            "kvoff/data/transfer_thresholds.json",
        ):
            if need not in names:
                failures.append(f"missing {need}")
        exts = {
            key: [n for n in names if re.match(rf"kvoff/{key}\..*\.so$", n)]
            for key in ("_C", "_scheduler", "_bench")
        }
        for key, found in exts.items():
            if len(found) != 1:
                failures.append(f"expected one kvoff/{key} extension, found {found}")
        stray = [n for n in names if n.endswith((".in", ".pyc", ".a", ".o")) or "/tests/" in n]
        if stray:
            failures.append(f"files that do not belong in a wheel: {stray}")

        build_info: dict[str, object] = {}
        if "kvoff/_build_info.py" in names:
            exec(zf.read("kvoff/_build_info.py").decode(), build_info)
            if build_info["VERSION"] != version:
                failures.append(f"_build_info.VERSION {build_info['VERSION']} != {version}")
            if build_info["GTEST_BINARY"] is not None:
                failures.append("_build_info.GTEST_BINARY points into a build tree")
            if bool(build_info["WITH_CUDA"]) != (want_label != "cpu"):
                failures.append(f"WITH_CUDA={build_info['WITH_CUDA']} in a +{want_label} wheel")

        needed: list[str] = []
        runpath: list[str] = []
        gpu_code: dict[str, list[str]] | str = "not a CUDA wheel"
        cxx_runtime = _cxx_runtime_module()
        for key in ("_C", "_scheduler", "_bench"):
            if exts[key]:
                with tempfile.TemporaryDirectory() as tmp:
                    failures += [
                        f"kvoff/{key}: {problem}"
                        for problem in cxx_runtime.runtime_problems(
                            Path(zf.extract(exts[key][0], tmp))
                        )
                    ]
        if exts["_C"]:
            with tempfile.TemporaryDirectory() as tmp:
                so = Path(zf.extract(exts["_C"][0], tmp))
                dyn = _dynamic_section(so)
                if build_info.get("WITH_CUDA"):
                    gpu_code = _gpu_code(so)
            if isinstance(gpu_code, dict):
                failures += _missing_gpu_code(str(build_info["CUDA_ARCHITECTURES"]), gpu_code)
            needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn)
            runpath = re.findall(
                r"\((?:RUNPATH|RPATH)\)\s+Library (?:runpath|rpath): \[([^\]]+)\]", dyn
            )
            for lib in ("libc10.so", "libtorch_cpu.so"):
                if lib not in needed:
                    failures.append(f"kvoff/_C does not link {lib} dynamically (NEEDED: {needed})")
            paths = [p for rp in runpath for p in rp.split(":")]
            if "$ORIGIN/../torch/lib" not in paths:
                failures.append(f"kvoff/_C has no $ORIGIN/../torch/lib run path ({paths})")
            absolute = [p for p in paths if p.startswith("/")]
            if absolute:
                failures.append(f"kvoff/_C has build-machine run paths: {absolute}")

    return {
        "wheel": name,
        "size_bytes": wheel.stat().st_size,
        "version": version,
        "requires_dist": requires,
        "built_against_torch": str(torch.__version__),
        "with_cuda": build_info.get("WITH_CUDA"),
        "cuda_architectures": build_info.get("CUDA_ARCHITECTURES"),
        "extension_gpu_code": gpu_code,
        "extension_needed": needed,
        "extension_runpath": runpath,
        "files": len(names),
        "failures": failures,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--json", type=Path, default=None, metavar="FILE")
    args = parser.parse_args()
    record = check(args.wheel)
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    size = record.get("size_bytes")
    size_txt = f", {size / 2**20:.1f} MiB" if isinstance(size, int) else ""
    for failure in record["failures"]:  # type: ignore[union-attr]
        print(f"check_wheel: FAIL {failure}", file=sys.stderr)
    if record["failures"]:
        return 1
    print(
        f"check_wheel: {record['wheel']}{size_txt}: label, torch pin "
        f"({record['requires_dist'][0]}), contents, run path and C++ runtime OK"
    )  # type: ignore[index]
    return 0


if __name__ == "__main__":
    sys.exit(main())
