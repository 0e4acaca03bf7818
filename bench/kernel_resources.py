"""Resource use of every CUDA kernel, read from the compiler: no GPU needed, only nvcc.

Compiles each csrc/kernels/*.cu with the extension's flags for every architecture asked for
(`-Xptxas -v` for registers / spills / static shared memory / stack, `cuobjdump -sass` for
local-memory and FP64 instructions), joins that with the launchers' real block sizes and dynamic
shared memory (ddtree._C.kernel_shapes(), compiled from the same sources) and computes the
theoretical occupancy (resident warps per SM) from the architecture's limits.

Exits 1 when a kernel spills, touches local memory, runs FP64 instructions without a reason listed
in FP64_ALLOWED, or has fewer resident warps per SM than its floor (FLOORS).

    python bench/kernel_resources.py                      # every built architecture, checks
    python bench/kernel_resources.py --arch 90 120 --json out.json --markdown out.md
    python bench/kernel_resources.py --only attention      # table rows of matching kernels
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
# The nvcc flags of setup.py's CUDA build (less the gencode list, one architecture at a time).
NVCC_FLAGS = ["-O3", "--use_fast_math", "-std=c++17", "-DDDTREE_WITH_CUDA=1"]
# Kernels used only by the emulator's self-test.
SKIP_SOURCES = {"simt_selftest.cu"}


@dataclass(frozen=True)
class Arch:
    """Per-SM limits (CUDA C++ Programming Guide, 'Technical Specifications per Compute
    Capability'; register allocation: 256-register units per warp in 4 partitions of 16K)."""

    sm: int
    max_warps: int
    max_blocks: int
    smem_per_sm: int  # bytes usable by blocks
    smem_per_block: int
    reserved_smem: int = 1024  # per block, taken by the system
    registers: int = 65536


ARCHS = {
    80: Arch(80, 64, 32, 167936, 166912),
    90: Arch(90, 64, 32, 233472, 232448),
    100: Arch(100, 64, 32, 233472, 232448),
    120: Arch(120, 48, 32, 102400, 101376),
}

# Minimum resident warps per SM, by kernel name prefix (first match wins).
FLOORS = [
    ("tree_attention_kernel", 8),
    ("draft_attention_kernel", 8),
    # One warp per request whose heap and node table take (budget + 1) * 22 bytes of shared
    # memory: at budget 1024 (22.5 KiB) 4 requests share an sm_120 SM, whatever the block shape.
    ("build_tree_kernel", 4),
    ("", 8),
]

# Kernels allowed FP64 instructions, and why.
FP64_ALLOWED = {
    "build_tree_kernel": "path scores are float64 by specification (bit-exact with the reference)",
    "verify_sample_kernel": "the top-p drop mass, one float64 product per tree row (none per token)",
    "sample_rows_kernel": "the top-p drop mass, one float64 product per tree row (none per token)",
}


@dataclass
class Row:
    kernel: str
    at: str
    arch: int
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    local_ops: int
    fp64_ops: int
    static_smem: int
    dynamic_smem: int
    threads: int
    blocks: int
    warps: int
    occupancy: float
    limiter: str
    floor: int
    problems: list


def find_tool(name: str) -> str | None:
    sys.path.insert(0, str(ROOT / "tools"))
    from cuda_toolkit import find_cuda_home

    root = find_cuda_home()
    if root and (Path(root) / "bin" / name).exists():
        return str(Path(root) / "bin" / name)
    try:  # the CUDA torch wheels bring triton, which ships cuobjdump / nvdisasm
        import triton

        path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
        if path.exists():
            return str(path)
    except ImportError:
        pass
    return shutil.which(name)


def short_name(mangled_or_demangled: str) -> str:
    """'void ddtree::gpu::(anonymous namespace)::k<128, true>(P)' -> 'k<128, true>'."""
    text = mangled_or_demangled.strip().replace("(anonymous namespace)::", "")
    if text.startswith("void "):
        text = text[5:]
    depth, cut = 0, len(text)
    for i, ch in enumerate(text):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            cut = i
            break
    text = text[:cut]
    depth, start = 0, 0
    for i, ch in enumerate(text):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == ":" and depth == 0 and text[i : i + 2] == "::":
            start = i + 2
    return text[start:]


def demangle(names: list[str]) -> dict[str, str]:
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
    return dict(zip(names, out.stdout.splitlines()))


def compile_source(nvcc: str, cuobjdump: str, source: Path, arch: int, workdir: Path) -> dict:
    """{mangled name: facts} of one .cu for one architecture."""
    cubin = workdir / f"{source.stem}_sm{arch}.cubin"
    cmd = [nvcc, "-cubin", *NVCC_FLAGS, f"-arch=sm_{arch}", "-Xptxas", "-v", f"-I{CSRC}",
           str(source), "-o", str(cubin)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"kernel_resources: nvcc failed on {source.name} for sm_{arch}:\n{proc.stderr}")
    facts: dict[str, dict] = {}
    current = None
    for line in proc.stderr.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            current = facts.setdefault(m.group(1), {"static_smem": 0, "stack": 0, "spill_stores": 0,
                                                    "spill_loads": 0, "registers": 0})
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            current["stack"], current["spill_stores"], current["spill_loads"] = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current["registers"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            current["static_smem"] = int(s.group(1)) if s else 0
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    function = None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            function = facts.setdefault(m.group(1), {})
            function.setdefault("local_ops", 0)
            function.setdefault("fp64_ops", 0)
            continue
        if function is None:
            continue
        instr = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if not instr:
            continue
        op = instr.group(1)
        if op.split(".")[0] in ("LDL", "STL"):
            function["local_ops"] += 1
        if op.split(".")[0] in ("DADD", "DMUL", "DFMA", "DSETP", "DMNMX", "DMMA") or ".F64" in op:
            function["fp64_ops"] += 1
    return facts


def occupancy(arch: Arch, threads: int, registers: int, smem: int) -> tuple[int, int, str]:
    """(blocks per SM, warps per SM, limiting resource)."""
    warps_per_block = -(-threads // 32)
    limits = {"warps": arch.max_warps // warps_per_block, "blocks": arch.max_blocks}
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
    limits["registers"] = (4 * (arch.registers // 4 // regs_per_warp)) // warps_per_block
    per_block = -(-(smem + arch.reserved_smem) // 128) * 128
    limits["shared memory"] = arch.smem_per_sm // per_block if smem <= arch.smem_per_block else 0
    limiter = min(limits, key=lambda k: limits[k])
    blocks = limits[limiter]
    return blocks, blocks * warps_per_block, limiter


def floor_of(kernel: str) -> int:
    return next(v for prefix, v in FLOORS if kernel.startswith(prefix))


def collect(archs: list[int], jobs: int) -> list[Row]:
    nvcc, cuobjdump = find_tool("nvcc"), find_tool("cuobjdump")
    if not nvcc:
        sys.exit("kernel_resources: nvcc not found (set CUDA_HOME)")
    if not cuobjdump:
        sys.exit("kernel_resources: cuobjdump not found (CUDA toolkit bin/ or the triton wheel)")
    sys.path.insert(0, str(ROOT / "python"))
    from ddtree import _C

    shapes = _C.kernel_shapes()
    sources = sorted(p for p in (CSRC / "kernels").glob("*.cu") if p.name not in SKIP_SOURCES)
    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = {(src.name, a): pool.submit(compile_source, nvcc, cuobjdump, src, a, Path(tmp))
                   for src in sources for a in archs}
        per_arch: dict[int, dict[str, dict]] = {a: {} for a in archs}
        for (_, a), fut in futures.items():
            facts = fut.result()
            names = demangle(list(facts))
            for mangled, f in facts.items():
                per_arch[a][short_name(names[mangled])] = f
    rows = []
    for a in archs:
        arch = ARCHS[a]
        for kernel, threads, dyn, at in shapes:
            f = per_arch[a].get(kernel)
            if f is None:
                sys.exit(f"kernel_resources: no compiled kernel named {kernel!r} for sm_{a} "
                         f"(compiled: {sorted(per_arch[a])})")
            smem = f["static_smem"] + dyn
            blocks, warps, limiter = occupancy(arch, threads, f["registers"], smem)
            floor = floor_of(kernel)
            problems = []
            if f["spill_stores"] or f["spill_loads"]:
                problems.append(f"spills {f['spill_stores']} B stored / {f['spill_loads']} B loaded")
            if f["local_ops"]:
                problems.append(f"{f['local_ops']} local-memory instructions")
            if f["fp64_ops"] and kernel.split("<")[0] not in FP64_ALLOWED:
                problems.append(f"{f['fp64_ops']} FP64 instructions")
            if warps < floor:
                problems.append(f"{warps} warps/SM < floor {floor} ({limiter})")
            rows.append(Row(kernel, at, a, f["registers"], f["spill_stores"], f["spill_loads"],
                            f["stack"], f["local_ops"], f["fp64_ops"], f["static_smem"], dyn, threads,
                            blocks, warps, warps / arch.max_warps, limiter, floor, problems))
    return rows


def markdown(rows: list[Row]) -> str:
    lines = ["| kernel | size | arch | regs | spill B (st/ld) | local ops | FP64 ops | smem KiB (static+dyn) "
             "| threads | blocks/SM | warps/SM | occupancy | limited by |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        smem = (r.static_smem + r.dynamic_smem) / 1024
        lines.append(f"| `{r.kernel}` | {r.at} | sm_{r.arch} | {r.registers} | {r.spill_stores}/{r.spill_loads} "
                     f"| {r.local_ops} | {r.fp64_ops} | {smem:.1f} | {r.threads} | {r.blocks} | {r.warps} "
                     f"| {r.occupancy:.0%} | {r.limiter} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90, 100, 120], choices=sorted(ARCHS))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--json", type=Path, help="write the rows as JSON")
    ap.add_argument("--markdown", type=Path, help="write the table as Markdown")
    ap.add_argument("--only", help="regular expression: table rows of matching kernels only (all are checked)")
    args = ap.parse_args()
    rows = collect(args.arch, args.jobs)
    table = markdown([r for r in rows if not args.only or re.search(args.only, r.kernel)])
    print(table)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(table)
    bad = [r for r in rows if r.problems]
    for r in bad:
        print(f"FAIL {r.kernel} ({r.at or 'any size'}) sm_{r.arch}: {'; '.join(r.problems)}", file=sys.stderr)
    print(f"kernel_resources: {len(rows)} launch shapes, {len(bad)} failing", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
