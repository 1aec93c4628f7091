"""The GPU bench scripts' output (bench/gpu_decode_gluon_w.py, gpu_decode_stamps.py): one JSON
line a row, printed and appended to a file, the first row the command and the machine."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def emit(out: Path, row: dict) -> None:
    print(json.dumps(row), flush=True)
    with out.open("a") as fh:
        fh.write(json.dumps(row) + "\n")


def start(out: Path, script: str, argv: list[str] | None) -> bool:
    """The command and machine row written to ``out``; False, with one line on stderr, where
    there is no CUDA GPU to run ``script`` on."""
    import torch
    from kdash.kernels import bench
    from kdash.kernels._common import ensure_allocator

    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU", file=sys.stderr)
        return False
    ensure_allocator()
    args = " ".join(argv if argv is not None else sys.argv[1:])
    emit(out, {"command": f"python bench/{script} {args}".rstrip(), "machine": bench.machine()})
    return True
