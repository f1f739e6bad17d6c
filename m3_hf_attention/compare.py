"""m3_sparse against transformers' ``sdpa`` path, telling a near-tie from a bug.

Two discrete choices in an M3 layer can flip on a rounding difference. Each sparse layer
picks a query's key blocks by a max-pooled index score, and each MoE layer picks a token's
experts by a router score, both in fp32. Where two blocks (or two experts) score within
rounding of each other, the two paths may rank them the other way round: the token then
attends another block or goes through another expert, and its hidden state (and whatever
later layers build on it) moves by far more than rounding, though neither path is wrong.

:func:`check_prefill` compares the prefill logits of each row with an unpadded sdpa run of
that row. A row beyond the bound is run again on m3_sparse with sdpa's choices handed to
every layer (forward hooks replace the indexers' selections and the routers' experts),
which separates the causes:

* the rerun still differs: the attention differs given the same blocks, a bug;
* it agrees: only choices differed. In the rerun every layer's input equals sdpa's up to
  rounding, so wherever m3_sparse's own choice differs from sdpa's there, the blocks (or
  experts) in one choice only must score within a rounding bound of each other:
  :func:`tie_bound` for the index scores, :func:`routing_bound` for the router's, both
  scored in float64 from the rerun's input to that layer. Any other difference is a wrong
  choice.

``tol`` bounds |logit difference| relative to max(1, largest |sdpa logit|) of the row.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as m3

Verdict = str  # "agree" | "near-tie" | "disagree"
DEFAULT_SCORE_LIMIT = 256  # differing selections scored per row; past it the row fails
_UNUSED = 1 << 30  # sorts empty or invisible slots last


# ---------------------------------------------------------------------------------------
# float64 index scores
# ---------------------------------------------------------------------------------------
def tie_bound(abs_dot: float, head_dim: int, dtype: torch.dtype) -> float:
    """The largest score gap that rounding can turn over, for a score whose terms sum
    to ``abs_dot`` = sum_i |q_i k_i|.

    Each path's fp32 dot of ``head_dim`` terms lies within head_dim * u * abs_dot of the
    exact one, whatever its summation order (u = 2^-24, fp32's unit roundoff), so two
    paths may differ by twice that. The fp32 rounding of q and k themselves (a few u,
    relative) fits inside it. In a bf16 / fp16 model q and k are rounded to that dtype from
    inputs that differ by rounding between the paths: 2 u_dtype more per path.
    """
    per_path = head_dim * 2.0**-24
    if dtype in (torch.bfloat16, torch.float16):
        per_path += torch.finfo(dtype).eps  # 2 u_dtype (u = eps / 2)
    return 2 * per_path * abs_dot


def _rms_norm64(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    # MiniMaxM3VLRMSNorm's formula (a 1 + weight gain), without its cast to fp32.
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * (1.0 + norm.weight.to(x.device, torch.float64))


@torch.no_grad()
def index_qk64(indexer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The indexer's queries and keys in float64: hidden [N, hidden], cos / sin [N, R] ->
    (q [N, Hi, Di], k [N, Di]), the same projections, norms and rotary embedding."""
    d, n = indexer.head_dim, hidden.shape[0]
    # On the device of the captured states (kept on the host to save GPU memory).
    x = hidden.double()
    q = F.linear(x, indexer.q_proj.weight.to(x.device, torch.float64)).view(n, -1, d)
    k = F.linear(x, indexer.k_proj.weight.to(x.device, torch.float64)).view(n, 1, d)
    q, k = _rms_norm64(q, indexer.q_norm), _rms_norm64(k, indexer.k_norm)
    q, k = m3.apply_rotary_pos_emb(q, k, cos[..., :d].to(x.device, torch.float64), sin[..., :d].to(x.device, torch.float64))
    return q, k[:, 0]


@torch.no_grad()
def block_scores64(indexer, hidden, cos, sin, position: int, head: int, blocks: Sequence[int]):
    """Float64 scores of ``blocks`` for query ``position`` and index head ``head`` of one
    row (``hidden``, ``cos``, ``sin`` indexed by position). Returns ({block: score},
    {block: sum_i |q_i k_i| of its best key}); a block's score is its best visible key's."""
    size = indexer.block_size
    keys = torch.cat([torch.arange(b * size, min((b + 1) * size, position + 1)) for b in blocks])
    cols = torch.cat([keys, torch.tensor([position])]).to(hidden.device)
    q, k = index_qk64(indexer, hidden[cols], cos[cols.to(cos.device)], sin[cols.to(sin.device)])
    q, k = q[-1, head], k[:-1]
    s, a = k @ q, k.abs() @ q.abs()  # [keys]
    owner = (keys // size).to(hidden.device)
    scores, abs_dots = {}, {}
    for b in blocks:
        mine = owner == b
        best = int(torch.argmax(s[mine]))
        scores[b], abs_dots[b] = float(s[mine][best]), float(a[mine][best])
    return scores, abs_dots


# ---------------------------------------------------------------------------------------
# one differing selection
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChoiceDiff:
    """Where m3_sparse chose differently from sdpa at one (layer, row, position): what each
    chose (sorted), the float64 scores of what only one chose, their spread ``gap`` and the
    ``bound`` rounding can explain; ``reason`` says why no score can explain it (gap inf)."""

    layer: int
    row: int
    position: int
    m3: tuple[int, ...]
    sdpa: tuple[int, ...]
    scores: dict[int, float] = field(default_factory=dict)
    gap: float = math.inf
    bound: float = 0.0
    reason: str = ""

    item = "item"  # what is chosen, in messages
    score = "scores"  # what ranks it

    @property
    def near_tie(self) -> bool:
        return self.gap <= self.bound  # False for an inf or nan gap

    def where(self) -> str:
        return f"layer {self.layer}, position {self.position}"

    def describe(self) -> str:
        chosen = f"m3_sparse {list(self.m3)}, sdpa {list(self.sdpa)}"
        if self.reason:
            return f"{self.where()}: {chosen}: {self.reason}"
        scores = ", ".join(f"{self.item} {b} {s:.9g}" for b, s in sorted(self.scores.items()))
        rel = "<=" if self.near_tie else ">"
        return (f"{self.where()}: {chosen}; float64 {self.score} {scores}: gap {self.gap:.3g} {rel} "
                f"bound {self.bound:.3g}")


@dataclass(frozen=True)
class SelectionDiff(ChoiceDiff):
    """A sparse layer's key blocks for one query and KV head (visible blocks only)."""

    head: int = 0
    item = "block"
    score = "index scores"

    def where(self) -> str:
        return f"layer {self.layer}, position {self.position}, KV head {self.head}"


def structural_reason(m3_blocks, sdpa_blocks, position: int, block_size: int, local_blocks: int) -> str:
    """Why the two selections differ in a way no score gap explains ("" when only scores
    can tell): a repeated block, unequal counts, or a forced local block left out."""
    a, b = set(m3_blocks), set(sdpa_blocks)
    if len(a) != len(m3_blocks) or len(b) != len(sdpa_blocks):
        return "a block is selected twice"
    if len(a) != len(b):
        return f"m3_sparse selects {len(a)} visible blocks, sdpa {len(b)}"
    last = position // block_size
    forced = {x for x in range(last - local_blocks + 1, last + 1) if x >= 0} & (a ^ b)
    return f"the forced local block(s) {sorted(forced)} are missing from one side" if forced else ""


def score_diff(indexer, hidden, cos, sin, *, layer, row, position, head, m3_blocks, sdpa_blocks) -> SelectionDiff:
    """A :class:`SelectionDiff` with its float64 gap, from one row's indexer input."""
    base = dict(layer=layer, row=row, position=position, head=head, m3=tuple(m3_blocks), sdpa=tuple(sdpa_blocks))
    reason = structural_reason(m3_blocks, sdpa_blocks, position, indexer.block_size, indexer.local_blocks)
    if reason:
        return SelectionDiff(**base, reason=reason)
    only = sorted(set(m3_blocks) ^ set(sdpa_blocks))
    scores, abs_dots = block_scores64(indexer, hidden, cos, sin, position, head, only)
    gap = max(scores.values()) - min(scores.values())
    bound = tie_bound(max(abs_dots.values()), indexer.head_dim, hidden.dtype)
    return SelectionDiff(**base, scores=scores, gap=gap, bound=bound)


def visible_sorted(sel: torch.Tensor, block_size: int) -> torch.Tensor:
    """[Hi, S, K] selections of positions 0..S-1 -> each slot's block, sorted, with -1
    slots and blocks after the query's own (they hold no key it sees) sorted last as a
    large value: equal rows mean the same blocks attended."""
    last = (torch.arange(sel.shape[1], device=sel.device) // block_size)[None, :, None]
    seen = (sel >= 0) & (sel <= last)
    return torch.sort(torch.where(seen, sel.long(), _UNUSED), dim=-1).values


def differing(own: torch.Tensor, ref: torch.Tensor, block_size: int) -> list[tuple[int, int, list, list]]:
    """(position, head, m3 blocks, sdpa blocks) where two [Hi, S, K] selections attend
    different blocks, by position then head."""
    a, b = visible_sorted(own, block_size), visible_sorted(ref.to(own.device), block_size)
    where = (a != b).any(-1).nonzero().tolist()  # [(head, position)]
    out = []
    for h, p in sorted(where, key=lambda hp: (hp[1], hp[0])):
        out.append((p, h, [x for x in a[h, p].tolist() if x != _UNUSED], [x for x in b[h, p].tolist() if x != _UNUSED]))
    return out


# ---------------------------------------------------------------------------------------
# hooks on the indexers
# ---------------------------------------------------------------------------------------
def indexers(model) -> list:
    return [mod for mod in model.modules() if isinstance(mod, m3.MiniMaxM3VLIndexer)]


@contextlib.contextmanager
def forward_hooks(modules, hook):
    handles = [mod.register_forward_hook(hook, with_kwargs=True) for mod in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def indexer_inputs(args, kwargs):
    """(hidden [B, S, hidden], cos, sin) of an indexer call."""
    hidden = args[0] if args else kwargs["hidden_states"]
    cos, sin = args[1] if len(args) > 1 else kwargs["position_embeddings"]
    return hidden, cos, sin


def _padded(sel: torch.Tensor, topk: int) -> torch.Tensor:
    """[..., k] -> [..., topk] int32 with -1 slots (the stock indexer keeps min(topk, blocks))."""
    return F.pad(sel.to(torch.int32), (0, topk - sel.shape[-1]), value=-1)


@contextlib.contextmanager
def capture_selections(model, store: dict[int, torch.Tensor]):
    """While active, ``store[layer]`` is the last selection of each sparse layer, [Hi, S, topk]
    int32 on the CPU, from a forward of one unpadded row."""

    def hook(module, args, kwargs, output):
        store[module.layer_idx] = _padded(output[0], module.topk_blocks).cpu()

    with forward_hooks(indexers(model), hook):
        yield store


class SelectionRecorder:
    """Forward hooks on the m3_sparse model's indexers: each sparse layer's selection is
    compared, row by row, with sdpa's (``reference[row][layer]``, [Hi, len, topk]); the
    differences are collected in ``diffs``, the first ``score_limit`` of each row scored (with
    ``first_layer_only``, only those of a row's first layer that has any: in later layers the
    row's inputs are no longer sdpa's). ``replay=True`` hands each layer sdpa's selection in
    place of its own.

    Row ``b`` holds its real tokens in columns ``offsets[b] .. offsets[b] + len - 1`` of
    the batch, positions 0 .. len - 1 (a prefill from an empty cache).
    """

    def __init__(self, reference: list[dict[int, torch.Tensor]], offsets: Sequence[int], *, replay: bool,
                 score_limit: int = DEFAULT_SCORE_LIMIT, first_layer_only: bool = False):
        self.reference, self.offsets, self.replay = reference, list(offsets), replay
        self.score_limit, self.first_layer_only = score_limit, first_layer_only
        self.diffs: list[SelectionDiff] = []
        self._scored: dict[int, int] = {}  # row -> its differences scored so far
        self._first_layer: dict[int, int] = {}  # row -> its first layer with a difference

    def hook(self, module, args, kwargs, output):
        hidden, cos, sin = indexer_inputs(args, kwargs)
        out = output.clone() if self.replay else output
        for row, ref_layers in enumerate(self.reference):
            ref = ref_layers[module.layer_idx]
            cols = slice(self.offsets[row], self.offsets[row] + ref.shape[1])
            for p, h, mine, theirs in differing(output[row, :, cols], ref, module.block_size):
                self._record(module, hidden[row, cols], cos[min(row, cos.shape[0] - 1), cols],
                             sin[min(row, sin.shape[0] - 1), cols], row, p, h, mine, theirs)
            if self.replay:
                out[row, :, cols] = ref.to(out.device, out.dtype)
        return out if self.replay else None

    def _record(self, module, hidden, cos, sin, row, p, h, mine, theirs):
        layer = module.layer_idx
        later_layer = self.first_layer_only and self._first_layer.setdefault(row, layer) != layer
        if later_layer or self._scored.get(row, 0) >= self.score_limit:
            why = "not scored (a later layer)" if later_layer else f"not scored (past {self.score_limit} in this row)"
            self.diffs.append(SelectionDiff(layer, row, p, tuple(mine), tuple(theirs), gap=math.nan, reason=why, head=h))
            return
        self._scored[row] = self._scored.get(row, 0) + 1
        self.diffs.append(score_diff(module, hidden, cos, sin, layer=layer, row=row, position=p, head=h,
                                     m3_blocks=mine, sdpa_blocks=theirs))

    def attach(self, model):
        return forward_hooks(indexers(model), self.hook)


# ---------------------------------------------------------------------------------------
# MoE routing
# ---------------------------------------------------------------------------------------
def routers(model) -> dict[int, torch.nn.Module]:
    """{decoder layer index: its MoE router} of a model's text layers."""
    return {mod.self_attn.layer_idx: mod.mlp.gate for mod in model.modules()
            if isinstance(mod, m3.MiniMaxM3VLDecoderLayer) and isinstance(mod.mlp, m3.MiniMaxM3VLSparseMoeBlock)}


@contextlib.contextmanager
def layer_hooks(modules: dict[int, torch.nn.Module], hook):
    """Forward hooks ``hook(layer, module, args, output)`` on {layer: module}."""
    handles = [mod.register_forward_hook(functools.partial(hook, layer)) for layer, mod in modules.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def routing_bound(abs_dot: float, hidden_size: int, dtype: torch.dtype, weight_norm: float, input_diff: float,
                  bias: float) -> float:
    """The largest gap between two experts' router scores that the two paths may rank the
    other way round.

    A score is sigmoid(w_e . h) + bias_e. The logit of each path lies within
    :func:`tie_bound` of the other's for the same h (``abs_dot`` = sum_i |w_i h_i|), and the
    inputs h themselves differ by ``input_diff`` (2-norm, measured), which moves a logit by
    at most ``weight_norm`` (the largest |w_e|) times that. The sigmoid's slope is at most
    1/4, so a pair's score difference moves by at most half a logit's bound; the fp32
    sigmoid and bias add round a score by 2 u (1 + |bias|) per path, four scores in all.
    """
    logit = tie_bound(abs_dot, hidden_size, dtype) + weight_norm * input_diff
    return logit / 2 + 8 * 2.0**-24 * (1.0 + bias)


@torch.no_grad()
def router_scores64(router, hidden: torch.Tensor, experts: Sequence[int]):
    """Float64 router scores of ``experts`` for one token's router input ``hidden`` [H]:
    ({expert: score}, {expert: sum_i |w_i h_i|})."""
    x = hidden.double()
    w = router.weight.to(x.device, torch.float64)[list(experts)]
    bias = router.e_score_correction_bias.to(x.device, torch.float64)[list(experts)]
    scores = torch.sigmoid(w @ x) + bias
    abs_dots = w.abs() @ x.abs()
    return dict(zip(experts, scores.tolist())), dict(zip(experts, abs_dots.tolist()))


@dataclass(frozen=True)
class RoutingDiff(ChoiceDiff):
    """A MoE layer's experts for one token; the bound also covers the measured difference
    of the router's inputs (:func:`routing_bound`)."""

    item = "expert"
    score = "router scores"

    def where(self) -> str:
        return f"layer {self.layer} MoE router, position {self.position}"


def routing_diff(router, layer: int, row: int, position: int, mine: Sequence[int], theirs: Sequence[int],
                 hidden: torch.Tensor, their_hidden: torch.Tensor) -> RoutingDiff:
    """A :class:`RoutingDiff` scored from m3_sparse's router input ``hidden`` [H], with
    sdpa's input ``their_hidden`` [H] for the input difference."""
    only = sorted(set(mine) ^ set(theirs))
    scores, abs_dots = router_scores64(router, hidden, only)
    w = router.weight.to(hidden.device, torch.float64)[only]
    bound = routing_bound(max(abs_dots.values()), router.hidden_dim, router.weight.dtype,
                          float(w.norm(dim=1).max()), float((hidden.double() - their_hidden.to(hidden).double()).norm()),
                          float(router.e_score_correction_bias.abs().max()))
    return RoutingDiff(layer, row, position, tuple(mine), tuple(theirs), scores,
                       max(scores.values()) - min(scores.values()), bound)


@contextlib.contextmanager
def capture_routing(model, store: dict[int, tuple[torch.Tensor, torch.Tensor]]):
    """While active, ``store[layer]`` is each MoE layer's last (experts [S, k] int64 sorted,
    router input [S, H] fp32), on the CPU, from a forward of one unpadded row."""

    def hook(layer, module, args, output):
        store[layer] = (output[2].sort(-1).values.cpu(), args[0].reshape(-1, module.hidden_dim).float().cpu())

    with layer_hooks(routers(model), hook):
        yield store


class RoutingRecorder:
    """Forward hooks on the m3_sparse model's MoE routers: each token's experts are
    compared, row by row, with sdpa's (``reference[row][layer]`` as :func:`capture_routing`
    stores it); the differences are collected in ``diffs``, the first ``score_limit`` of
    each row scored. ``replay=True`` hands each router sdpa's experts in place of its own
    (their weights from its own scores, as the router computes them).

    The routers see the batch flattened: row ``b``'s real tokens are tokens
    ``b * width + offsets[b]`` on, ``width`` being the batch's padded length.
    """

    def __init__(self, reference: list[dict[int, tuple[torch.Tensor, torch.Tensor]]], offsets: Sequence[int],
                 width: int, *, replay: bool, score_limit: int = DEFAULT_SCORE_LIMIT):
        self.reference, self.offsets, self.width, self.replay = reference, list(offsets), width, replay
        self.score_limit = score_limit
        self.diffs: list[RoutingDiff] = []
        self._scored: dict[int, int] = {}

    def hook(self, layer, module, args, output):
        logits, weights, experts = output
        hidden = args[0].reshape(-1, module.hidden_dim)
        chosen = experts.clone() if self.replay else experts
        for row, ref_layers in enumerate(self.reference):
            theirs, their_hidden = ref_layers[layer]
            start = row * self.width + self.offsets[row]
            tokens = slice(start, start + theirs.shape[0])
            mine = experts[tokens].sort(-1).values.cpu()
            for p in (mine != theirs).any(-1).nonzero()[:, 0].tolist():
                self._record(module, layer, row, p, mine[p].tolist(), theirs[p].tolist(), hidden[start + p],
                             their_hidden[p])
            if self.replay:
                chosen[tokens] = theirs.to(chosen.device, chosen.dtype)
        if not self.replay:
            return None
        picked = torch.sigmoid(logits.float()).gather(1, chosen)
        return logits, (picked / picked.sum(-1, keepdim=True)).to(weights.dtype), chosen

    def _record(self, module, layer, row, p, mine, theirs, hidden, their_hidden):
        if self._scored.get(row, 0) >= self.score_limit:
            self.diffs.append(RoutingDiff(layer, row, p, tuple(mine), tuple(theirs), gap=math.nan,
                                          reason=f"not scored (past {self.score_limit} in this row)"))
            return
        self._scored[row] = self._scored.get(row, 0) + 1
        self.diffs.append(routing_diff(module, layer, row, p, mine, theirs, hidden, their_hidden))

    def attach(self, model):
        return layer_hooks(routers(model), self.hook)


# ---------------------------------------------------------------------------------------
# the verdict of one row
# ---------------------------------------------------------------------------------------
def classify(err: float, bound: float, replay_err: float | None, diffs: Sequence[ChoiceDiff]) -> tuple[Verdict, str]:
    """Verdict and explanation for a row whose prefill logits differ from sdpa's by
    ``err`` (bound ``bound``); ``replay_err`` is the difference of the rerun with sdpa's
    choices (block selections and MoE experts) and ``diffs`` the choices m3_sparse would
    have made differently there."""
    head = f"prefill logits differ by {err:.3g} > bound {bound:.3g}"
    if err <= bound:
        return "agree", f"prefill logits close: max |m3_sparse - sdpa| = {err:.3g} (bound {bound:.3g})"
    if replay_err is None or not math.isfinite(replay_err):
        return "disagree", f"{head}; no rerun with sdpa's choices to explain it"
    if replay_err > bound:
        return "disagree", (
            f"{head}, and by {replay_err:.3g} with sdpa's block selections and MoE experts at every layer: the "
            "attention differs given the same blocks (not a near-tie)"
        )
    if not diffs:
        return "disagree", (
            f"{head}, though m3_sparse makes sdpa's choices at every layer and a rerun agrees ({replay_err:.3g}): "
            "the first run is not reproduced"
        )
    wrong = [d for d in diffs if not d.near_tie]
    if wrong:
        return "disagree", (
            f"{head}; {len(wrong)} of {len(diffs)} differing choices are not near-ties, the first at "
            f"{wrong[0].describe()}"
        )
    widest = max(diffs, key=lambda d: d.gap / d.bound if d.bound else 0.0)
    kinds = " and ".join(k for k, t in (("block-selection", SelectionDiff), ("MoE-routing", RoutingDiff))
                         if any(isinstance(d, t) for d in diffs))
    return "near-tie", (
        f"{head}, from {len(diffs)} {kinds} near-tie(s) (largest gap {widest.gap:.3g} <= {widest.bound:.3g}): "
        f"{diffs[0].describe()}; with sdpa's choices the logits agree ({replay_err:.3g}): accepted"
    )


@dataclass
class RowCheck:
    row: int
    err: float  # max |m3_sparse - sdpa| over the row's prefill logits
    bound: float
    last_err: float  # the same at the last prompt position (the first generated token's logits)
    sdpa_logits: torch.Tensor  # [len, vocab] fp32, CPU
    replay_err: float | None = None
    diffs: list[ChoiceDiff] = field(default_factory=list)

    @property
    def verdict(self) -> Verdict:
        return classify(self.err, self.bound, self.replay_err, self.diffs)[0]

    @property
    def message(self) -> str:
        return classify(self.err, self.bound, self.replay_err, self.diffs)[1]


# ---------------------------------------------------------------------------------------
# the check
# ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def attn_implementation(model, name: str):
    """``model`` runs ``name`` inside the block (a no-op when it already does)."""
    before = model.config._attn_implementation
    if before == name:
        yield model
        return
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(before)


@dataclass
class Reference:
    """sdpa's run of each row alone, unpadded: per row, the logits [len, vocab] (fp32, CPU),
    {layer: block selection} (see :func:`capture_selections`) and {layer: MoE routing}
    (see :func:`capture_routing`)."""

    logits: list[torch.Tensor]
    selections: list[dict[int, torch.Tensor]]
    routing: list[dict[int, tuple[torch.Tensor, torch.Tensor]]]


def sdpa_reference(sdpa_model, rows) -> Reference:
    """Each row alone, unpadded, on sdpa."""
    ref = Reference([], [], [])
    with attn_implementation(sdpa_model, "sdpa"), torch.no_grad():
        for row in rows:
            selections, routing = {}, {}
            with capture_selections(sdpa_model, selections), capture_routing(sdpa_model, routing):
                ids = torch.as_tensor(row, device=sdpa_model.device)[None]
                ref.logits.append(sdpa_model(input_ids=ids).logits[0].float().cpu())
            ref.selections.append(selections)
            ref.routing.append(routing)
    return ref


def row_errors(logits: torch.Tensor, refs: Sequence[torch.Tensor], offsets: Sequence[int]):
    """Per row: (max |difference|, at the last position) of batch logits [B, W, V] against each row's."""
    out = []
    for b, ref in enumerate(refs):
        mine = logits[b, offsets[b] : offsets[b] + ref.shape[0]].float().cpu()
        diff = (mine - ref).abs()
        out.append((diff.max().item(), diff[-1].max().item()))
    return out


def check_prefill(m3_model, m3_forward: Callable[[], torch.Tensor], sdpa_model, rows, *, offsets=None,
                  tol: float = 1e-4, score_limit: int = DEFAULT_SCORE_LIMIT) -> list[RowCheck]:
    """Compare m3_sparse's prefill with sdpa's, row by row (see the module docstring).

    ``m3_forward()`` runs the batch on ``m3_model`` and returns its logits [B, W, vocab];
    it is called once, and once more with sdpa's choices when a row differs. ``rows``:
    each row's real tokens; row b sits at columns ``offsets[b]`` on (default: left padded
    to W). ``sdpa_model`` may be ``m3_model`` itself, switched to sdpa for its runs.
    """
    ref = sdpa_reference(sdpa_model, rows)
    with torch.no_grad():
        logits = m3_forward()
    if offsets is None:
        offsets = [logits.shape[1] - len(r) for r in rows]
    bounds = [tol * max(1.0, want.abs().max().item()) for want in ref.logits]
    errs = row_errors(logits, ref.logits, offsets)
    replay_errs, diffs = [None] * len(rows), [[] for _ in rows]
    if any(e > bd for (e, _), bd in zip(errs, bounds)):
        selections = SelectionRecorder(ref.selections, offsets, replay=True, score_limit=score_limit)
        routing = RoutingRecorder(ref.routing, offsets, logits.shape[1], replay=True, score_limit=score_limit)
        with selections.attach(m3_model), routing.attach(m3_model), torch.no_grad():
            replayed = m3_forward()
        replay_errs = [e for e, _ in row_errors(replayed, ref.logits, offsets)]
        for d in sorted(selections.diffs + routing.diffs, key=lambda d: (d.layer, d.position)):
            diffs[d.row].append(d)
    return [
        RowCheck(b, errs[b][0], bounds[b], errs[b][1], ref.logits[b], replay_errs[b], diffs[b])
        for b in range(len(rows))
    ]


def assert_prefill_matches_sdpa(m3_model, m3_forward, sdpa_model, rows, **kwargs) -> list[RowCheck]:
    """:func:`check_prefill`, raising AssertionError on a row that disagrees."""
    checks = check_prefill(m3_model, m3_forward, sdpa_model, rows, **kwargs)
    bad = [f"row {c.row}: {c.message}" for c in checks if c.verdict == "disagree"]
    assert not bad, "\n".join(bad)
    return checks
