"""The CUDA toolkit root, found one way for every user: setup.py (the extension build), the
Makefile (CMake's CUDA compiler), bench/kernel_resources.py and the build tests.

    python tools/cuda_toolkit.py    # prints the root, or nothing when there is no toolkit
"""
import os
import re
import shutil
import sys
from pathlib import Path


def find_cuda_home():
    """Toolkit root. `which nvcc` may be a wrapper script (as on the dev machines), so it is
    resolved through the script's exec line when it does not sit in a toolkit tree."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        path = os.environ.get(var)
        if path and (Path(path) / "bin" / "nvcc").exists():
            return str(Path(path))
    if Path("/usr/local/cuda/bin/nvcc").exists():
        return "/usr/local/cuda"
    nvcc = shutil.which("nvcc")
    if not nvcc:
        return None
    real = Path(nvcc).resolve()
    if (real.parent.parent / "include" / "cuda_runtime.h").exists():
        return str(real.parent.parent)
    try:
        text = real.read_text(errors="ignore")[:4096]
    except OSError:
        return None
    for match in re.finditer(r"(/[^\s\"']+)/bin/nvcc", text):
        if (Path(match.group(1)) / "include" / "cuda_runtime.h").exists():
            return match.group(1)
    return None


if __name__ == "__main__":
    root = find_cuda_home()
    if root:
        print(root)
    sys.exit(0)
