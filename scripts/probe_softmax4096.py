"""Softmax bf16 N=4096: bench_one as the first problem of a process, then the op timed several ways; with
`order`, the benchmark's order of problems (session 4 notes, item 6). Prints one JSON line."""
import sys, json, importlib
sys.path.insert(0, '.')
import torch
import benchmarks.softmax as b
import rtckern.ops as ops
sm = importlib.import_module("rtckern.ops.softmax")
copy = b.copy_gbps(torch, b.ELEMENTS, torch.bfloat16)
out = {"copy": round(copy)}
r = b.bench_one(torch, "softmax", "bf16", 4096, "none", {"bf16": copy, "fp16": copy, "fp32": copy})
out["bench_one"] = r["fwd_vs_copy"]
if "order" in sys.argv[1:]:  # the benchmark's order: N = 1024 first, then 4096 twice, then fp16 4096
    ref = {"bf16": copy, "fp16": copy, "fp32": copy}
    for dt, n in (("bf16", 1024), ("bf16", 4096), ("bf16", 4096), ("fp16", 4096), ("bf16", 4096)):
        torch.cuda.empty_cache()
        out[f"order_{dt}_{n}"] = out.get(f"order_{dt}_{n}", []) + [b.bench_one(torch, "softmax", dt, n, "none",
                                                                                ref)["fwd_vs_copy"]]
    print(json.dumps(out))
    sys.exit(0)
x = torch.randn(32768, 4096, device="cuda", dtype=torch.bfloat16)
nb = 2 * x.numel() * 2
for label, fn in (("pkg", lambda: ops.softmax(x, 0.125)), ("module", lambda: sm.softmax(x, 0.125)),
                  ("module_scale_float", lambda: sm.softmax(x, b.SCALE))):
    for inner in (1, 4, 8):
        ms = b.time_ms(torch, fn, inner=inner)
        out[f"{label}_inner{inner}"] = round(nb / ms / 1e6 / copy, 3)
print("ops.softmax is sm.softmax:", ops.softmax is sm.softmax, type(ops.softmax))
y = sm.softmax(x, 0.125)
for inner in (1, 4):
    ms = b.time_ms(torch, lambda: sm.softmax(x, 0.125), inner=inner)
    out[f"kept_y_inner{inner}"] = round(nb / ms / 1e6 / copy, 3)
xr = torch.randn(32768, 4096, device="cuda", dtype=torch.bfloat16) * 3
ms = b.time_ms(torch, lambda: sm.softmax(xr, 0.125))
out["x_times_3"] = round(nb / ms / 1e6 / copy, 3)
xs = torch.randn(32768, 4096, device="cuda", dtype=torch.bfloat16) * 0.01
ms = b.time_ms(torch, lambda: sm.softmax(xs, 0.125))
out["x_times_0.01"] = round(nb / ms / 1e6 / copy, 3)
print(json.dumps(out))
