"""What `--weights auto` (a GGUF run as stored) costs against the same file dequantized to fp32 (`--weights fp`), per
file: `edgellm perplexity --reference fp` (KL of the next-token distributions, top-1 agreement, both perplexities)
over GPL-3, one process per file.

    python benchmarks/gguf_auto_kl.py FILE.gguf [FILE.gguf ...] [--ctx 512] [--windows 4] [--amx both] [--json FILE]

The weights are the same numbers either way (every block kept bit for bit, or dequantized bit for bit like
gguf.quants); what differs is the activations, rounded to int8 per 32 values by the kernels as llama.cpp rounds them
(`--activations int8x2` / `--weights fp` avoid it). On a CPU with AMX the windows' prefills run on the AMX kernel in
bf16 (kernels/gguf_ops.py); `--amx off` runs the child with it off (the int8 prompt GEMM), `--amx both` each file both
ways; `--amx-attention` likewise the prefill's attention on AMX tiles or in fp32.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

TEXT = "/usr/share/common-licenses/GPL-3"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--amx", choices=["on", "off", "both"], default="on")
    ap.add_argument("--amx-attention", choices=["on", "off", "both"], default="on",
                    help="the prefill's attention on AMX tiles (kernels/attention.AMX_ATTENTION) or in fp32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    both = ("on", "off")
    runs = [(p, a, t) for p in args.files for a in (both if args.amx == "both" else (args.amx,))
            for t in (both if args.amx_attention == "both" else (args.amx_attention,))]
    for path, amx, att in runs:
        cli = ["perplexity", "-m", path, "-f", TEXT, "--reference", "fp", "--ctx", str(args.ctx), "--max-windows",
               str(args.windows), "--threads", str(args.threads), "--json"]
        off = "from edgellm.kernels import gguf_ops; gguf_ops.AMX_GEMM = False; " if amx == "off" else ""
        off += "from edgellm.kernels import attention; attention.AMX_ATTENTION = False; " if att == "off" else ""
        cmd = [sys.executable, "-c", f"import sys; {off}from edgellm.cli import main; sys.exit(main({cli!r}))"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        r = json.loads(out)
        r["amx_kernel"], r["amx_attention"] = amx, att
        rows.append(r)
        print(f"{Path(path).name} (AMX kernel {amx}, attention {att}): KL {r['kl_mean']:.5f} (p99 {r['kl_p99']:.4f}), top-1 {100 * r['top1_agreement']:.1f}%, "
              f"ppl {r['perplexity']:.3f} vs fp {r['reference_perplexity']:.3f}, runs as {r.get('stored_formats')}",
              flush=True)
    if args.json:
        doc = {"command": " ".join(["python", "benchmarks/gguf_auto_kl.py", *sys.argv[1:]]),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
               "text": TEXT, "rows": rows}
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
