"""benchmarks/plugin.py's parts on the CPU: option parsing, the packed and padded batches (lengths, alignment of
their tokens and targets, equal losses through a transformers Llama), patch variants, the static-cache decode loop
(eager; graphs need CUDA) and the report, with a tiny Llama where every rtckern op falls back to torch."""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the benchmarks package lives beside rtckern, not inside it
    sys.path.insert(0, str(ROOT))

from benchmarks import _plugin_graphs as G  # noqa: E402
from benchmarks import _plugin_training as T  # noqa: E402
from benchmarks import plugin as P  # noqa: E402
from benchmarks import runner  # noqa: E402


@pytest.fixture(autouse=True)
def quiet_fallbacks():
    with warnings.catch_warnings():  # on the CPU every rtckern op falls back to torch, with a warning
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def test_options_parse_and_bad_parts_are_refused():
    ap = runner.make_parser("plugin", P)
    args = ap.parse_args(["--quick", "--parts", "train,graphs", "--runs", "2", "--cpu"])
    assert args.quick and args.runs == 2 and args.cpu and not P.needs_gpu(args)
    assert P.parse_parts(args.parts) == ("train", "graphs")
    assert P.needs_gpu(ap.parse_args([]))
    with pytest.raises(SystemExit, match=r"unknown \['bogus'\]; pick from overhead, decode"):
        P.parse_parts("train,bogus")


@pytest.mark.parametrize("seed", range(8))
def test_packed_lengths_are_in_range_and_sum_to_the_total(seed):
    lengths = T.packed_lengths(T.PACKED_TOKENS, *T.LENGTHS, seed=seed)
    assert sum(lengths) == T.PACKED_TOKENS and len(lengths) >= 3
    assert all(T.LENGTHS[0] <= n <= T.LENGTHS[1] for n in lengths)
    assert T.packed_lengths(300, 256, 1792) == [300]
    with pytest.raises(ValueError, match="no lengths in"):
        T.packed_lengths(100, 256, 1792)


