"""A forward norm config timed the way the benchmark times the op (the public op, outputs allocated per call) and
the way the sweep times it (a direct launch into fixed buffers), each config in a fresh process with a one-row
user tuning table that pins it: for shapes where the sweep's winner and the benchmark disagree. Prints one JSON line
per (shape, config).

    PYTHONPATH=. python3 scripts/probe_norm_configs.py
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBES = {  # (op, dtype, n): [(kind, config)]
    ("layer", "bf16", 16384): [("l2", {"threads": 256, "minb": 4, "opt": 256, "stash": 8}),
                               ("l2", {"threads": 256, "minb": 4, "opt": 256}),
                               ("l2", {"threads": 512, "minb": 4, "opt": 256, "stash": 4}),
                               ("l2", {"threads": 256, "minb": 1, "opt": 256}),
                               ("l2", {"threads": 512, "minb": 2, "opt": 2}),
                               ("l2", {"threads": 512, "minb": 2, "opt": 256})],
    ("layer", "fp16", 16384): [("l2", {"threads": 256, "minb": 4, "opt": 256, "stash": 8}),
                               ("l2", {"threads": 256, "minb": 4, "opt": 256}),
                               ("l2", {"threads": 256, "minb": 1, "opt": 256}),
                               ("l2", {"threads": 512, "minb": 2, "opt": 0}),
                               ("l2", {"threads": 512, "minb": 2, "opt": 256})],
    ("rms", "fp32", 16384): [("l2", {"threads": 1024, "minb": 1, "opt": 0}),
                             ("l2", {"threads": 1024, "minb": 1, "opt": 256}),
                             ("l2", {"threads": 512, "minb": 2, "opt": 256}),
                             ("l2", {"threads": 256, "minb": 4, "opt": 256}),
                             ("rows", {"tpr": 512, "rpb": 1, "opt": 2}),
                             ("l2", {"threads": 512, "minb": 1, "opt": 256, "stash": 4})],
}

CHILD = r'''
import json, sys
sys.path.insert(0, ".")
import torch
import benchmarks.norms as B
from rtckern.arch import Arch
from rtckern.ops import norms
from rtckern.ops import _norms_launch as L
op, dtype, n, kind, cfg = json.loads(sys.argv[1])
data = B.Data(torch, dtype, n)
p = B.fwd_problem(op, dtype, n)
nbytes = p.bytes_moved(data.rows)
a = torch.empty(data.x.numel(), device="cuda", dtype=data.x.dtype)
b2 = torch.empty_like(a)
copy = 2 * a.numel() * a.element_size() / B.timeit(lambda: b2.copy_(a), torch) / 1e9
del a, b2
torch.cuda.empty_cache()
if op == "rms":
    f = lambda: norms.rms_norm(data.x, data.w, B.EPS)
else:
    f = lambda: norms.layer_norm(data.x, data.w, data.b, B.EPS)
y = f()
ref = data.ref_fwd(torch, op, data.check_rows(torch))
err = B._rel(torch, y[data.check_rows(torch)], ref)
op_gbps = nbytes / B.timeit(f, torch) / 1e9
c = L._cfg_from_json(kind, cfg)
item = ("fwd", op, dtype, n, kind, c)
kernels = L.load(B.specs_of(item, Arch.parse("sm_90")), 0)
fn = B.run_item(torch, data, item, kernels)
direct = nbytes / B.timeit(fn, torch) / 1e9
print(json.dumps({"op": op, "dtype": dtype, "n": n, "kind": kind, "config": cfg, "copy": round(copy),
                  "op_gbps": round(op_gbps), "direct_gbps": round(direct), "err": err}))
'''


def main() -> None:
    for (op, dtype, n), cfgs in PROBES.items():
        for kind, cfg in cfgs:
            with tempfile.TemporaryDirectory() as tdir:
                shape = {"kind": kind, "norm": op, "dtype": dtype, "n": n, "vec": 16 // {"bf16": 2, "fp16": 2,
                                                                                          "fp32": 4}[dtype]}
                rows = [{"arch": "sm_90", "sm_count": 132, "shape": shape, "config": cfg}]
                (Path(tdir) / "norm_fwd.json").write_text(json.dumps(
                    {"format": 1, "op": "norm_fwd", "key_fields": ["kind", "norm", "dtype", "n", "vec"], "rows": rows}))
                (Path(tdir) / "norm_kind.json").write_text(json.dumps(
                    {"format": 1, "op": "norm_kind", "key_fields": ["dir", "norm", "dtype", "n"],
                     "rows": [{"arch": "sm_90", "sm_count": 132,
                               "shape": {"dir": "fwd", "norm": op, "dtype": dtype, "n": n},
                               "config": {"kind": kind}}]}))
                env = {**os.environ, "RTCKERN_TUNING_DIR": tdir}
                r = subprocess.run([sys.executable, "-c", CHILD, json.dumps([op, dtype, n, kind, cfg])], cwd=ROOT,
                                   env=env, capture_output=True, text=True, timeout=120)
                line = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
                print(line[-1] if line else json.dumps({"op": op, "dtype": dtype, "n": n, "config": cfg,
                                                        "error": r.stderr[-400:]}), flush=True)


if __name__ == "__main__":
    main()
