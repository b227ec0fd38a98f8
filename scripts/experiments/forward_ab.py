"""kernels/attention/flash_attention_hopper.py's forward against other versions of that file, on a Hopper GPU: the
largest difference of their outputs and statistics on odd shapes and layouts (D = 64, one token, non-causal,
packed documents, batch rows apart, heads 256 apart), then all timed in turn over 7 rounds at 8k, 32k,
packed 16 x 4k, a batch of 16 x 4k and 131k (B = 1 unless a batch, 32/8 heads of 128, causal, bf16).

    python3 scripts/experiments/forward_ab.py [OTHER_VERSION.py ...]   # default: the file at git HEAD ("old")
    AB_CELL_MS=1000 python3 scripts/experiments/forward_ab.py        # cells of a second: the power limit's pace
    AB_METER=1 ...                                                # and each one's clock, power, TFLOP/J

Another revision's file: `git show REV:kernels/attention/flash_attention_hopper.py > /tmp/at_rev.py`. Versions are named
by their files' names, which must differ. What it measured: docs/PERFORMANCE.md, "Tried and not kept"."""
import contextlib
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from kernels.attention import flash_attention as fa, flash_attention_hopper as new
from kernels.attention.function import document_bounds
from scripts import gpu_clocks
from experiment_timing import time_in_turn  # this script's folder


def load(name: str, source: str):
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if len({Path(file).stem for file in sys.argv[1:]} | {"new"}) <= len(sys.argv[1:]):
    sys.exit(f"two versions by one name in {sys.argv[1:]} and the tree's ('new'): rename one (each is named by "
             "its file's name)")
others = ({Path(file).stem: load(Path(file).stem, Path(file).read_text()) for file in sys.argv[1:]} or
          {"old": load("old", subprocess.run(["git", "show", "HEAD:kernels/attention/flash_attention_hopper.py"],
                                             capture_output=True, text=True, check=True).stdout)})
fa.ensure_allocator(torch.device("cuda"))
g = torch.Generator(device="cuda").manual_seed(0)

def rnd(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

def docs(total, cuts):
    cu = torch.tensor([0, *cuts, total], dtype=torch.int32, device="cuda")
    return document_bounds(cu, total)

def check(label, q, k, v, bounds=(None, None), causal=True):
    scale = q.shape[-1] ** -0.5 * fa.LOG2E
    o2, l2 = new.attention_forward(q, k, v, *bounds, causal, scale)
    for name, other in others.items():
        o1, l1 = other.attention_forward(q, k, v, *bounds, causal, scale)
        torch.cuda.synchronize()
        print(f"{label:32s} {name:7s} out max diff {(o1.float() - o2.float()).abs().max().item():.3g} lse max diff "
              f"{(l1 - l2).abs().max().item():.3g} nan {bool(o2.isnan().any() or l2.isnan().any())}", flush=True)

check("B1 S1 2/1 D128", rnd(1, 1, 2, 128), rnd(1, 1, 1, 128), rnd(1, 1, 1, 128))
check("B2 S777 4/1 D64", rnd(2, 777, 4, 64), rnd(2, 777, 1, 64), rnd(2, 777, 1, 64))
check("B1 S1500 4/2 noncausal", rnd(1, 1500, 4, 128), rnd(1, 1500, 2, 128), rnd(1, 1500, 2, 128), causal=False)
check("B1 S4096 packed 5 docs", rnd(1, 4096, 8, 128), rnd(1, 4096, 2, 128), rnd(1, 4096, 2, 128),
      docs(4096, [1, 300, 301, 2500]))
check("B1 S4096 packed noncausal", rnd(1, 4096, 8, 128), rnd(1, 4096, 2, 128), rnd(1, 4096, 2, 128),
      docs(4096, [1000, 3001]), causal=False)
base, kb, vb = rnd(3, 1000, 4, 128), rnd(3, 1000, 2, 128), rnd(3, 1000, 2, 128)
check("B3 S777 rows apart (per-row launches)", base[:, :777], kb[:, :777], vb[:, :777])
wide, kw = rnd(2, 999, 4, 256), rnd(2, 999, 2, 256)
check("B2 S999 heads 256 apart", wide[..., :128], kw[..., :128], kw[..., 128:])
check("B16 S4096 32/8", rnd(16, 4096, 32, 128), rnd(16, 4096, 8, 128), rnd(16, 4096, 8, 128))

def flops(lengths, rows=1):
    return rows * sum(2.0 * n * n * 128 * 32 for n in lengths)

CELL_MS = float(os.environ.get("AB_CELL_MS", 100))
cases = {"8k": (1, [8192]), "32k": (1, [32768]), "packed-16x4k": (1, [4096] * 16), "batch-16x4k": (16, [4096]),
         "131k": (1, [131072])}
sampler = gpu_clocks.ClockSampler(gpu_clocks.current_gpu()) if os.environ.get("AB_METER") else None
with sampler or contextlib.nullcontext():
    for label, (rows, lengths) in cases.items():
        total = sum(lengths)
        q, k, v = rnd(rows, total, 32, 128), rnd(rows, total, 8, 128), rnd(rows, total, 8, 128)
        bounds = docs(total, torch.tensor(lengths).cumsum(0)[:-1].tolist()) if len(lengths) > 1 else (None, None)
        check(label, q, k, v, bounds)
        reps = max(1, int(CELL_MS / (flops(lengths, rows) / 5e11)))   # about CELL_MS a timing
        time_in_turn(label, {name: (lambda module=module: module.attention_forward(q, k, v, *bounds, True, 0.1))
                             for name, module in (*others.items(), ("new", new))}, flops(lengths, rows), 7, reps,
                     sampler)
        q = k = v = None  # free this size's tensors (closures above hold them)
