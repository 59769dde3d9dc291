"""One launch each of the N = 65536 norm forwards that miss 0.90x copy, next to a variant without the weight /
bias reads, for a profiler (`ncu --set full -k regex:rtk_norm_fwd python3 scripts/profile_norms_long.py`):
  RMSNorm fp32, l2 (the shipped config), with and without its weight (0.86 vs 0.94x copy in
  probe_norm_operands_session6_*); LayerNorm bf16, l2 (shipped) and the persistent cluster config with the
  weight / bias in shared memory that serves fp16 (3470 vs 3632 GB/s for the same config in bf16 and fp16), and
  LayerNorm fp16 with that config. 2048 rows each (the benchmark's shape). With an argument DIR, also writes each
  kernel's cubin there (for cuobjdump -sass).

    PYTHONPATH=. ncu --set full -k regex:rtk_norm_fwd -o OUT/norms python3 scripts/profile_norms_long.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rtckern.arch import Arch  # noqa: E402
from rtckern.compiler import compiler_for  # noqa: E402
from rtckern.ops import _norms_kernels as K  # noqa: E402
from rtckern.ops import _norms_launch as L  # noqa: E402

DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
N, ROWS = 65536, 2048
CASES = [  # (name, layer, dtype, weight, bias, kind, config)
    ("rms_fp32_l2_w", False, "fp32", True, False, "l2", K.L2Config(512, 3, 0, 8, 4)),
    ("rms_fp32_l2_now", False, "fp32", False, False, "l2", K.L2Config(512, 3, 0, 8, 4)),
    ("layer_bf16_l2_wb", True, "bf16", True, True, "l2", K.L2Config(512, 3, 256, 8, 2)),
    ("layer_bf16_cluster_wb", True, "bf16", True, True, "cluster", K.SplitConfig(512, 2, 519)),
    ("layer_fp16_cluster_wb", True, "fp16", True, True, "cluster", K.SplitConfig(512, 2, 519)),
]


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    major, minor = torch.cuda.get_device_capability()
    arch = Arch(major, minor)
    stream = torch.cuda.current_stream().cuda_stream
    for name, layer, dtype, weight, bias, kind, cfg in CASES:
        p = K.FwdProblem(layer=layer, n=N, x=dtype, y=dtype, w=dtype if (weight or bias) else None,
                         has_weight=weight, bias=bias, vec=16 // K.ITEMSIZE[dtype])
        assert L.fwd_feasible(p, kind, cfg) is None, (name, L.fwd_feasible(p, kind, cfg))
        spec = L.fwd_spec(p, kind, cfg, arch)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{name}.cubin").write_bytes(compiler_for(arch).compile(spec).binary)
        kernel = L.load((spec,), torch.cuda.current_device())[0]
        x = torch.randn(ROWS, N, device="cuda", dtype=DT[dtype])
        w = torch.rand(N, device="cuda", dtype=DT[dtype]) + 0.5
        b = torch.randn(N, device="cuda", dtype=DT[dtype])
        y = torch.empty_like(x)
        L.launch_fwd(p, kind, cfg, kernel, L.FwdCall(
            x=x.data_ptr(), residual=0, h=0, w=w.data_ptr() if weight else 0, b=b.data_ptr() if bias else 0,
            y=y.data_ptr(), mean=0, rstd=0, eps=1e-5, rows=ROWS, sx=N, sr=N, sh=N, sy=N, stream=stream,
            zeros_u32=None, empty_f32=None))
        torch.cuda.synchronize()
        print(name, kind, cfg, kernel.num_regs, "registers", flush=True)


if __name__ == "__main__":
    main()
