"""Registry candidates of the attention op, in priority order:

  attention.sm90a_ws      sm_90 only (arch-specific sm_90a cubin): warp-specialized FlashAttention-3 structure:
                          a TMA producer warpgroup, mbarrier rings, consumer warpgroups on wgmma with the
                          softmax of tile n under the P V product of tile n-1 (ping-pong for causal hd128);
                          head dims 64, 128, 256
  attention.sm90a_wgmma   sm_90 only: the same math without warp specialization (cp.async by every thread, a
                          block barrier per tile); kept as the next choice (it needs no tensor maps)
  attention.sm80_mma      sm_80 and newer: mma.sync m16n8k16 + ldmatrix + cp.async ring (FlashAttention-2 class);
                          head dims 32, 64, 96, 128, 256
  attention.simt          sm_75 and newer: fp32 FMA tiles, the fallback for GPUs without bf16 tensor cores

A request carries what decides compilation and feasibility: dtype, head dim, causal. Sequence lengths, batch,
heads and strides are run-time arguments of every kernel (no recompile per shape). Tile configs come from the
tuning table `attention` (rtckern/tuning_tables/attention.json, keyed by arch and SM count; `rtckern tune
attention` adds rows) and, where no row fits, from the per-head-dim defaults in configs.py.
"""
from __future__ import annotations

from typing import Any

from rtckern import tuning
from rtckern.caches import PlanCache
from rtckern.device import DeviceInfo
from rtckern.registry import Candidate, LimitProbe, OpRequest, Resources, register, register_request_builder
from rtckern.registry import options as opts
from rtckern.registry.core_api import target_for
from rtckern.spec import KernelSpec

from . import configs
from .launch import kernel_args, launch_ws

OP = "attention"
# A neighbour's tuned row serves only the same head dim (shared memory and registers scale with it) and causal flag.
EXACT_FIELDS = ("head_dim", "causal")
_tiles = PlanCache("attention.tiles")  # (candidate name, request) -> its tile config


def request(dtype: str, head_dim: int, causal: bool, device: DeviceInfo) -> OpRequest:
    return OpRequest(op=OP, dtypes={"qkv": dtype}, shape={"head_dim": int(head_dim)}, flags={"causal": bool(causal)},
                     device=device)


class _AttentionCandidate(Candidate):
    op = OP
    vendors = ("nvidia",)
    head_dims: tuple[int, ...] = configs.HEAD_DIMS
    source = ""
    kernel = ""

    # -- what each family decides -------------------------------------------------------------------------------
    def default_tile(self, head_dim: int, causal: bool, device: DeviceInfo):
        raise NotImplementedError

    def tile_from_config(self, config) -> Any:
        raise NotImplementedError

    def tile(self, req: OpRequest):
        """The tile config for req: the tuning table's row for this candidate (exact or nearest), else the
        default. Memoized per request: the launch path reads it on every call."""
        t = _tiles.get((self.name, req))
        if t is None:
            key = {"impl": self.name, "dtype": req.dtype("qkv"), "head_dim": req.dim("head_dim"),
                   "causal": int(req.flag("causal"))}
            found = tuning.lookup(OP, req.device, key, exact=EXACT_FIELDS) if _has_table() else None
            t = self.tile_from_config(found.config) if found is not None else None
            if t is None:
                t = self.default_tile(req.dim("head_dim"), req.flag("causal"), req.device)
            _tiles.put((self.name, req), t)
        return t

    # -- Candidate API --------------------------------------------------------------------------------------------
    def supports(self, req: OpRequest) -> str | None:
        return configs.qkv_reason(req, self.head_dims)

    def kernel_specs(self, req: OpRequest) -> tuple[KernelSpec, ...]:
        return (self.tile_spec(req, self.tile(req)),)

    def kernel_head_dim(self, head_dim: int) -> int:
        """The head dim the kernel is compiled for: the arrays' own, unless the kernel pads it (RTK_ATTN_DV)."""
        return head_dim

    def tile_spec(self, req: OpRequest, tile) -> KernelSpec:
        """The kernel of `tile` for req (the tuner times tiles other than the chosen one)."""
        hd = req.dim("head_dim")
        kd = self.kernel_head_dim(hd)
        targs = tile.template_args(req.dtype("qkv"), kd, req.flag("causal"))
        defines = () if kd == hd else (("RTK_ATTN_DV", str(hd)),)
        return KernelSpec(self.source, self.kernel, target_for(req.device, self.arch_specific), template_args=targs,
                          defines=defines, op=OP)

    def launch_resources(self, req: OpRequest) -> tuple[Resources, ...]:
        tile = self.tile(req)
        return (Resources(block=tile.threads, dynamic_smem=tile.smem_bytes(self.kernel_head_dim(req.dim("head_dim")))),)

    def launch(self, req: OpRequest, kernels, q, k, v, o_ptr: int, lse_ptr: int, scale: float, stream) -> None:
        tile = self.tile(req)
        kernels[0].launch(tile.grid(q.shape[0], q.shape[2], q.shape[1]), tile.threads,
                          kernel_args(q, k, v, o_ptr, lse_ptr, scale), shared_mem=tile.smem_bytes(q.shape[3]),
                          stream=stream)


class _Sm90(_AttentionCandidate):
    """The wgmma kernels: sm_90a cubins (they run on sm_90 only), head dims of whole 64-element swizzle blocks."""

    min_arch = "sm_90"
    max_arch = "sm_90"
    arch_specific = True
    head_dims = configs.SM90_HEAD_DIMS


