"""Several ranks starting cold on one cache directory (run under torchrun, one rank per GPU).

    RTCKERN_CACHE_DIR=/tmp/shared torchrun --nproc_per_node=2 benchmarks/multi_gpu.py

Each rank records every compile/cache event, checks its outputs against torch, and the time from process
start to first correct output. Rank 0 checks that every kernel key was compiled exactly once across ranks and
writes multi_gpu.json / multi_gpu.md."""

from __future__ import annotations

import json
import os
import time

T_START = time.perf_counter()


def main() -> None:
    import torch
    import torch.distributed as dist

    import rtckern.ops as ops
    from rtckern import events

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")  # a CPU barrier is all this needs (no NCCL)
    torch.cuda.set_device(rank)
    seen = []
    events.add_listener(lambda e: seen.append((e.key, e.source, round(e.ms, 2), e.spec.name)))
    dev = f"cuda:{rank}"
    torch.manual_seed(rank)
    dist.barrier()
    t0 = time.perf_counter()
    x = torch.randn(1024, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    a = torch.randn(1024, 2048, device=dev, dtype=torch.bfloat16)
    b = torch.randn(2048, 1024, device=dev, dtype=torch.bfloat16)
    q = torch.randn(2, 1024, 16, 128, device=dev, dtype=torch.bfloat16)
    s = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16)

    def rel(u, r):
        return ((u.double() - r.double()).norm() / r.double().norm()).item()

    errs = {
        "rms_norm": rel(ops.rms_norm(x, w), torch.nn.functional.rms_norm(x.float(), (4096,), w.float(), eps=1e-6)),
        "softmax": rel(ops.softmax(s), torch.softmax(s.float(), -1)),
        "gemm": rel(ops.gemm(a, b), a.float() @ b.float()),
        "attention": rel(ops.attention(q, q, q, causal=True),
                         torch.nn.functional.scaled_dot_product_attention(
                             q.transpose(1, 2).float(), q.transpose(1, 2).float(), q.transpose(1, 2).float(),
                             is_causal=True).transpose(1, 2)),
    }
    torch.cuda.synchronize()
    first_output_s = time.perf_counter() - t0
    mine = {"rank": rank, "device": torch.cuda.get_device_name(rank), "errors": errs,
            "ok": all(v < 2e-2 for v in errs.values()), "first_output_s": round(first_output_s, 3),
            "since_start_s": round(time.perf_counter() - T_START, 3),
            "compiles": [k for k, src, _, _ in seen if src == "compile"],
            "events": seen}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        from collections import Counter

        import benchmarks.env as benv

        counts = Counter(k for g in gathered for k in g["compiles"])
        result = {"env": benv.environment(), "world": world, "ranks": gathered,
                  "keys_compiled": len(counts), "max_compiles_per_key": max(counts.values()) if counts else 0,
                  "every_key_compiled_once": all(c == 1 for c in counts.values()),
                  "all_ranks_correct": all(g["ok"] for g in gathered)}
        rows = [[g["rank"], g["device"], g["first_output_s"], len(g["compiles"]),
                 sum(1 for e in g["events"] if e[1] != "compile"), g["ok"],
                 " ".join(f"{k}={v:.1e}" for k, v in g["errors"].items())] for g in gathered]
        md = (f"# Multi-GPU cold start: {world} ranks, one cache directory\n\n{result['env']['date']}; "
              f"{result['env'].get('nvidia_smi')}; torch {result['env']['packages'].get('torch')}\n\n"
              + benv.md_table(["rank", "GPU", "time to first output (s)", "compiled", "cache hits", "correct",
                               "rel. errors"], rows)
              + f"\nKeys compiled: {result['keys_compiled']}; most compiles of one key across ranks: "
                f"{result['max_compiles_per_key']} (every key once: {result['every_key_compiled_once']}); "
                f"all ranks correct: {result['all_ranks_correct']}\n")
        benv.write("multi_gpu", result, md)
        print(md)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
