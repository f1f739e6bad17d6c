"""Layers placed by a device_map (accelerate): each layer of the paged cache keeps its pages,
lengths and block tables on the device of that layer, and generate() gives the result of
the model on one device. On the CPU the map names "cpu" per layer (and accelerate's hooks
are forced on); the GPU tests mix cuda:0 with the CPU, and a second GPU where there is one."""

from __future__ import annotations

import accelerate
import pytest
import torch
from transformers import AutoModelForCausalLM

import m3_hf_attention  # noqa: F401
from m3_hf_attention import M3PagedCache
from m3_hf_attention.mask import set_step_mask
from model_utils import greedy, random_prompt, save_tiny_text_model

LOGIT_ATOL = 2e-4  # fp32; the Triton kernels (GPU layers) and the torch code (CPU layers) sum differently
LAYERS = 3
SKIP = "past_key_values"  # what from_pretrained tells accelerate: the cache stays where its layers put it


def device_map(layer_devices, head="cpu"):
    dm = {"model.embed_tokens": head, "model.rotary_emb": head, "model.norm": head, "lm_head": head}
    dm.update({f"model.layers.{i}": d for i, d in enumerate(layer_devices)})
    return dm


def padded_batch(device="cpu"):
    g = torch.Generator().manual_seed(0)
    lengths = [70, 33]
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = random_prompt(n, g)
        mask[i, width - n :] = 1
    return ids.to(device), mask.to(device)


def generate(model, ids, mask):
    out = greedy(model, ids, mask, new_tokens=4, output_scores=True, return_dict_in_generate=True)
    return out.sequences.cpu(), torch.stack(out.scores).cpu(), out.past_key_values


def assert_same_generation(got, ref):
    assert got[0].tolist() == ref[0].tolist()
    finite = torch.isfinite(ref[1])
    torch.testing.assert_close(got[1][finite], ref[1][finite], atol=LOGIT_ATOL, rtol=0)


def assert_pages_on(cache: M3PagedCache, devices) -> None:
    for layer, device in zip(cache.layers, devices):
        device = torch.device(device)
        tensors = [layer.keys, layer.values, layer.seq_lens, layer.step_kv_lens, layer.block_tables]
        if layer.is_sparse:
            tensors.append(layer.index_keys)
        assert all(t.device == device for t in tensors), (layer.layer_idx, [t.device for t in tensors])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-m3-device-map")
    # Blocks of 16 keys: the Triton kernels take them, so the GPU layers run Triton.
    save_tiny_text_model(path, seed=3, index_block_size=16, index_topk_blocks=2)
    return path


def test_device_map_of_layers_on_cpu(checkpoint):
    ids, mask = padded_batch()
    plain = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="m3_sparse").eval()
    ref = generate(plain, ids, mask)
    mapped = AutoModelForCausalLM.from_pretrained(
        checkpoint, attn_implementation="m3_sparse", device_map=device_map(["cpu"] * LAYERS)
    ).eval()
    got = generate(mapped, ids, mask)
    assert_same_generation(got, ref)
    assert_pages_on(got[2], ["cpu"] * LAYERS)
    # accelerate's hooks (here all on the CPU) move every layer's inputs, the padding mask included.
    accelerate.dispatch_model(plain, device_map(["cpu"] * LAYERS), force_hooks=True, skip_keys=SKIP)
    assert hasattr(plain.model.layers[1], "_hf_hook")
    assert_same_generation(generate(plain, ids, mask), ref)


def test_each_layer_keeps_its_pages_on_its_device(checkpoint):
    """Two devices on a CPU-only machine: the meta device stands in for the second one
    (every cache operation is shape-only there)."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="m3_sparse")
    cfg = model.config
    cache = M3PagedCache(cfg, 2, 40, page_size=16)
    set_step_mask(None)
    for layer, device in zip(cache.layers, ["cpu", "meta", "cpu"]):
        k = torch.randn(2, cfg.num_key_value_heads, 5, cfg.head_dim, device=device)
        layer.update(k, k)
        if layer.is_sparse:
            layer.update_index(torch.randn(2, 1, 5, cfg.index_head_dim, device=device))
    assert_pages_on(cache, ["cpu", "meta", "cpu"])
    assert cache.block_tables.device.type == "cpu"  # the first layer's device keeps the original
    assert cache.layers[1].block_tables is cache.layers[1].block_tables  # one copy per device, made once
    assert cache.sequence_lengths().tolist() == [5, 5]


# --------------------------------------------------------------------------- GPU
@pytest.mark.parametrize(
    "layer_devices",
    [
        pytest.param(["cuda:0", "cpu", "cuda:0"], marks=pytest.mark.gpu, id="cuda0-cpu"),
        pytest.param(
            ["cuda:0", "cuda:1", "cpu"],
            marks=[pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")],
            id="cuda0-cuda1-cpu",
        ),
    ],
)
def test_layers_on_gpu_and_cpu_match_one_device(checkpoint, layer_devices):
    """Every layer runs on its own device (main_device="cpu": accelerate does not offload the
    CPU layers to the GPU), so the pages of one cache sit on several devices and the Triton
    kernels launch on a GPU that may not be the current one."""
    ids, mask = padded_batch("cuda:0")
    one = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="m3_sparse").to("cuda:0").eval()
    ref = generate(one, ids, mask)

    spread = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="m3_sparse").eval()
    accelerate.dispatch_model(spread, device_map(layer_devices, head="cuda:0"), main_device="cpu", skip_keys=SKIP)
    got = generate(spread, ids, mask)
    assert_same_generation(got, ref)
    assert_pages_on(got[2], layer_devices)


@pytest.mark.gpu
def test_from_pretrained_device_map_with_cpu_offload(checkpoint):
    """A layer mapped to "cpu" next to GPU layers is offloaded by accelerate: its weights stay
    on the CPU and it runs on cuda:0, where its pages are allocated."""
    ids, mask = padded_batch("cuda:0")
    one = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="m3_sparse").to("cuda:0").eval()
    ref = generate(one, ids, mask)
    mapped = AutoModelForCausalLM.from_pretrained(
        checkpoint, attn_implementation="m3_sparse", device_map=device_map(["cuda:0", "cpu", "cuda:0"], head="cuda:0")
    ).eval()
    got = generate(mapped, ids, mask)
    assert_same_generation(got, ref)
    assert_pages_on(got[2], ["cuda:0"] * LAYERS)
