"""benchmarks/bench_serve.py's CPU smoke run: both configurations serve every request
through continuous batching, at once and at a rate, and every request's tokens equal its
own generate() (the script's check, which exits 1 on a mismatch); the JSON rows and the
markdown table hold each run's figures. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def quick_run(out: Path, *extra: str, quick: bool = True) -> list[dict]:
    """The script's --quick run (token check included), or with ``quick=False`` a run of the
    arguments given: its JSON rows."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=path)
    env.pop("TRITON_INTERPRET", None)  # the CPU dispatch runs the torch code: no kernels to interpret
    flags = ["--quick"] if quick else []
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_serve.py"), *flags, "--out", str(out),
                           *extra], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "bench_serve.json").read_text())


def import_bench_serve():
    """The script as a module, for its pure functions (it imports torch and transformers)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_serve

    return bench_serve


def test_quick_run_serves_and_checks_tokens(tmp_path):
    rows = quick_run(tmp_path)
    assert [(r["metrics"]["config"], r["sizes"]["rate"]) for r in rows] == [
        ("m3_sparse", 0.0), ("m3_sparse", 50.0), ("dense", 0.0), ("dense", 50.0)]
    for r in rows:
        m = r["metrics"]
        assert m["status"] == "ok" and m["checked"] and m["mismatched"] == [], m
        assert m["output_tokens"] == r["sizes"]["requests"] * r["sizes"]["new_tokens"]
        assert 0 < m["ttft_p50_ms"] <= m["ttft_p99_ms"] and 0 < m["itl_p50_ms"] <= m["itl_p99_ms"]
        q = m["itl_quantiles_ms"]
        assert list(q) == ["p10", "p25", "p50", "p75", "p90"] and q["p50"] == m["itl_p50_ms"], q
        assert 0 < q["p10"] <= q["p25"] <= q["p50"] <= q["p75"] <= q["p90"] <= m["itl_p99_ms"], q
        assert m["tok_s"] > 0 and r["ms"] == m["ttft_p50_ms"]
        # Every prompt token is prefilled once and every new token but the last is fed back:
        # the steps' query tokens add up to that (no padding on the CPU).
        steps, sizes = m["steps"], r["sizes"]
        assert steps["q_tokens"] == sizes["prompt_tokens"] + sizes["requests"] * (sizes["new_tokens"] - 1), steps
        # A request takes one step per new token; prefill chunks put more than one token in a step.
        assert steps["steps"] >= sizes["new_tokens"] and 0 <= steps["decode_steps"] < steps["steps"]
        assert steps["mixed_q_tokens_mean"] > 1
        assert min(steps[k] for k in ("prepare_ms", "generation_step_ms", "update_batch_ms")) > 0
        if steps["decode_host_ms_p50"] is not None:  # runs of decode-only steps (the fast path)
            # The wall time from one step's start to the next's covers the step's host time.
            assert 0 < steps["decode_host_ms_p50"] <= steps["decode_wall_ms_p50"], steps
    # The names the manager ran them under: paged|m3_sparse and paged|sdpa up to transformers 5.18.
    served = import_bench_serve().SERVING.compat.cb_attn_implementation
    assert [r["metrics"]["attn"] for r in rows] == [served("m3_sparse")] * 2 + [served("sdpa")] * 2
    sparse = [r for r in rows if r["metrics"]["config"] == "m3_sparse"]
    assert all(r["baseline_ms"] > 0 for r in sparse)
    assert all(set(r["metrics"]["speedup"]) == {"tok_s", "ttft_p50", "itl_p50"} for r in sparse)
    md = (tmp_path / "bench_serve.md").read_text()
    assert md.count("| sf | m3_sparse |") == 2 and md.count("| sf | dense |") == 2
    assert "every request against its own generate()" in md
    assert (tmp_path / "bench_serve.log").exists()


@pytest.mark.gpu
def test_quick_run_on_cuda(tmp_path):
    """The CUDA paths (warm-up, cuDNN-first SDPA for the twin, the peak memory) at toy shapes,
    fp32 so that the token check is exact."""
    rows = quick_run(tmp_path, "--device", "cuda", "--dtype", "float32")
    assert [r["metrics"]["status"] for r in rows] == ["ok"] * 4
    assert all(r["metrics"]["peak_gib"] > 0 and r["metrics"]["mismatched"] == [] for r in rows)


@pytest.mark.gpu
def test_m3_shapes_with_cuda_graphs(tmp_path):
    """M3's attention shapes (64 query heads, 4 KV heads, 128-dim heads, index blocks of 128,
    top-16) in bf16 under the manager's defaults, which for paged|m3_sparse capture CUDA graphs
    and take the decode fast path: prompts over several 128-token blocks and prefill chunks,
    every request within the bf16 tolerance of its own generate() (the script's check)."""
    rows = quick_run(tmp_path, "--device", "cuda", "--layers", "sfs", "--configs", "m3_sparse", "--requests", "6",
                     "--prompt-lens", "300-5000", "--new-tokens", "24", "--hidden", "256", "--vocab", "512",
                     "--max-batch-tokens", "2048", "--rates", "0", "--warmup", "short", "--check", quick=False)
    (row,) = rows
    m = row["metrics"]
    assert m["status"] == "ok" and m["failed"] == [] and m["check"]["tolerance"] > 0, m
    assert m["steps"]["decode_steps"] > 0, m["steps"]  # the block-table path ran
    assert 0 < m["steps"]["decode_host_ms_p50"] <= m["steps"]["decode_wall_ms_p50"], m["steps"]
    assert m["steps"]["decode_gpu_span_ms_p50"] > 0, m["steps"]  # CUDA events around each step's forward
    assert m["output_tokens"] == 6 * 24


DIVERGENCE = """
import json, sys
import torch
import bench_serve
from transformers import AutoModelForCausalLM
from model_utils import random_prompt, save_tiny_text_model

save_tiny_text_model(sys.argv[1], seed=0)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation="m3_sparse").eval()
prompt = random_prompt(40, torch.Generator().manual_seed(2)).tolist()
cfg = bench_serve.gen_config(5)
cfg.output_logits, cfg.return_dict_in_generate = True, True
out = model.generate(torch.tensor([prompt]), generation_config=cfg)
ref = out.sequences[0, len(prompt):].tolist()
step2 = out.logits[2][0].float()
runner_up = int(step2.argsort(descending=True)[1])
got = ref[:2] + [runner_up] + ref[3:]
# check_tokens keeps generate()'s tokens in refs: a second run (another arrival rate) reuses
# them, and calls generate() only for the divergence's logits.
refs, served, calls = {}, [bench_serve.Served(got, 0.0, [])], []
generate = model.generate
model.generate = lambda *a, **k: calls.append(len(a[0][0])) or generate(*a, **k)
checks = [bench_serve.check_tokens(model, [prompt], served, 5, refs)]
checks.append(bench_serve.check_tokens(model, [prompt], served, 5, refs))
checks += [refs[0]["tokens"] == ref, calls]
del model.generate
print(json.dumps({"same": bench_serve.divergence(model, prompt, ref, ref),
                  "diff": bench_serve.divergence(model, prompt, got, ref),
                  "gaps_ref": bench_serve.token_gaps(model, prompt, ref),
                  "gaps_got": bench_serve.token_gaps(model, prompt, got),
                  "margin": float(step2[ref[2]] - step2[runner_up]), "top": float(step2.abs().max()),
                  "checks": checks}))
"""


def test_divergence_names_the_step_rank_and_margin(tmp_path):
    """The token check's report of a mismatch: the first differing step, the served token's rank
    in generate()'s logits there and the margin to generate()'s token; and the teacher-forced
    gaps the bf16 check compares with its tolerance (fp32, CPU)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT / "benchmarks"), str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", DIVERGENCE, str(tmp_path / "ckpt")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["same"] == {"step": 5, "margin": None, "relative": None, "rank": None}
    diff = got["diff"]
    assert diff["step"] == 2 and diff["rank"] == 2 and diff["margin"] > 0
    assert diff["margin"] == pytest.approx(got["margin"], rel=1e-3, abs=1e-5)
    assert diff["relative"] == pytest.approx(got["margin"] / got["top"], rel=1e-3, abs=1e-6)
    # The teacher-forced gaps of the bf16 check: generate()'s own tokens are each forward's
    # choice; the planted runner-up sits its margin below the top at step 2 (and the tokens
    # after it, fed a history generate() never saw, are whatever they are).
    assert max(got["gaps_ref"]) < 1e-5
    assert got["gaps_got"][:2] == pytest.approx([0.0, 0.0], abs=1e-5)
    assert got["gaps_got"][2] == pytest.approx(got["margin"] / got["top"], rel=1e-3, abs=1e-6)
    # fp32: a differing token fails; the second check answered from the kept reference.
    first, second, kept, calls = got["checks"]
    assert first["mismatched"] == first["failed"] == [0] and first["divergences"][0]["step"] == 2
    assert second == first and kept
    assert calls == [40, 42, 42]  # the reference once, then each check's divergence (prompt + 2)


def test_check_and_warmup_flags():
    """``--check`` alone checks every configuration, ``--check NAME`` that one, and a name not
    among ``--configs`` is refused; ``--warmup auto`` warms m3_sparse (graphs, Triton
    specializations) with the whole request set and paged|sdpa with two requests."""
    bench_serve = import_bench_serve()
    base = ["--layers", "sf", "--configs", "m3_sparse,dense", "--device", "cpu"]
    assert bench_serve.parse_args(base).check == []
    assert bench_serve.parse_args(base + ["--check"]).check == ["m3_sparse", "dense"]
    assert bench_serve.parse_args(base + ["--check", "m3_sparse"]).check == ["m3_sparse"]
    assert bench_serve.parse_args(["--quick"]).check == bench_serve.parse_args(["--quick"]).configs
    with pytest.raises(SystemExit):
        bench_serve.parse_args(["--configs", "m3_sparse", "--check", "dense"])
    args = bench_serve.parse_args(base)
    assert [bench_serve.warmup_mode(c, args) for c in bench_serve.CONFIGS] == ["full", "short"]
    args = bench_serve.parse_args(base + ["--warmup", "short"])
    assert {bench_serve.warmup_mode(c, args) for c in bench_serve.CONFIGS} == {"short"}


def test_run_limit_stops_a_run_and_bounds_its_throughput(tmp_path):
    """``--run-limit``: a run stopped before its requests finish says so, reports no latencies,
    bounds its output tok/s by every request's tokens over the time it ran, skips the token
    check and exits 0."""
    rows = quick_run(tmp_path, "--configs", "dense", "--rates", "0", "--run-limit", "1e-6")
    (row,) = rows
    m = row["metrics"]
    assert m["status"] == "stopped" and not m["mismatched"] and m["finished"] < 4, m
    assert m["tok_s"] is None and m["ttft_p50_ms"] is None and m["itl_p50_ms"] is None
    assert m["tok_s_max"] * m["wall_s"] == pytest.approx(4 * 5) and m["wall_s"] > 0
    assert "stopped after" in m["note"] and f"< {m['tok_s_max']:.1f}" in (tmp_path / "bench_serve.md").read_text()


def test_speedup_over_a_stopped_dense_run_is_a_lower_bound():
    """A finished sparse run against a stopped dense run of the same model and arrival: its
    tokens/s over the dense run's upper bound, shown as a lower bound; no latency speedups."""
    bench_serve = import_bench_serve()
    sparse = bench_serve.Run("sf", "m3_sparse", 0.0, status="ok",
                             figures=dict(tok_s=300.0, ttft_p50_ms=10.0, itl_p50_ms=2.0))
    dense = bench_serve.Run("sf", "dense", 0.0, status="stopped",
                            figures=bench_serve.stopped_figures([None, None], 4.0, 100))
    other_rate = bench_serve.Run("sf", "m3_sparse", 4.0, status="ok",
                                 figures=dict(tok_s=300.0, ttft_p50_ms=10.0, itl_p50_ms=2.0))
    bench_serve.fill_speedups([sparse, dense, other_rate])
    assert dense.figures["tok_s_max"] == 50.0
    assert sparse.speedup == {"tok_s": None, "tok_s_min": 6.0, "ttft_p50": None, "itl_p50": None}
    assert other_rate.speedup == {}
    tab = bench_serve.table([sparse, dense])
    assert "> 6.00x" in tab and "< 50.0" in tab


def test_the_dense_twin_has_no_flash_attention():
    """Why bench_serve has no flash-attention twin: transformers refuses flash attention for
    the M3 model class. When it accepts it, a paged|flash_attention_* twin belongs beside
    paged|sdpa."""
    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM

    assert MiniMaxM3VLForCausalLM._supports_flash_attn is False


def test_scheduler_flag_reaches_the_manager_config():
    """``--scheduler`` picks transformers' scheduler of each run's manager (its ITL knob beside
    ``--max-batch-tokens``); FIFO unless asked."""
    bench_serve = import_bench_serve()
    base = ["--layers", "sf", "--configs", "m3_sparse", "--device", "cpu", "--max-batch-tokens", "512"]
    prompts = [[1] * 40, [1] * 700]
    for flags, want in (([], "fifo"), (["--scheduler", "prefill_first"], "prefill_first")):
        config = bench_serve.cb_config(bench_serve.parse_args(base + flags), prompts)
        assert (config.scheduler_type, config.max_batch_tokens) == (want, 512)
    with pytest.raises(SystemExit):
        bench_serve.parse_args(base + ["--scheduler", "lifo"])


def test_step_summary_gives_a_decode_steps_host_and_wall_time():
    """Runs of decode-only steps: the median of each step's host ms (its three methods, together
    and each alone), of its forward's GPU span where recorded and of the wall ms from its start
    to the next step's; other steps count in none."""
    def row(fast, host, start_s):
        return {"q_tokens": 2 if fast else 64, "requests": 2, "decode_fast_path": fast, "prepare_ms": host / 2,
                "generation_step_ms": host / 4, "update_batch_ms": host / 4, "start": start_s}

    rows = [row(False, 9.0, 0.0), row(True, 1.0, 0.010), row(True, 2.0, 0.014), row(True, 1.5, 0.020),
            row(False, 7.0, 0.023), row(True, 3.0, 0.040)]
    assert import_bench_serve().step_summary(rows)["decode_gpu_span_ms_p50"] is None  # no CUDA events
    for r, span in zip(rows, (8.0, 0.5, 0.9, 0.7, 6.0, 2.0)):
        r["gpu_span_ms"] = span
    summary = import_bench_serve().step_summary(rows)
    assert summary["decode_gpu_span_ms_p50"] == pytest.approx(0.7)  # of the decode pairs' first steps
    # Decode pairs: (1, 2) host 1.0 wall 4 ms, (2, 3) host 2.0 wall 6 ms; step 3 is followed by a mixed step.
    assert summary["decode_host_ms_p50"] == pytest.approx(1.5)
    assert summary["decode_wall_ms_p50"] == pytest.approx(5.0)
    assert summary["decode_method_ms_p50"] == pytest.approx(
        {"prepare_ms": 0.75, "generation_step_ms": 0.375, "update_batch_ms": 0.375})
    assert summary["decode_wall_ms_quantiles"] == pytest.approx({"p10": 4.2, "p25": 4.5, "p50": 5.0, "p75": 5.5, "p90": 5.8})
    assert summary["steps"] == 6 and summary["decode_steps"] == 4
    assert import_bench_serve().step_summary(rows[:2])["decode_wall_ms_p50"] is None
    assert import_bench_serve().step_summary(rows[:2])["decode_wall_ms_quantiles"] is None
    assert import_bench_serve().step_summary(rows[:2])["decode_method_ms_p50"] is None


def test_stub_model_times_the_managers_bookkeeping_only(tmp_path):
    """--stub-model: each step emits STUB_TOKEN without a forward pass, so a run measures the
    manager's host bookkeeping alone (the same steps as the model's run: the schedule does
    not depend on the tokens); it refuses the token check, says so in the report, and puts
    transformers' own step function back afterwards."""
    rows = quick_run(tmp_path, "--stub-model", "--configs", "m3_sparse", "--rates", "0")
    (row,) = rows
    m = row["metrics"]
    assert m["status"] == "ok" and not m["checked"] and m["output_tokens"] == row["sizes"]["requests"] * 5
    steps, sizes = m["steps"], row["sizes"]
    assert steps["q_tokens"] == sizes["prompt_tokens"] + sizes["requests"] * (sizes["new_tokens"] - 1), steps
    assert "Model stubbed (--stub-model)" in (tmp_path / "bench_serve.md").read_text()
    bench_serve = import_bench_serve()
    with pytest.raises(SystemExit):
        bench_serve.parse_args(["--quick", "--stub-model", "--check"])
    from transformers.generation.continuous_batching import model_runner

    original = model_runner.ModelRunner._forward_process_and_sample
    with bench_serve.stubbed_model(True):
        assert model_runner.ModelRunner._forward_process_and_sample is not original
        output = torch.zeros(1, 4, dtype=torch.int32)
        model_runner.ModelRunner._forward_process_and_sample(None, None, {"logits_indices": torch.arange(3)},
                                                            None, None, output)
        assert output.tolist() == [[bench_serve.STUB_TOKEN] * 3 + [0]]
    assert model_runner.ModelRunner._forward_process_and_sample is original
