"""benchmarks/bench_generate.py and the generate() instrumentation it takes from
benchmarks/common.py: the profile of a decode step is read right from a trace (host time
less waits, kernels inside graphs, launches), generate()'s compiled decode is detected, the
memory estimate matches a measured peak, speedups find their baseline, and the CPU smoke
run produces every configuration's rows. No timing is asserted."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import common  # noqa: E402

GIB = 2**30


def _x(name, cat, ts, dur, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "args": args}


def gpu_trace():
    """Two decode-step windows of 1000 and 1200 us: the first launches two kernels, one
    Triton kernel and one graph of two kernels, and waits 300 us in a synchronize; the
    second launches one kernel and one graph of three, and waits 100 us in a copy. The
    first is a compiled call (a 30 us guard check, then a 200 us compiled frame that calls
    another); in the second, the copy's wait is inside a 150 us compiled frame."""
    mark = common.STEP_MARK
    return [
        _x("aten::mm", "cpu_op", 50, 10),
        _x("cudaLaunchKernel", "cuda_runtime", 60, 5),  # before the first window: not counted
        _x("early", "kernel", 70, 40),
        _x(f"{mark}.5", "user_annotation", 100, 1000),
        _x("TorchDynamo Cache Lookup", "cpu_op", 105, 30),
        _x("Torch-Compiled Region: 0/0", "cpu_op", 140, 200),
        _x("Torch-Compiled Region: 1/0", "cpu_op", 150, 20),  # inside the first: not counted again
        _x("cudaLaunchKernel", "cuda_runtime", 110, 5),
        _x("cudaLaunchKernelExC", "cuda_runtime", 120, 5),
        _x("cuLaunchKernelEx", "cuda_driver", 130, 5),
        _x("cudaGraphLaunch", "cuda_runtime", 140, 20),
        _x("cudaStreamSynchronize", "cuda_runtime", 700, 300),
        _x("k1", "kernel", 150, 10), _x("k2", "kernel", 170, 20), _x("k3", "kernel", 200, 30),
        _x("g1", "kernel", 240, 40), _x("g2", "kernel", 290, 50),
        _x("memcpy", "gpu_memcpy", 400, 100),  # not a kernel
        _x(f"{mark}.6", "user_annotation", 1200, 1200),
        _x("cudaLaunchKernel", "cuda_runtime", 1210, 5),
        _x("cudaGraphLaunch_v10000", "cuda_runtime", 1220, 20),
        _x("Torch-Compiled Region: 0/0", "cpu_op", 1990, 150),
        _x("cudaMemcpyAsync", "cuda_runtime", 2000, 100),
        _x("k4", "kernel", 1250, 10),
        _x("g1", "kernel", 1270, 10), _x("g2", "kernel", 1290, 10), _x("g3", "kernel", 1310, 10),
        _x("other annotation", "user_annotation", 1300, 5),
        {"ph": "f", "name": "ac2g", "cat": "ac2g", "ts": 1250},
    ]


def test_step_profile_reads_a_gpu_trace():
    prof = common.step_profile(gpu_trace(), gpu=True)
    first, second = prof["per_step"]
    assert first == {"host_ms": 0.7, "guard_ms": 0.03, "frame_ms": 0.2, "gpu_ms": 0.15, "launches": 4,
                     "graph_launches": 1, "kernels": 5}
    assert second == {"host_ms": 1.1, "guard_ms": 0.0, "frame_ms": 0.05, "gpu_ms": 0.04, "launches": 2,
                      "graph_launches": 1, "kernels": 4}
    assert prof["steps"] == 2
    assert prof["host_ms"] == pytest.approx(0.9) and prof["gpu_ms"] == pytest.approx(0.095)
    assert (prof["launches"], prof["graph_launches"], prof["kernels"]) == (3, 1, 4.5)


def test_step_profile_without_a_gpu_and_without_windows():
    prof = common.step_profile(gpu_trace(), gpu=False)
    assert prof["host_ms"] == pytest.approx(0.9)
    assert prof["gpu_ms"] is prof["launches"] is prof["kernels"] is None
    with pytest.raises(ValueError, match="no generate.decode_step window"):
        common.step_profile([e for e in gpu_trace() if e["cat"] != "user_annotation"], gpu=True)