def test_packed_and_padded_batches_line_up():
    lengths = [5, 3, 7]
    b = T.packed_and_padded(lengths, vocab=50, device="cpu")
    packed, padded = b["packed"], b["padded"]
    assert packed.kwargs["input_ids"].shape == (1, 15) and padded.kwargs["input_ids"].shape == (3, 7)
    assert packed.kwargs["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6]]
    assert padded.kwargs["attention_mask"].sum(1).tolist() == lengths
    # the real tokens, in order, are the packed tokens; the targets are the same next tokens
    flat = padded.kwargs["input_ids"].reshape(-1)
    assert torch.equal(flat[padded.real], packed.kwargs["input_ids"][0])
    assert torch.equal(packed.targets, padded.targets) and len(packed.targets) == 15 - 3
    assert packed.tokens == padded.tokens == 15


def _tiny(**kw):
    pytest.importorskip("transformers")
    return T.build_llama("cpu", dtype=torch.float32, **{**P.TINY, **kw})


def test_packed_loss_equals_padded_loss_and_dense_loss_is_the_suites():
    model = _tiny()
    b = T.packed_and_padded(T.packed_lengths(96, 8, 40), model.config.vocab_size, "cpu")
    with torch.no_grad():
        (lp, loss_packed), (ld, loss_padded) = (T.forward_loss(model, b[k]) for k in ("packed", "padded"))
        assert abs(loss_packed.item() - loss_padded.item()) < 1e-5
        assert torch.allclose(lp[0], ld.flatten(0, 1)[b["padded"].real], atol=1e-4)
        ids = torch.randint(0, model.config.vocab_size, (2, 16))
        dense = T.dense_batch(ids)
        logits, loss = T.forward_loss(model, dense)
        assert torch.allclose(loss, P._loss(model, ids))
        want = torch.nn.functional.cross_entropy(logits.flatten(0, 1)[dense.pred], dense.targets)
        assert torch.allclose(loss, want)  # the model's loss is the mean over the batch's predictions
        padded = b["padded"]
        want = torch.nn.functional.cross_entropy(ld.flatten(0, 1)[padded.pred], padded.targets)
        assert torch.allclose(loss_padded, want)


def test_training_point_and_report_on_a_tiny_llama():
    pytest.importorskip("transformers")
    tr = T.run_training_point(runs=2, reps=1, device="cpu", seq=32, packed_tokens=64, lengths=(8, 40), **P.TINY)
    assert set(tr["speed"]) == set(T.VARIANTS) and all(len(s["speedups"]) == 2 for s in tr["speed"].values())
    only = {"norms": False, "attention": False, "rope": False, "mlp": False, "loss": False}
    assert tr["variants"]["attention"] == {"patch": {**only, "attention": True}, "norms_replaced": 0,
                                           "rope_modules": 0, "mlp_modules": 0, "loss": False, "attention": "rtckern"}
    assert tr["variants"]["norms"]["norms_replaced"] == 5 and tr["variants"]["norms"]["attention"] == "sdpa"
    assert tr["variants"]["rope"]["rope_modules"] == 2 and tr["variants"]["mlp"]["mlp_modules"] == 2
    assert tr["variants"]["loss"]["loss"] and tr["variants"]["full"]["loss"]
    assert tr["served"]["norms"].startswith("falls back: UnsupportedRequestError") and "on cpu" in tr["served"]["norms"]
    assert not any(tr["accuracy_failures"].values())
    pk = tr["packed"]
    assert pk["tokens"] == 64 and not pk["accuracy_failures"]
    assert set(pk["fwd_bwd_ms"]) == {name for name, _, _ in T.PACKED_CONFIGS}
    res = {"train": tr, "e2e": {}, "parts": ["train", "packed"]}
    md = "\n".join(part.markdown() if isinstance(part, runner.Table) else str(part) for part in P._body(res))
    assert "## training step: Llama 2 layers" in md
    assert "| full | patch(): 5 norms, attention=rtckern, rope in 2 modules, swiglu in 2 MLPs, loss=rtckern |" in md
    assert "packed vs padded: 64 tokens" in md and "accuracy failures: none" in md
    assert [r["part"] for r in P._rows(res)] == ["train"] * len(T.VARIANTS) + ["packed"] * 4
    assert not P._failures(res)
    assert not any("gpu_ms" in s for s in tr["speed"].values())  # GPU time per step is measured on a GPU only


def test_train_report_has_gpu_time_per_step_where_measured():
    run = {"torch_ms": 24.0, "patched_ms": 21.0}
    tr = {"config": {"num_hidden_layers": 4, "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 4,
                     "batch": 2, "seq": 2048},
          "variants": {"none": {"norms_replaced": 0, "attention": "sdpa"},
                       "full": {"patch": {}, "norms_replaced": 9, "attention": "rtckern"}},
          "speed": {"none": {"runs": [run], "speedups": [1.0], "median_speedup": 1.0},
                    "full": {"runs": [run], "speedups": [1.143], "median_speedup": 1.143,
                             "gpu_ms": {"torch": 20.07, "patched": 16.17, "speedup": 20.07 / 16.17}}},
          "accuracy": {}, "accuracy_failures": {}}
    md = "\n".join(part.markdown() if isinstance(part, runner.Table) else str(part) for part in P._train_body(tr))
    gpu = md.split("GPU time per step")[1]
    assert "| full | 20.07 | 16.17 | 1.241x |" in gpu and "| none |" not in gpu
    del tr["speed"]["full"]["gpu_ms"]  # a CPU run: no GPU table
    md = "\n".join(part.markdown() if isinstance(part, runner.Table) else str(part) for part in P._train_body(tr))
    assert "GPU time per step" not in md and "| full | patch(): 9 norms, attention=rtckern |" in md


def test_static_decode_eager_on_the_cpu():
    import rtckern.torch as rt

    ref = _tiny().eval()
    patched = T.make_variants(ref, {"full": {}})[0]["full"].eval()
    assert isinstance(patched.model.norm, rt.RMSNorm)
    g = G.static_decode({"torch": ref, "rtckern": patched}, prompt=8, steps=4, reps=1, device="cpu",
                        reference=copy.deepcopy(ref).double())
    assert g["config"]["max_cache_len"] == 8 + 4 + G.WARMUP_STEPS + 1
    t, r = g["models"]["torch"], g["models"]["rtckern"]
    assert t["served"] == "torch (unpatched)" and r["served"].startswith("prefill: falls back")
    assert t["eager_ms"] > 0 and t["graph_ms"] is None and t["graph_error"] == "not captured (no CUDA)"
    assert r["eager_tokens_agree_with_first"] == "4/4"  # fp32, the same ops on the CPU
    for m in (t, r):  # teacher-forced against the float64 model: fp32 logits, every top-1 the same
        f = m["forced"]
        assert f["steps"] == 4 and f["top1"] == 4 and 0 < f["err_median"] <= f["err_max"] < 1e-4, f
    md = "\n".join(str(p.markdown() if isinstance(p, runner.Table) else p) for p in P._graphs_body(g))
    assert "decode on a StaticCache" in md and "CUDA graph None" not in md
    assert "| teacher-forced top-1 == fp32 |" in md and f"| 4/4 | {r['forced']['err_median']:.2e} / " in md