class Sm90Wgmma(_Sm90):
    name = "attention.sm90a_wgmma"
    priority = 300
    source = configs.SM90_SOURCE
    kernel = configs.SM90_KERNEL

    def default_tile(self, head_dim, causal, device):
        return configs.SM90_TILES[head_dim]

    def tile_from_config(self, c):
        return configs.Sm90Tile(int(c["bn"]), int(c.get("nwg", 2))) if "nwg" in c else None


class Sm90Ws(_Sm90):
    """The warp-specialized TMA kernel. K and V go in as tensor maps, so it launches through cuLaunchKernel."""

    name = "attention.sm90a_ws"
    priority = 350
    source = configs.SM90_WS_SOURCE
    kernel = configs.SM90_WS_KERNEL

    head_dims = configs.SM90_WS_HEAD_DIMS

    def kernel_head_dim(self, head_dim: int) -> int:
        return configs.ws_kernel_dim(head_dim)

    def default_tile(self, head_dim, causal, device):
        return configs.SM90_WS_TILES[(self.kernel_head_dim(head_dim), bool(causal))]

    def tile_from_config(self, c):
        return configs.Sm90WsTile(int(c["bn"]), int(c.get("nwg", 2)), int(c.get("ks", 2)), int(c.get("vs", 2)),
                                  bool(c.get("pingpong", False))) if "ks" in c else None

    def launch(self, req: OpRequest, kernels, q, k, v, o_ptr: int, lse_ptr: int, scale: float, stream) -> None:
        launch_ws(kernels[0], self.tile(req), req.dtype("qkv"), q, k, v, o_ptr, lse_ptr, scale, stream)


class Sm80Mma(_AttentionCandidate):
    name = "attention.sm80_mma"
    priority = 200
    min_arch = "sm_80"
    source = configs.SM80_SOURCE
    kernel = configs.SM80_KERNEL

    def default_tile(self, head_dim, causal, device):
        tiles = configs.SM80_TILES[(head_dim, bool(causal))]
        # None fits: keep the first, so the registry's resource check rejects it with the numbers.
        return configs.pick_tile(tiles, head_dim, device.max_smem_per_block_optin) or tiles[0]

    def tile_from_config(self, c):
        if "warps" not in c:
            return None
        return configs.Sm80Tile(int(c["bm"]), int(c["bn"]), int(c["warps"]), int(c.get("stages", 2)),
                                bool(c.get("q_in_regs", False)))


class Simt(_AttentionCandidate):
    name = "attention.simt"
    vendors = ("nvidia", "amd")  # the portable path; the mma/wgmma ones are NVIDIA-only
    priority = 100
    min_arch = "sm_75"
    source = configs.SIMT_SOURCE
    kernel = configs.SIMT_KERNEL

    def default_tile(self, head_dim, causal, device):
        return configs.SIMT_TILE

    def tile_from_config(self, c):
        return None


def _has_table() -> bool:
    return tuning.shipped_table_path(OP).is_file() or tuning.user_table_path(OP).is_file()


def head_dim_of(op: str, shape: tuple[int, ...], full: str) -> int:
    """The head dim of a request builder's shape: the head dim alone, or q's full shape `full` (as "BxSxHxD",
    whose rank it must have); OptionError naming what was given otherwise (another rank's last entry is no head
    dim)."""
    if len(shape) not in (1, full.count("x") + 1):
        raise opts.OptionError(f"{op}: shape {'x'.join(map(str, shape))} has {len(shape)} dims; give the head dim "
                               f"(e.g. 128) or q's shape {full}")
    return int(shape[-1])


def _build_request(shape: tuple[int, ...], dtype: str | None, device: DeviceInfo, **options: str) -> OpRequest:
    """For `rtckern explain/tune/selftest attention`: shape is the head dim, or q's (batch, seqlen, heads, head_dim)
    (kept in the request: the tuner times that shape); option causal=0/1."""
    hd = head_dim_of(OP, shape, "BxSxHxD")
    opts.check_keys(OP, options, ("causal",))
    causal = opts.flag(OP, options, "causal", False)
    req = request(dtype or "bf16", hd, causal, device)
    if len(shape) == 4:  # q's full shape: kept for the tuner's timing (kernels are compiled per head dim only)
        b, s, h, _ = shape
        req = OpRequest(op=OP, dtypes=dict(req.dtypes), shape={"head_dim": int(hd), "batch": int(b), "seqlen": int(s),
                                                                "heads": int(h)}, flags=dict(req.flags), device=device)
    return req


CANDIDATES = (Sm90Ws(), Sm90Wgmma(), Sm80Mma(), Simt())


# The head dims `rtckern ops` lists for every attention op: a bare head dim is a request shape of its own.
HEAD_DIM_LIMITS = LimitProbe("head_dim", configs.HEAD_DIM_SAMPLES)


def registrar(candidates, op: str, builder, help: str, example: str):
    """The register_all() of an attention op: registers its candidates and request builder on the first call."""
    done = []

    def register_all() -> None:
        if done:
            return
        for c in candidates:
            register(c)
        register_request_builder(op, builder, help=help, example=example, limits=HEAD_DIM_LIMITS)
        done.append(True)

    return register_all


register_all = registrar(CANDIDATES, OP, _build_request, help="shape: head_dim, or q's BxSxHxD; --opt causal=0/1",
                         example="--dtype bf16 --shape 4x4096x16x128 --opt causal=1")