def tiny_dense_model():
    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

    cfg = MiniMaxM3VLTextConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, dense_intermediate_size=64, shared_intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rotary_dim=8,
        index_n_heads=2, index_head_dim=16, index_block_size=16, index_topk_blocks=4, num_local_experts=4,
        num_experts_per_tok=2, index_local_blocks=1, layer_types=["full_attention"], mlp_layer_types=["dense"],
        max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = MiniMaxM3VLForCausalLM(cfg).eval()
    model.set_attn_implementation("sdpa")
    return model


def generate_on_cpu(model, ids, new_tokens: int, compiled: bool, **kwargs) -> None:
    """Greedy generate() of ``new_tokens`` tokens with a static cache; with ``compiled`` its
    decode steps go through the compiled forward (a compile config that allows the CPU,
    transformers' own switch for tests, and the eager backend, so nothing is built), else
    ``disable_compile``."""
    from transformers import StaticCache
    from transformers.generation.configuration_utils import CompileConfig

    config = CompileConfig(backend="eager", mode=None)
    config._compile_all_devices = True
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + new_tokens)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, past_key_values=cache, compile_config=config,
                       disable_compile=not compiled, **kwargs)


def test_compiled_calls_sees_whether_generate_compiled():
    """generate() runs its 4 decode steps through the compiled forward; with disable_compile
    it runs none. The hook is gone afterwards."""
    model = tiny_dense_model()
    ids = torch.randint(3, 64, (1, 20), generator=torch.Generator().manual_seed(1))
    counts = []
    for compiled in (True, False):
        with common.CompiledCalls(model) as watch:
            generate_on_cpu(model, ids, 5, compiled)
        counts.append(watch.calls)
        assert "get_compiled_call" not in vars(model)
    assert counts == [4, 0]


def test_step_profile_splits_a_compiled_steps_host_time():
    """On the CPU, with the trace torch writes: a decode step through generate()'s compiled
    forward (the eager backend) shows a guard check and a compiled frame inside its host time;
    an eager step shows neither. Fails if torch renames the events the split reads."""
    from transformers import LogitsProcessorList

    model = tiny_dense_model()
    ids = torch.randint(3, 64, (1, 20), generator=torch.Generator().manual_seed(3))
    profiles = []
    for compiled in (True, False):
        profiler = common.StepProfiler(ids.shape[1], 7, 2, torch.device("cpu"))
        generate_on_cpu(model, ids, 7, compiled, logits_processor=LogitsProcessorList([profiler]))
        profiles.append(profiler.summary())
    compiled, eager = profiles
    for step in compiled["per_step"]:
        assert 0 < step["guard_ms"] and 0 < step["frame_ms"]
        assert step["guard_ms"] + step["frame_ms"] < step["host_ms"]
    assert all(step["guard_ms"] == step["frame_ms"] == 0 for step in eager["per_step"])


def test_step_profiler_profiles_the_last_steps():
    """On the CPU: the profiled windows are the last decode steps of the call, one per step."""
    model = tiny_dense_model()
    ids = torch.randint(3, 64, (1, 20), generator=torch.Generator().manual_seed(2))
    from transformers import LogitsProcessorList

    profiler = common.StepProfiler(ids.shape[1], 7, 3, torch.device("cpu"))
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=7, min_new_tokens=7,
                       do_sample=False, logits_processor=LogitsProcessorList([profiler]))
    prof = profiler.summary()
    assert prof["steps"] == 3 and prof["host_ms"] > 0 and prof["gpu_ms"] is None
    with pytest.raises(ValueError, match="profile steps"):
        common.StepProfiler(20, 7, 6, torch.device("cpu"))


@pytest.fixture(scope="module")
def bg():
    import bench_generate

    return bench_generate


