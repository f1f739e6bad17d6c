"""m3_hf_attention.compare: a block-selection or MoE-routing near-tie between m3_sparse and
sdpa is told from a wrong choice and from an attention that differs given the same blocks."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import m3_hf_attention  # noqa: F401  (registers m3_sparse)
from m3_hf_attention import compare
from model_utils import BLOCK, TOPK, random_prompt, save_tiny_text_model

TOL = 1e-4


def diff(gap=1e-6, bound=1e-5, **kw):
    base = dict(layer=2, row=0, position=90, head=1, m3=(3, 7, 11), sdpa=(3, 8, 11), scores={7: 1.0, 8: 1.0 - gap})
    return compare.SelectionDiff(**{**base, **kw}, gap=gap, bound=bound)


# ---------------------------------------------------------------------------------------
# the verdict, on constructed cases
# ---------------------------------------------------------------------------------------
def test_close_logits_agree():
    verdict, message = compare.classify(5e-5, 1e-4, None, [])
    assert verdict == "agree" and "prefill logits close" in message


def test_near_tie_is_accepted_with_its_gap():
    verdict, message = compare.classify(0.22, 3e-4, 4e-6, [diff(gap=2.8e-6, bound=8.6e-5)])
    assert verdict == "near-tie"
    assert "gap 2.8e-06 <= bound 8.6e-05" in message and "layer 2, position 90, KV head 1" in message


def test_wrong_selection_with_a_large_gap_is_rejected():
    diffs = [diff(gap=2e-6), diff(position=95, gap=0.4, bound=8e-5)]
    verdict, message = compare.classify(0.22, 3e-4, 4e-6, diffs)
    assert verdict == "disagree"
    assert "1 of 2" in message and "position 95" in message and "gap 0.4 > bound 8e-05" in message


def test_differing_attention_with_identical_selections_is_rejected():
    verdict, message = compare.classify(0.22, 3e-4, 0.21, [])
    assert verdict == "disagree" and "given the same blocks" in message
    # ... even when the selections also hold a real near-tie
    assert compare.classify(0.22, 3e-4, 0.21, [diff()])[0] == "disagree"


def test_a_difference_the_rerun_does_not_show_is_rejected():
    verdict, message = compare.classify(0.22, 3e-4, 4e-6, [])
    assert verdict == "disagree" and "not reproduced" in message


@pytest.mark.parametrize("gap", [math.inf, math.nan])
def test_unscored_or_structural_differences_are_not_near_ties(gap):
    d = diff(gap=gap, reason="not scored")
    assert not d.near_tie
    assert compare.classify(0.22, 3e-4, 4e-6, [d])[0] == "disagree"


def test_structural_reasons():
    # query at position 40 with blocks of 8: its own block 5 is forced (one local block)
    assert compare.structural_reason([0, 1, 5], [0, 2, 5], 40, 8, 1) == ""
    assert "forced" in compare.structural_reason([0, 1, 2], [0, 1, 5], 40, 8, 1)
    assert "selects 2 visible blocks, sdpa 3" in compare.structural_reason([0, 5], [0, 1, 5], 40, 8, 1)
    assert "twice" in compare.structural_reason([1, 1, 5], [0, 1, 5], 40, 8, 1)


def test_tie_bound_is_the_dot_rounding_of_both_paths():
    assert compare.tie_bound(10.0, 32, torch.float32) == pytest.approx(2 * 32 * 2.0**-24 * 10.0)
    assert compare.tie_bound(10.0, 32, torch.bfloat16) > 100 * compare.tie_bound(10.0, 32, torch.float32)


def test_routing_bound_is_half_a_logit_bound_plus_the_sigmoid_rounding():
    u = 2.0**-24
    exact = compare.routing_bound(10.0, 128, torch.float32, weight_norm=2.0, input_diff=0.0, bias=0.5)
    assert exact == pytest.approx(compare.tie_bound(10.0, 128, torch.float32) / 2 + 8 * u * 1.5)
    moved = compare.routing_bound(10.0, 128, torch.float32, weight_norm=2.0, input_diff=1e-4, bias=0.5)
    assert moved - exact == pytest.approx(2.0 * 1e-4 / 2)


def test_routing_near_tie_and_wrong_routing_verdicts():
    tie = compare.RoutingDiff(1, 0, 40, (0, 3), (0, 5), {3: 0.7, 5: 0.7 - 1e-7}, gap=1e-7, bound=1e-6)
    verdict, message = compare.classify(0.3, 3e-4, 2e-6, [tie])
    assert verdict == "near-tie" and "MoE-routing" in message and "layer 1 MoE router, position 40" in message
    wrong = compare.RoutingDiff(1, 0, 40, (0, 3), (0, 5), {3: 0.9, 5: 0.2}, gap=0.7, bound=1e-6)
    verdict, message = compare.classify(0.3, 3e-4, 2e-6, [tie, wrong])
    assert verdict == "disagree" and "1 of 2 differing choices are not near-ties" in message
    unscored = compare.RoutingDiff(1, 0, 41, (0, 3), (0, 5), gap=math.nan, reason="not scored")
    assert not unscored.near_tie and compare.classify(0.3, 3e-4, 2e-6, [unscored])[0] == "disagree"


def test_differing_compares_attended_blocks():
    own = torch.tensor([[[0, 1, -1], [1, 0, 2], [2, 0, 1]]], dtype=torch.int32)  # [Hi=1, S=3, K=3], block size 1
    ref = torch.tensor([[[0, -1, -1], [0, 1, -1], [2, 1, 0]]], dtype=torch.int32)
    # position 0: block 1 lies after the query's own block, so both attend only block 0;
    # position 1: the same as a set with block 2 (a future block) dropped; position 2: same set.
    assert compare.differing(own, ref, 1) == []
    ref[0, 2] = torch.tensor([2, 1, -1])
    assert compare.differing(own, ref, 1) == [(2, 0, [0, 1, 2], [1, 2])]


# ---------------------------------------------------------------------------------------
# on a model
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-m3-compare")
    save_tiny_text_model(path, seed=0)
    return path


def load(checkpoint):
    sparse = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="m3_sparse").eval()
    dense = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa").eval()
    return sparse, dense


@pytest.fixture(scope="module")
def models(checkpoint):
    return load(checkpoint)


def prompt(length=100, seed=6):
    return random_prompt(length, torch.Generator().manual_seed(seed))


def run_check(sparse, dense, ids, hook=None):
    """check_prefill of one row; ``hook``: a hook handle on ``sparse``, removed after the check."""
    try:
        return compare.check_prefill(sparse, lambda: sparse(ids[None]).logits, dense, [ids], tol=TOL)[0]
    finally:
        if hook is not None:
            hook.remove()


def test_float64_scores_select_what_the_stock_indexer_selects(models):
    """index_qk64 is the indexer's own math: its float64 scores, put through the selection
    rule, give transformers' selection wherever the choice is not a near-tie."""
    _, dense = models
    ids = prompt()
    inputs, chosen = {}, {}

    def grab(module, args, kwargs, output):
        inputs[module.layer_idx] = compare.indexer_inputs(args, kwargs)
        chosen[module.layer_idx] = output[0]

    with compare.forward_hooks(compare.indexers(dense), grab), torch.no_grad():
        dense(ids[None])
    by_layer = {mod.layer_idx: mod for mod in compare.indexers(dense)}
    for layer, (hidden, cos, sin) in inputs.items():
        indexer = by_layer[layer]
        q, k = compare.index_qk64(indexer, hidden[0], cos[0], sin[0])
        n, blocks = len(ids), -(-len(ids) // BLOCK)
        s = torch.einsum("qhd,kd->hqk", q, k).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
        block_s = torch.nn.functional.pad(s, (0, blocks * BLOCK - n), value=-math.inf).view(2, n, blocks, BLOCK).amax(-1)
        checked = 0
        for p in range(TOPK * BLOCK, n):  # past the first blocks, a real choice among earlier ones
            last = p // BLOCK
            for h in range(2):
                ranked = block_s[h, p, :last].sort(descending=True)
                if ranked.values[TOPK - 2] - ranked.values[TOPK - 1] < 1e-4:
                    continue  # a near-tie: either choice is right
                want = sorted([last, *ranked.indices[: TOPK - 1].tolist()])
                assert sorted(chosen[layer][h, p].tolist()) == want, (layer, p, h)
                checked += 1
        assert checked > 100


def test_agreeing_prompt(models):
    sparse, dense = models
    check = run_check(sparse, dense, prompt())
    assert check.verdict == "agree" and check.replay_err is None, check.message


def test_exact_tie_is_a_near_tie(checkpoint):
    """All index keys of layer 0 zero: every block scores 0, an exact tie that the paths
    may break differently. m3_sparse is made to pick, at one position, a block sdpa did not:
    the logits move far beyond the bound, and the check accepts it as a near-tie (gap 0)."""
    sparse, dense = load(checkpoint)
    with torch.no_grad():
        for model in (sparse, dense):
            model.model.layers[0].self_attn.indexer.k_proj.weight.zero_()
    ids, pos = prompt(), 90
    store = {}
    with compare.capture_selections(dense, store), torch.no_grad():
        dense(ids[None])
    theirs = store[0][0, pos].tolist()  # head 0
    other = next(b for b in range(pos // BLOCK) if b not in theirs)
    mine = [other if b == min(b for b in theirs if b != pos // BLOCK) else b for b in theirs]

    def pick_other(module, args, output):
        output = output.clone()
        output[0, 0, pos] = torch.tensor(mine)
        return output

    indexer = sparse.model.layers[0].self_attn.indexer
    check = run_check(sparse, dense, ids, hook=indexer.register_forward_hook(pick_other))
    assert check.err > 100 * check.bound
    assert check.verdict == "near-tie", check.message
    first = next(d for d in check.diffs if d.position == pos and d.head == 0)
    assert first.gap == 0.0 and first.near_tie and set(first.m3) == set(mine)
    assert check.replay_err <= check.bound


def test_wrong_block_is_rejected(models):
    """m3_sparse made to swap, at one position, a selected block for the visible block
    that scores lowest: not a near-tie."""
    sparse, dense = models
    ids, pos, layer = prompt(), 90, 2
    store = {}
    with compare.capture_selections(dense, store), torch.no_grad():
        dense(ids[None])
    theirs = store[layer][1, pos].tolist()  # head 1

    def swap_worst(module, args, output):
        hidden, cos, sin = compare.indexer_inputs(args, {})
        unchosen = [b for b in range(pos // BLOCK) if b not in theirs]
        scores, _ = compare.block_scores64(module, hidden[0], cos[0], sin[0], pos, 1, unchosen)
        worst = min(scores, key=scores.get)
        output = output.clone()
        output[0, 1, pos] = torch.tensor([worst if b == theirs[-1] else b for b in theirs])
        return output

    indexer = sparse.model.layers[layer].self_attn.indexer
    check = run_check(sparse, dense, ids, hook=indexer.register_forward_hook(swap_worst))
    assert check.verdict == "disagree", check.message
    assert f"layer {layer}, position {pos}, KV head 1" in check.message and "not near-ties" in check.message
    assert check.diffs[0].gap > 1e3 * check.diffs[0].bound


def test_differing_attention_output_is_rejected(models):
    """The same selections everywhere, but one layer's attention output is off at one position."""
    sparse, dense = models

    def nudge(module, args, output):
        out = output[0].clone()
        out[0, 50] += 1e-2
        return (out, *output[1:])

    handle = sparse.model.layers[2].self_attn.register_forward_hook(nudge)
    try:
        check = run_check(sparse, dense, prompt())
    finally:
        handle.remove()
    assert check.verdict == "disagree" and "given the same blocks" in check.message
    assert check.diffs == []


# ---------------------------------------------------------------------------------------
# MoE routing on a model
# ---------------------------------------------------------------------------------------
MOE_LAYER = 1  # the tiny model's MoE layer


def routed(dense, ids) -> dict:
    store = {}
    with compare.capture_routing(dense, store), torch.no_grad():
        dense(ids[None])
    return store


def force_experts(sparse, pos: int, experts: list[int]):
    """A hook that makes m3_sparse's MoE router send token ``pos`` to ``experts``."""

    def hook(module, args, output):
        logits, weights, index = output
        index = index.clone()
        index[pos] = torch.tensor(experts)
        return logits, weights, index

    return sparse.model.layers[MOE_LAYER].mlp.gate.register_forward_hook(hook)


def test_float64_router_scores_pick_what_the_router_picks(models):
    """router_scores64 is the router's own math: its top-k is the router's choice wherever
    the k-th and (k+1)-th scores are apart."""
    _, dense = models
    experts, hidden = routed(dense, prompt())[MOE_LAYER]
    router = compare.routers(dense)[MOE_LAYER]
    everyone = list(range(router.num_experts))
    checked = 0
    for p in range(hidden.shape[0]):
        scores, _ = compare.router_scores64(router, hidden[p], everyone)
        ranked = sorted(everyone, key=scores.get, reverse=True)
        if scores[ranked[router.top_k - 1]] - scores[ranked[router.top_k]] < 1e-6:
            continue
        assert sorted(ranked[: router.top_k]) == experts[p].tolist(), p
        checked += 1
    assert checked > 50


def test_routing_tie_is_a_near_tie(checkpoint):
    """The MoE router's weights zero in both models: every expert scores sigmoid(0), an
    exact tie. m3_sparse is made to route one token to other experts than sdpa did: the
    logits move far beyond the bound, and the check accepts it as a routing near-tie (gap 0)."""
    sparse, dense = load(checkpoint)
    with torch.no_grad():
        for model in (sparse, dense):
            model.model.layers[MOE_LAYER].mlp.gate.weight.zero_()
    ids, pos = prompt(), 70
    theirs = routed(dense, ids)[MOE_LAYER][0][pos].tolist()
    router = compare.routers(dense)[MOE_LAYER]
    mine = [e for e in range(router.num_experts) if e not in theirs][: router.top_k]
    check = run_check(sparse, dense, ids, hook=force_experts(sparse, pos, mine))
    assert check.err > 100 * check.bound
    assert check.verdict == "near-tie", check.message
    first = next(d for d in check.diffs if isinstance(d, compare.RoutingDiff))
    assert (first.layer, first.position, list(first.m3), first.gap) == (MOE_LAYER, pos, sorted(mine), 0.0)
    assert check.replay_err <= check.bound


def test_wrong_routing_is_rejected(models):
    """m3_sparse made to route one token to the experts its router scores lowest: not a near-tie."""
    sparse, dense = models
    ids, pos = prompt(), 70
    _, hidden = routed(dense, ids)[MOE_LAYER]
    router = compare.routers(dense)[MOE_LAYER]
    scores, _ = compare.router_scores64(router, hidden[pos], list(range(router.num_experts)))
    worst = sorted(scores, key=scores.get)[: router.top_k]
    check = run_check(sparse, dense, ids, hook=force_experts(sparse, pos, worst))
    assert check.verdict == "disagree", check.message
    assert f"layer {MOE_LAYER} MoE router, position {pos}" in check.message and "not near-ties" in check.message
    routing = [d for d in check.diffs if isinstance(d, compare.RoutingDiff)]
    assert routing and routing[0].gap > 1e3 * routing[0].bound
