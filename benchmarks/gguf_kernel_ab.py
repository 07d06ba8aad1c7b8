"""Old against new GGUF kernels (kernels/cpu_gguf.cpp) in one process, on a real GGUF file's tensors.

    python benchmarks/gguf_kernel_ab.py [--old REV] [--gguf /work/ggufs/random1b.Q4_K_M.gguf] [--threads 2]
                                        [--rounds 9] [--m 1] [--prompt] [--isa avx2] [--json FILE]

Builds benchmarks/gguf_kernel_ab.cpp with two copies of cpu_gguf.cpp: git revision REV's (its namespace renamed
edgellm_old) and the working tree's, then multiplies every quantized tensor of the file (the linears and the output
head, memory-mapped, as the model reads them per token) by M rows of x with each build in turn, rounds alternating
which build goes first. On a machine loaded by other work both builds see the same load, so the ratio holds where
the absolute figures do not (with --threads 1 the harness counts its thread's CPU time, not wall time, so time
the core spends on other processes is left out). GB/s = the tensors' bytes / the best round's time.

--hot: one tensor per kind, cut to its first rows that fit in 192 KiB (L2), multiplied 50 times a round: the
kernels' compute speed without DRAM, the figure least blurred by other work on the machine.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "kernels"
NATIVE = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}

OLD_ENTRY = """
namespace edgellm {
void gguf_linear_old(const float* x, int64_t M, int64_t K, const uint8_t* blocks, int type, int64_t N, float* y,
                     bool prompt) {
  const GgufActs a = gguf_quantize_acts(x, M, K);
  if (prompt) gguf_gemm_prompt(a, blocks, type, N, K, y, N, nullptr);
  else gguf_gemm(a, blocks, type, N, K, y, N, nullptr);
}
}  // namespace edgellm
"""


def tensor_list(path: str) -> list[tuple[int, int, int, int, str]]:
    """(file offset, GGML type, rows N, K, kind) of every natively multiplied tensor of a GGUF file."""
    import gguf

    r = gguf.GGUFReader(path)
    out = []
    for t in r.tensors:
        if t.tensor_type.name not in NATIVE:
            continue
        kind = (t.name.split(".")[-2] if t.name.startswith("blk.") else t.name.split(".")[0])
        out.append((int(t.data_offset), int(t.tensor_type), int(t.shape[1]), int(t.shape[0]),
                    f"{kind}:{t.tensor_type.name}:{int(t.shape[1])}x{int(t.shape[0])}"))
    return out


def build(old_rev: str, folder: Path, flags: list[str]) -> Path:
    old = folder / "old"
    old.mkdir()
    listed = [Path(p).name for p in subprocess.run(["git", "ls-tree", "--name-only", old_rev, "kernels/"], cwd=ROOT,
                                                      capture_output=True, text=True, check=True).stdout.split()]
    # cpu_gguf.cpp and its companions (the grid kernels; the new side's x8 kernels too: the old side's are stubs in
    # gguf_kernel_ab.cpp), with every header
    parts = lambda names: [n for n in names if n.startswith("cpu_gguf") and n.endswith(".cpp")]  # noqa: E731
    for name in parts(listed) + [n for n in listed if n.endswith(".h")]:
        shown = subprocess.run(["git", "show", f"{old_rev}:kernels/{name}"], cwd=ROOT, capture_output=True, text=True,
                               check=True)
        (old / name).write_text(shown.stdout + (OLD_ENTRY if name == "cpu_gguf.cpp" else ""))
    objs = []
    sources = [(old / n, old, ["-Dedgellm=edgellm_old"]) for n in parts(listed) if n != "cpu_gguf_x8.cpp"]
    sources += [(KERNELS / n, KERNELS, []) for n in parts(sorted(p.name for p in KERNELS.iterdir()))]
    for src, inc, extra in sources + [(ROOT / "benchmarks" / "gguf_kernel_ab.cpp", KERNELS, [])]:
        obj = folder / (src.stem + ("_old" if extra else "") + ".o")
        subprocess.run(["g++", "-O3", "-std=c++17", *flags, f"-I{inc}", *extra, "-c", str(src), "-o", str(obj)],
                       check=True)
        objs.append(str(obj))
    exe = folder / "ab"
    subprocess.run(["g++", "-pthread", *objs, "-o", str(exe)], check=True)
    return exe


def isa_flags(isa: str | None = None) -> list[str]:
    """The compiler flags of the best build this CPU runs (isa "avx2": the AVX2 one on an AVX-512 VNNI machine)."""
    flags = open("/proc/cpuinfo").read().split("flags", 1)[1].split("\n", 1)[0].split()
    out = ["-mavx2", "-mfma", "-mf16c"] if {"avx2", "fma", "f16c"} <= set(flags) else []
    if out and isa != "avx2" and {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= set(flags):
        out += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="HEAD", help="git revision of the old kernels (default: the last commit)")
    ap.add_argument("--gguf", default="/work/ggufs/random1b.Q4_K_M.gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--m", default="1", help="rows of x, comma list")
    ap.add_argument("--hot", action="store_true", help="L2-resident slices, repeated (compute speed)")
    ap.add_argument("--prompt", action="store_true", help="the prompt GEMM (gguf_gemm_prompt) instead of the row "
                    "kernel: for prompt-sized M, e.g. --m 512 --threads 1")
    ap.add_argument("--isa", default=None, choices=[None, "avx2"], help="avx2: both builds AVX2-only (on an "
                    "AVX-512 machine, as an AVX2 one runs them)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tensors = tensor_list(args.gguf)
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    def row_bytes(typ: int, k: int) -> int:
        qv, qb = GGML_QUANT_SIZES[GGMLQuantizationType(typ)]
        return k // qv * qb

    repeats = 1
    if args.hot:
        first = {}
        for off, typ, n, k, kind in tensors:
            first.setdefault(kind, (off, typ, min(n, (192 << 10) // row_bytes(typ, k)), k, kind))
        tensors, repeats = list(first.values()), 50
    nbytes: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        flags = isa_flags(args.isa)
        exe = build(args.old, folder, flags)
        lst = folder / "tensors.txt"
        with open(lst, "w") as f:
            for off, typ, n, k, kind in tensors:
                f.write(f"{off} {typ} {n} {k} {kind}\n")
        for off, typ, n, k, kind in tensors:
            nbytes[kind] = nbytes.get(kind, 0) + n * row_bytes(typ, k) * repeats
        nbytes["TOTAL"] = sum(nbytes.values())
        bw = subprocess.run([str(exe), "read", str(args.threads), "10"], check=True, capture_output=True,
                            text=True).stdout.split()[1]
        read_gbps = float(bw)
        print(f"streaming read, {args.threads} threads: {read_gbps:.2f} GB/s (the ceiling: bytes per token / this)")
        out = subprocess.run([str(exe), args.gguf, str(lst), str(args.threads), str(args.rounds), args.m,
                              str(repeats), str(int(args.prompt))],
                             check=True, capture_output=True, text=True).stdout
    rows = {}
    for line in out.splitlines():
        build_name, m, kind, best, med = line.split()
        key = (kind, int(m.split("=")[1]))
        rows.setdefault(key, {})[build_name] = {"best_s": float(best.split("=")[1]), "median_s": float(med.split("=")[1])}
    table = []
    for (kind, m), r in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0] == "TOTAL", kv[0][0])):
        row = {"kind": kind, "M": m, "bytes": nbytes[kind]}
        for b in ("old", "new"):
            row[b] = {**r[b], "GBps": nbytes[kind] / r[b]["best_s"] / 1e9}
        row["speedup_best"] = r["old"]["best_s"] / r["new"]["best_s"]
        row["speedup_median"] = r["old"]["median_s"] / r["new"]["median_s"]
        table.append(row)
        print(f"M={m:<4d} {kind:40s} old {row['old']['best_s'] * 1e3:8.2f} ms {row['old']['GBps']:6.2f} GB/s   "
              f"new {row['new']['best_s'] * 1e3:8.2f} ms {row['new']['GBps']:6.2f} GB/s   x{row['speedup_best']:.2f} "
              f"(median x{row['speedup_median']:.2f})", flush=True)
    if args.json:
        doc = {"command": " ".join(["python", "benchmarks/gguf_kernel_ab.py", *sys.argv[1:]]),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "old_rev": subprocess.run(["git", "rev-parse", args.old], cwd=ROOT, capture_output=True,
                                         text=True).stdout.strip(),
               "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                           "flags": sorted(x for x in open("/proc/cpuinfo").read().split("flags", 1)[1]
                                           .split("\n", 1)[0].split() if x.startswith(("avx", "fma", "f16c")))},
               "load_average": os.getloadavg(), "threads": args.threads, "hot": args.hot,
               "read_GBps": read_gbps, "file": args.gguf, "compile_flags": flags,
               "rows": table}
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