def test_memory_need_matches_a_measured_peak(bg):
    """The 3-layer model's dense twin at 512K peaked at 48.9 GiB, weights included
    (docs/perf-log/2026-11-29.md); the estimate must be close and not below it."""
    args = bg.parse_args(["--layers", "sfs", "--sizes", "512k", "--device", "cpu"])
    cfg = bg.text_config(args, bg.layer_types("sfs"))
    need = bg.memory_need(bg.CONFIGS["dense"], bg.Shape(1, 512 * 1024), cfg, args.new_tokens)
    assert 48 * GIB <= need["total"] <= 56 * GIB
    # transformers' sdpa path at 64K needs terabytes for its mask: skipped, never tried.
    sdpa = bg.memory_need(bg.CONFIGS["sdpa"], bg.Shape(1, 64 * 1024), cfg, 16)
    assert sdpa["total"] > 1000 * GIB


def test_fp8_caches_and_chunks_in_the_memory_need(bg):
    """A chunked prefill needs the transients of one chunk; e4m3 pages halve the K/V cache
    (index keys: one byte an element and a 4-byte scale). The 12-layer model at one million
    tokens fits an H200 only in chunks."""
    args = bg.parse_args(["--layers", "sssfsssfsssf", "--sizes", "1m", "--device", "cpu"])
    assert args.sizes == [bg.Shape(1, 1 << 20)]
    cfg = bg.text_config(args, bg.layer_types("sssfsssfsssf"))
    sparse, shape = bg.CONFIGS["m3_sparse"], args.sizes[0]
    whole = bg.memory_need(sparse, shape, cfg, 20)
    chunked = bg.memory_need(sparse, shape, cfg, 20, prefill_chunk=65536)
    assert chunked["prefill"] * 16 == whole["prefill"] and chunked["cache"] == whole["cache"]
    assert chunked["total"] < 64 * GIB < whole["total"]
    kv = bg.memory_need(sparse, shape, cfg, 20, prefill_chunk=65536, fp8="kv")
    both = bg.memory_need(sparse, shape, cfg, 20, prefill_chunk=65536, fp8="both")
    rows, layers, sparse_layers = shape.context + 20, 12, 9
    assert chunked["cache"] - kv["cache"] == rows * layers * 2 * 4 * 128
    assert kv["cache"] - both["cache"] == rows * sparse_layers * (128 - 4)
    # The dense twin's cache never changes with --fp8.
    dense = bg.CONFIGS["dense"]
    assert bg.memory_need(dense, shape, cfg, 20, fp8="both") == bg.memory_need(dense, shape, cfg, 20)


def test_fp8_flag_builds_the_cache_it_names(bg):
    import m3_hf_attention

    fp8 = torch.float8_e4m3fn
    model = None
    for flag, kv, index in (("both", fp8, fp8), ("kv", fp8, None), ("index", None, fp8)):
        args = bg.parse_args(["--quick", "--fp8", flag, "--page-size", "16"])
        model = model or bg.build_models(args, "sf", torch.float32)["sparse"]
        cache = bg.call_args(bg.CONFIGS["m3_sparse"], model, bg.Shape(1, 64), args)[m3_hf_attention.CACHE_KEYWORD]
        assert (cache.kv_cache_dtype, cache.index_key_dtype, cache.page_size) == (kv, index, 16)
    # Without --fp8 or --page-size, generate() builds its own cache.
    args = bg.parse_args(["--quick"])
    assert m3_hf_attention.CACHE_KEYWORD not in bg.call_args(bg.CONFIGS["m3_sparse"], model, bg.Shape(1, 64), args)


def test_arguments_are_checked(bg):
    args = bg.parse_args(["--quick"])
    assert (args.new_tokens, args.profile_steps, args.patterns) == (8, 2, ["sf"])
    assert args.configs == ["dense", "dense-eager", "m3_sparse", "m3_sparse-eager"]
    args = bg.parse_args(["--sizes", "8k,16x8k", "--layers", "sfs,ssf"])
    assert [(s.batch, s.context) for s in args.sizes] == [(1, 8192), (16, 8192)]
    assert args.patterns == ["sfs", "ssf"]
    assert args.step_pairs == 3
    for bad in (["--new-tokens", "7"], ["--configs", "dense,foo"], ["--layers", "sxs"], ["--profile-steps", "-1"],
                ["--step-pairs", "0"]):
        with pytest.raises(SystemExit):
            bg.parse_args(bad)
    assert bg.parse_args(["--new-tokens", "3", "--profile-steps", "0"]).new_tokens == 3


