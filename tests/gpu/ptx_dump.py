"""Offline (no GPU): the PTX of every Gluon kernel configuration that tests/test_kernels_compile.py
compiles for sm_90a, as JSON, without debug lines; compare two dumps to show that a refactor of a
kernel leaves the generated code unchanged.

    python tests/gpu/ptx_dump.py BEFORE.json            # on the old checkout
    python tests/gpu/ptx_dump.py AFTER.json             # on the new one
    python tests/gpu/ptx_dump.py --compare BEFORE.json AFTER.json

Labels of inlined-function debug scopes (``$L__tmpN:``) are ignored in the comparison. On
2026-11-30 (Triton 3.6) this showed the shared helpers of ``kernels.gluon_bitdelta`` (``_plus_delta``,
``_neg_alpha_bits``, ``_k_chunk``) left all 45 Gluon kernels' PTX unchanged.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def dump(out: str) -> None:
    src = (ROOT / "tests" / "test_kernels_compile.py").read_text()
    child = src[src.index("CHILD = r'''") + len("CHILD = r'''"):]
    child = child[:child.index("'''")]
    gluon = child[child.index("from kernels import gluon_bitdelta as gb"):]  # only the Gluon kernels
    gluon = gluon.replace('{"shared": k.metadata.shared,', '{"ptx": k.asm["ptx"], "shared": k.metadata.shared,')
    head = "import inspect, json, sys\nimport triton\nfrom triton.backends.compiler import GPUTarget\nout = {}\n"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-c", head + gluon], cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    ptx = {k: _clean(v["ptx"]) for k, v in json.loads(r.stdout).items() if "ptx" in v}
    Path(out).write_text(json.dumps(ptx))
    print(f"{len(ptx)} kernels -> {out}")


def _clean(ptx: str) -> str:
    lines = [ln for ln in ptx.splitlines() if not ln.strip().startswith((".loc", ".file", "//"))
             and not re.match(r"^\$L__tmp\d+:$", ln.strip())]
    text = "\n".join(lines)
    return text[:text.find(".section\t.debug")] if ".section\t.debug" in text else text


def compare(a: str, b: str) -> int:
    before, after = json.loads(Path(a).read_text()), json.loads(Path(b).read_text())
    differ = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    print(f"{len(before)} / {len(after)} kernels, {len(differ)} differ", *differ, sep="\n")
    return 1 if differ else 0


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        raise SystemExit(compare(sys.argv[2], sys.argv[3]))
    dump(sys.argv[1])
