"""Tensor parallelism over heads (``m3_hf_attention.tp``) on the CPU.

``torchrun`` starts 2 or 4 ranks with the gloo backend (CUDA hidden); each loads the tiny
M3 with ``DistributedConfig(tp_size=...)`` and ``m3_sparse``, runs a padded generate() and a
chunked prefill + decode through a paged cache with a shuffled block table, and saves what
it got. Every rank must hold only its share of the heads (weights and cache pages) and
produce the single-process result. This file is also the script the ranks run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration

import m3_hf_attention  # noqa: F401  registers m3_sparse and its TP plan
from m3_hf_attention import M3PagedCache, tp
from model_utils import greedy, random_prompt, save_tiny_text_model, text_config, vl_config

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = (70, 41)  # a left-padded batch; prompts much longer than top-k x block
NEW_TOKENS = 4
CHUNKS = ((0, 37), (37, 60), (60, 61), (61, 62), (62, 63))  # two prefill chunks, then decode steps
HEADS = dict(num_attention_heads=8, num_key_value_heads=4, index_n_heads=4)  # tp 1, 2 and 4 divide them
ATOL = 1e-5  # fp32; ranks sum o_proj and MoE partial products in another order than one process


def workload(model) -> dict[str, torch.Tensor]:
    """What both the ranks and the single process compute (CPU, fp32)."""
    g = torch.Generator().manual_seed(0)
    width = max(PROMPTS)
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(PROMPTS):
        ids[i, width - n :] = random_prompt(n, g)
        mask[i, width - n :] = 1
    out = greedy(model, ids, mask, new_tokens=NEW_TOKENS, output_scores=True, return_dict_in_generate=True)

    seq = random_prompt(CHUNKS[-1][1], g)[None]
    page_size, max_len = 16, 64
    pages = max_len // page_size
    tables = torch.randperm(pages + 3, generator=g)[:pages].view(1, pages).to(torch.int32)
    cache = M3PagedCache(model.config, 1, max_len, page_size=page_size, block_tables=tables, num_pages=pages + 3)
    with torch.no_grad():
        logits = [model(input_ids=seq[:, a:b], past_key_values=cache, use_cache=True).logits[0] for a, b in CHUNKS]
    sparse = next(layer for layer in cache.layers if layer.is_sparse)
    return {
        "sequences": out.sequences,
        "scores": torch.stack(out.scores),
        "chunk_logits": torch.cat(logits),
        "kv_pool_shape": torch.tensor(cache.layers[0].keys.shape),
        "index_pool_shape": torch.tensor(sparse.index_keys.shape),
    }


# --------------------------------------------------------------------------- the ranks
def rank_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("out_dir")
    parser.add_argument("--bad-checkpoint", help="a model whose heads this world size does not divide")
    args = parser.parse_args(argv)

    from transformers.distributed import DistributedConfig

    torch.set_num_threads(1)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    config = DistributedConfig(tp_size=world)
    if args.bad_checkpoint:
        try:
            AutoModelForCausalLM.from_pretrained(
                args.bad_checkpoint, attn_implementation="m3_sparse", distributed_config=config
            )
        except ValueError as e:
            (Path(args.out_dir) / f"error{rank}.txt").write_text(str(e))
        else:
            raise AssertionError(f"tp_size={world} loaded a model whose KV heads it does not divide")
    model = AutoModelForCausalLM.from_pretrained(
        args.checkpoint, attn_implementation="m3_sparse", distributed_config=config
    ).eval()
    attn = model.model.layers[0].self_attn
    local = {
        "q_proj_rows": attn.q_proj.weight.to_local().shape[0],
        "k_proj_rows": attn.k_proj.weight.to_local().shape[0],
        "index_q_rows": attn.indexer.q_proj.weight.to_local().shape[0],
        "index_k_rows": attn.indexer.k_proj.weight.shape[0],  # replicated, a plain tensor
    }
    result = workload(model)
    result.update({k: torch.tensor(v) for k, v in local.items()})
    torch.save(result, Path(args.out_dir) / f"rank{rank}.pt")
    # Every rank must be past its last collective before any rank tears gloo down, and the
    # interpreter must not finalize while gloo's worker threads still hold tensors: either
    # can abort a rank at exit after its work is done and saved.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    good, bad = tmp_path_factory.mktemp("tiny-m3-tp"), tmp_path_factory.mktemp("tiny-m3-tp-bad")
    save_tiny_text_model(good, seed=0, **HEADS)
    save_tiny_text_model(bad, seed=0)  # 2 KV heads: tp 4 cannot split them
    return good, bad


@pytest.fixture(scope="module")
def reference(checkpoints):
    model = AutoModelForCausalLM.from_pretrained(checkpoints[0], attn_implementation="m3_sparse").eval()
    return workload(model)


def launch(world: int, checkpoint, out_dir, *extra) -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    logs = Path(out_dir) / "logs"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
        f"--log-dir={logs}", "--redirects=3",
        __file__, str(checkpoint), str(out_dir), *map(str, extra),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        # Each rank's own output says where it stopped; torchrun's summary does not.
        ranks = "".join(
            f"\n--- {f.relative_to(logs)}\n{f.read_text(errors='replace')[-2000:]}"
            for f in sorted(logs.rglob("*.log"))
        )
        raise AssertionError(f"torchrun exited with {proc.returncode}{ranks}\n--- torchrun\n{proc.stderr[-3000:]}")


def test_supported_tp_sizes_and_error():
    m3 = text_config(num_attention_heads=64, num_key_value_heads=4, index_n_heads=4)
    assert tp.supported_tp_sizes(m3) == [1, 2, 4]
    assert tp.supported_tp_sizes(text_config()) == [1, 2]  # 8 query, 2 KV, 2 index heads
    tp.check_tp_size(m3, 4)
    with pytest.raises(ValueError, match=r"tp_size=8 .*num_key_value_heads=4.*Supported tp sizes: 1, 2, 4\."):
        tp.check_tp_size(m3, 8)
    dense_only = text_config(num_key_value_heads=4, index_n_heads=3, layer_types=["full_attention"] * 3)
    assert tp.supported_tp_sizes(dense_only) == [1, 2, 4]  # no indexer: its head count does not matter


def test_plan_shards_heads_only_with_m3_sparse(checkpoints):
    sparse = AutoModelForCausalLM.from_pretrained(checkpoints[0], attn_implementation="m3_sparse")
    sdpa = AutoModelForCausalLM.from_pretrained(checkpoints[0], attn_implementation="sdpa")
    prefix = "model.layers.*.self_attn"
    assert {k: v for k, v in sparse.tp_plan.items() if k.startswith(prefix)} == {
        prefix: tp.HEAD_CHECK_STYLE,
        f"{prefix}.q_proj": "colwise",
        f"{prefix}.k_proj": "colwise",
        f"{prefix}.v_proj": "colwise",
        f"{prefix}.o_proj": "rowwise",
        f"{prefix}.indexer.q_proj": "colwise",
    }
    assert sdpa.tp_plan[f"{prefix}.q_proj"] == "colwise_gather_output"  # the stock plan is left alone
    vl = MiniMaxM3SparseForConditionalGeneration._from_config(vl_config(), attn_implementation="m3_sparse")
    assert vl.tp_plan["model.language_model.layers.*.self_attn.indexer.q_proj"] == "colwise"
    assert not any(k.startswith("model.vision_tower") for k in vl.tp_plan)  # the vision tower stays replicated
    assert {k: v for k, v in sparse.tp_plan.items() if "self_attn" not in k} == {
        k: v for k, v in sdpa.tp_plan.items() if "self_attn" not in k
    }


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_single_process(checkpoints, reference, tmp_path, world):
    good, bad = checkpoints
    extra = ("--bad-checkpoint", bad) if world == 4 else ()
    launch(world, good, tmp_path, *extra)
    cfg = text_config(**HEADS)
    d = cfg.head_dim
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        # Each rank holds its share of the heads, in the weights and in the cache pages.
        assert got["q_proj_rows"].item() == cfg.num_attention_heads // world * d
        assert got["k_proj_rows"].item() == cfg.num_key_value_heads // world * d
        assert got["index_q_rows"].item() == cfg.index_n_heads // world * cfg.index_head_dim
        assert got["index_k_rows"].item() == cfg.index_head_dim
        kv_shape = reference["kv_pool_shape"].clone()
        kv_shape[1] //= world
        assert got["kv_pool_shape"].tolist() == kv_shape.tolist()
        assert got["index_pool_shape"].tolist() == reference["index_pool_shape"].tolist()
        # ... and computes the single-process result.
        assert got["sequences"].tolist() == reference["sequences"].tolist(), f"rank {rank}"
        finite = torch.isfinite(reference["scores"])
        assert torch.equal(finite, torch.isfinite(got["scores"]))
        torch.testing.assert_close(got["scores"][finite], reference["scores"][finite], atol=ATOL, rtol=0)
        torch.testing.assert_close(got["chunk_logits"], reference["chunk_logits"], atol=ATOL, rtol=0)
    if world == 4:
        message = (tmp_path / "error0.txt").read_text()
        assert "tp_size=4" in message and "num_key_value_heads=2" in message
        assert message.endswith("Supported tp sizes: 1, 2.")


if __name__ == "__main__":
    rank_main(sys.argv[1:])