def test_checked_stop_puts_transformers_stop_check_back_for_the_cell(bg):
    from transformers.generation import utils as generation

    deferred = generation.DeferredStopCheck
    assert bg.CONFIGS["m3_sparse-checked"].checked_stop and not bg.CONFIGS["m3_sparse"].checked_stop
    with bg.checked_stop():
        assert generation.DeferredStopCheck is deferred.m3_sparse_base
        assert not generation.DeferredStopCheck.is_supported(torch.device("cuda"), None, True, is_assistant=False)
    assert generation.DeferredStopCheck is deferred


def test_the_no_module_guards_row_asks_for_the_filter_and_cuda_graphs(bg):
    """The row's compile config keeps generate()'s CUDA graphs and hands torch.compile the
    filter; every other row leaves generate() its default config."""
    args = bg.parse_args(["--quick"])
    shape = bg.Shape(1, 64)
    config = bg.call_args(bg.CONFIGS["m3_sparse-no-module-guards"], None, shape, args)["compile_config"]
    compile_kwargs = config.to_dict()
    assert compile_kwargs["mode"] is None and compile_kwargs["backend"] == "inductor"
    assert compile_kwargs["options"] == {"triton.cudagraphs": True,
                                         "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    for name in ("m3_sparse", "m3_sparse-checked", "m3_sparse-eager"):
        assert "compile_config" not in bg.call_args(bg.CONFIGS[name], None, shape, args)


def test_eager_chunked_prefill_runs_only_the_prefill_eagerly(bg):
    class Config:
        disable_compile = False

    class Model:
        def _prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs):
            seen.append(generation_config.disable_compile)
            return "out"

    seen, model, config = [], Model(), Config()
    with bg.eager_chunked_prefill(model):
        assert model._prefill("ids", config, {}) == "out"
        assert config.disable_compile is False  # the decode steps still compile
    assert seen == [True] and "_prefill" not in vars(model)
    model._prefill("ids", config, {})
    assert seen == [True, False]


def test_speedups_take_an_earlier_run_as_baseline(bg, tmp_path):
    args = bg.parse_args(["--quick", "--out", str(tmp_path)])
    dense = bg.Cell("sf", "dense", 2, 128, "2x128", status="ok", ttft_ms=10.0, decode_ms_per_step=4.0,
                    decode_tok_s=500.0)
    bg.result_rows(args, common.environment(), "cpu", [dense], {}).write()
    earlier = bg.load_baseline(str(tmp_path / "bench_generate.json"))
    sparse = bg.Cell("sf", "m3_sparse", 2, 128, "2x128", status="ok", ttft_ms=5.0, decode_ms_per_step=2.0,
                     decode_tok_s=1000.0)
    other = bg.Cell("sf", "m3_sparse", 1, 256, "256", status="ok", ttft_ms=5.0, decode_ms_per_step=2.0,
                    decode_tok_s=500.0)
    bg.fill_speedups([sparse, other], earlier)
    assert (sparse.prefill_speedup, sparse.decode_speedup) == (2.0, 2.0)
    assert other.prefill_speedup is None and other.decode_speedup is None


def run_quick(tmp_path, *extra, device="cpu"):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_generate.py"), "--quick", "--device", device,
         "--sizes", "2x128", "--out", str(out), *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "bench_generate.json").read_text())
    cells = {}
    for row in rows:
        cells.setdefault(row["metrics"]["config"], {})[row["metrics"]["phase"]] = row
    return cells, (out / "bench_generate.md").read_text(), proc.stdout


def test_quick_cpu_run(tmp_path):
    cells, md, stdout = run_quick(tmp_path, "--new-tokens", "6")
    assert set(cells) == {"dense", "dense-eager", "m3_sparse", "m3_sparse-eager"}
    for name, rows in cells.items():
        decode, ttft = rows["decode"]["metrics"], rows["ttft"]
        assert decode["status"] == "ok", (name, decode["note"])
        assert decode["mode"] == "eager"  # generate() compiles nothing on the CPU
        assert ttft["ms"] > 0 and rows["decode"]["ms"] > 0 and decode["host_ms"] > 0
        assert decode["details"]["profile"]["steps"] == 2
        assert decode["gpu_ms"] is None and decode["launches"] is None
        assert decode["guard_ms"] == decode["frame_ms"] == 0  # nothing compiled
        pairs = decode["details"]["decode_ms_pairs"]
        # The median pair (the synced step stands in where CPU noise made it <= 0).
        assert len(pairs) == 3
        if statistics.median(pairs) > 0:
            assert rows["decode"]["ms"] == pytest.approx(statistics.median(pairs))
    assert cells["dense"]["decode"]["metrics"]["speedup"] == 1.0
    assert cells["m3_sparse"]["ttft"]["baseline_ms"] == cells["dense"]["ttft"]["ms"]
    # The eager rows follow their twins at the same size: no warm-up call of their own.
    assert cells["dense-eager"]["decode"]["metrics"]["details"]["warmup_s"] is None
    assert cells["dense"]["decode"]["metrics"]["details"]["warmup_s"] > 0
    for column in ("decode mode", "host ms/step", "guards ms/step", "compiled frame ms/step", "GPU ms/step",
                   "launches/step", "kernels/step", "decode speedup"):
        assert f"| {column} |" in md
    assert "| sf | m3_sparse-eager | 2x128 | eager |" in stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_quick_run_on_gpu_counts_launches(tmp_path):
    """The toy shapes on the GPU: generate() compiles the dense twin's static-cache decode
    into CUDA graphs, which the profile shows as fewer launches than its eager row, with the
    graph's kernels counted; the m3_sparse row says which decode it got."""
    cells, _, _ = run_quick(tmp_path, "--new-tokens", "12", "--profile-steps", "3", device="cuda")
    m = {name: rows["decode"]["metrics"] for name, rows in cells.items()}
    for name, metrics in m.items():
        assert metrics["status"] == "ok", (name, metrics["note"])
        assert metrics["gpu_ms"] > 0 and metrics["kernels"] > 0 and metrics["launches"] > 0, name
    assert m["dense"]["mode"] == "graphs"
    assert m["dense"]["guard_ms"] > 0 and m["dense"]["frame_ms"] > 0  # its compiled call's host time
    # The kernels inside the graph are counted one by one: more kernels than launches.
    assert m["dense"]["kernels"] > m["dense"]["launches"]
    assert m["dense-eager"]["mode"] == m["m3_sparse-eager"]["mode"] == "eager"
    assert m["m3_sparse"]["mode"] in ("eager", "compiled", "graphs")
    assert m["dense"]["launches"] < m["dense-eager"]["launches"]


def test_save_model_writes_servable_checkpoints(tmp_path):
    """benchmarks/save_model.py: the M3-shaped model and its twin, each with the toy tokenizer
    of its vocabulary, load back with the same weights (the twin has no indexers)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cmd = [sys.executable, str(ROOT / "benchmarks" / "save_model.py"), "--quick", "--hidden", "64", "--mlp", "64",
           "--vocab", "512", "--dtype", "float32", "--max-len", "4096", "--layers", "sfs", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    m3 = AutoModelForCausalLM.from_pretrained(tmp_path / "m3-sfs")
    dense = AutoModelForCausalLM.from_pretrained(tmp_path / "dense-sfs")
    assert m3.config.layer_types == ["minimax_m3_sparse", "full_attention", "minimax_m3_sparse"]
    assert set(dense.config.layer_types) == {"full_attention"}
    twin = dense.state_dict()
    assert all(torch.equal(v, twin[k]) for k, v in m3.state_dict().items() if ".indexer." not in k)
    for name in ("m3-sfs", "dense-sfs"):
        tokenizer = AutoTokenizer.from_pretrained(tmp_path / name)
        assert len(tokenizer) == 512 and tokenizer.chat_template
        assert tokenizer.decode(tokenizer("Hello, M3")["input_ids"], skip_special_tokens=True) == "Hello, M3"
