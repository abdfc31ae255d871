"""The training-time test (TTT) objective of EAGLE-3 drafts: the draft unrolled over cached target features.

Recipe (REFERENCE §4): the draft is unrolled ``ttt_length`` steps per position. Step 0 reads ``fc(target features)``
at base position t with the embedding of token t+1; step k reads the pre-norm output of step k-1 at the same base
position with the embedding of token t+1+k, at position t+k, and attends causally to the step-0 keys plus the
same-base keys of steps 1..k (exactly what it sees at inference). Step k is trained against the target's
distribution at position t+1+k restricted to the draft vocabulary (soft cross-entropy), on response positions whose
target argmax is in the draft vocabulary, weighted 0.8**k. With ``loss="lk"`` or ``"mixed"`` an acceptance term
(:func:`acceptance_loss`) replaces or joins that cross-entropy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.modeling_eagle3 import Eagle3DraftModel


LOSS_KINDS = ("ce", "lk", "mixed")
"""The objectives of :func:`ttt_loss`: ``ce`` (soft cross-entropy, the reference), ``lk`` (the acceptance term
alone), ``mixed`` (cross-entropy + ``lk_weight`` x the acceptance term)."""


def acceptance_loss(probs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The acceptance term of each position: ``1 - sum_x min(p(x), q(x))``, with ``q = softmax(logits)``.

    Under speculative sampling a token drafted from ``q`` is accepted by a target sampling from ``p`` with probability
    ``sum_x min(p(x), q(x))`` (the overlap of the two distributions, ``alpha``), so this term is the rejection
    probability, which equals the total variation distance ``TV(p, q) = 1/2 sum_x |p(x) - q(x)|``; it lies in
    [0, 1] and is 0 exactly where ``q == p``.

    Source: "LK Losses: Direct Acceptance Rate Optimization for Speculative Decoding" (Samarin et al., arXiv
    2602.23881). Its two named losses are built on this term: LK-lambda, ``lambda * KL(p || q) + (1 - lambda) * TV``
    with an adaptive weight ``lambda = exp(-eta * alpha)`` (``eta = 3``; NVIDIA Model Optimizer's implementation
    detaches ``lambda``), and LK-alpha, ``-log(alpha)``. vLLM speculators exposes the same term as its ``tv`` loss.
    This function is the TV term only (what ``--loss lk`` trains); ``--loss mixed`` adds it with a fixed weight to
    the soft cross-entropy (cross-entropy against ``p`` differs from ``KL(p || q)`` by ``p``'s entropy, a constant, so
    its gradients are KL's); neither the adaptive weight nor ``-log(alpha)`` is implemented here.

    Here ``p`` is the trainer's soft label (the target's distribution restricted to the draft vocabulary and
    renormalised there, at the run's target temperature) and ``q`` the draft's distribution over its vocabulary.
    The renormalised ``p`` is at least the target's own probability on every drafted token, so ``alpha`` here is an
    upper bound of the acceptance probability against the full target distribution (equal where the draft vocabulary
    holds all of the target's mass).

    Args:
        probs: the target's distribution ``p`` [..., V] (rows sum to 1; no gradient flows into it).
        logits: the draft's logits [..., V].

    Returns:
        ``1 - sum(min(p, softmax(logits)))`` [...], in float32 or wider.
    """
    q = logits.float().softmax(-1)
    return 1.0 - torch.minimum(probs.to(q.dtype), q).sum(-1)


class ConcatKVCache:
    """A KV cache that concatenates (autograd-safe), with the interface the draft's attention uses."""

    def __init__(self):
        self.keys = None
        self.values = None

    def get_seq_length(self) -> int:
        """Number of cached positions."""
        return 0 if self.keys is None else self.keys.shape[2]

    def update(self, k, v):
        """Append ``k``/``v`` and return all keys/values."""
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        return self.keys, self.values


class TTTAttention:
    """The attention pattern of the training-time test, computed in O(m^2 + k m) instead of O(k m^2).

    Passed as the draft's ``cache``: step 0 attends causally to its own keys; step s attends to the step-0 keys
    causally plus, at its own base position, the keys of steps 1..s. Equivalent to SDPA over the concatenated keys
    with :func:`ttt_attention_mask`.
    """

    def __init__(self):
        self.keys: list = []
        self.values: list = []

    def get_seq_length(self) -> int:
        """Number of steps' keys held (each of the full sequence length)."""
        return sum(k.shape[2] for k in self.keys)

    def attend(self, q, k, v, window=None):
        """Store this step's ``k``/``v`` ([B, kv_heads, m, D]) and attend ``q`` ([B, heads, m, D]) over all steps.

        Raises:
            ValueError: for a sliding-window draft whose window binds here: this attention has no window. A window
                binds when a query is ``window`` or more positions after a key it attends (step s at base position
                t sits at position t + s and attends position 0); below that, the draft computes what it would with
                the window, and sliding-window drafts (speculators' default) train and evaluate exactly.
        """
        step, m = len(self.keys), q.shape[2]
        if window is not None and m - 1 + step >= window:
            raise ValueError(f"The draft's sliding window ({window}) binds on these sequences ({m} positions, step "
                             f"{step + 1}) and the training-time-test attention has no window: cut the sequences "
                             f"below {window - step} tokens (--max-prompt-context, shorter answers), or set "
                             "`draft_sliding_window = None` to train a full-attention draft.")
        self.keys.append(k)
        self.values.append(v)
        groups = q.shape[1] // k.shape[1]

        def expand(x):
            return x.repeat_interleave(groups, dim=1) if groups > 1 else x

        scale = q.shape[-1] ** -0.5
        k0, v0 = expand(self.keys[0]), expand(self.values[0])
        m = q.shape[2]
        scores = (q @ k0.transpose(-1, -2)).float() * scale
        causal = torch.ones(m, m, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        diag = [((q * expand(kj)).sum(-1, keepdim=True)).float() * scale for kj in self.keys[1:]]
        weights = torch.cat([scores] + diag, dim=-1).softmax(-1).to(q.dtype)
        out = weights[..., :m] @ v0
        for j, vj in enumerate(self.values[1:]):
            out = out + weights[..., m + j : m + j + 1] * expand(vj)
        return out


def ttt_attention_mask(m: int, step: int, device=None) -> torch.Tensor:
    """Bool mask [m, (step + 1) * m] of TTT step ``step``: causal over step-0 keys, diagonal over steps 1..step."""
    causal = torch.ones(m, m, dtype=torch.bool, device=device).tril()
    eye = torch.eye(m, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1)


def ttt_forward(draft: Eagle3DraftModel, features: torch.Tensor, input_ids: torch.LongTensor, ttt_length: int = 7):
    """Unroll the draft ``ttt_length`` steps over every base position of a batch.

    Args:
        draft: the draft (bound to an embedding).
        features: captured target features [B, n, 3T].
        input_ids: tokens [B, n] (target vocabulary).
        ttt_length: unrolled steps.

    Returns:
        A list of ``ttt_length`` pre-norm hidden states [B, n - 1, H]; entry k at base position t is what the draft
        computes at inference on its (k+1)-th step after the real features up to t, fed tokens t+1 .. t+1+k.
    """
    b, n = input_ids.shape
    m = n - 1  # base positions t = 0..n-2 (token t+1 exists)
    hidden = draft.project_features(features[:, :m])
    tokens_all = F.pad(input_ids, (0, ttt_length + 1))
    cache = TTTAttention()
    base = torch.arange(m, device=input_ids.device)[None].expand(b, m)
    outs = []
    for k in range(ttt_length):
        out = draft(
            input_ids=tokens_all[:, 1 + k : 1 + k + m],
            hidden_states=hidden,
            position_ids=base + k,
            cache=cache,
            logits_to_keep=-1,
        )
        hidden = out.hidden_states
        outs.append(hidden)
    return outs


def ttt_loss(
    draft: Eagle3DraftModel,
    features: torch.Tensor,
    input_ids: torch.LongTensor,
    target_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    ttt_length: int = 7,
    step_decay: float = 0.8,
    target_temperature: float = 1.0,
    loss: str = "ce",
    lk_weight: float = 1.0,
):
    """Compute the TTT loss of one batch.

    Args:
        draft: the draft being trained (bound to an embedding).
        features: captured target features [B, n, 3T].
        input_ids: tokens [B, n] (target vocabulary).
        target_logits: the target's logits restricted to the draft vocabulary [B, n, Vd]; position i predicts
            token i + 1.
        loss_mask: [B, n] float/bool weights; position i counts (with its weight) when it predicts a response token
            whose target argmax is in the draft vocabulary.
        ttt_length: unrolled draft steps.
        step_decay: step k is weighted ``step_decay ** k``.
        target_temperature: the soft labels are ``softmax(target_logits / target_temperature)``; 1 is the reference
            recipe (the target's own distribution), below 1 sharpens them towards the target's argmax, which is what
            greedy verification accepts (towards 0 the loss becomes cross-entropy on the argmax). The accuracy
            statistics do not depend on it.
        loss: the per-position objective: ``"ce"`` (the default and the reference: the soft cross-entropy
            ``-sum_x p(x) log q(x)``), ``"lk"`` (the acceptance term ``1 - sum_x min(p(x), q(x))``, see
            :func:`acceptance_loss`) or ``"mixed"`` (cross-entropy + ``lk_weight`` x the acceptance term); ``p`` is the
            soft label in all three.
        lk_weight: weight of the acceptance term in ``"mixed"`` (> 0; unused otherwise).

    Returns:
        ``(loss, stats)``: the sum over steps (weighted ``step_decay ** k``) of each step's weighted mean
        per-position objective over its counted positions, and per-step ``loss`` (that mean), ``acc`` (draft argmax
        == target argmax, weighted alike), ``overlap`` (the weighted mean of ``sum_x min(p(x), q(x))``, the
        acceptance probability under speculative sampling against the soft labels, whatever ``loss`` is) and
        ``count`` lists.
    """
    if not target_temperature > 0:
        raise ValueError(f"target_temperature must be > 0 (1 = the target's distribution), got {target_temperature}")
    if loss not in LOSS_KINDS:
        raise ValueError(f"loss={loss!r}: use one of {', '.join(LOSS_KINDS)} (ce = soft cross-entropy, the reference)")
    if loss == "mixed" and not (0 < lk_weight < float("inf")):
        raise ValueError(f"lk_weight must be a finite number > 0 for loss='mixed' (loss='ce' trains without the "
                         f"acceptance term), got {lk_weight}")
    kind = loss
    m = input_ids.shape[1] - 1
    pad = ttt_length + 1  # pad once so that every step reads a window [1 + k, 1 + k + m)
    probs_all = F.pad((target_logits.float() / target_temperature).softmax(-1), (0, 0, 0, pad))
    argmax_all = F.pad(target_logits.argmax(-1), (0, pad))
    mask_all = F.pad(loss_mask.float(), (0, pad))
    total = features.new_zeros((), dtype=torch.float32)
    stats = {"loss": [], "acc": [], "overlap": [], "count": []}
    for k, hidden in enumerate(ttt_forward(draft, features, input_ids, ttt_length)):
        window = slice(1 + k, 1 + k + m)
        sel = mask_all[:, window] > 0  # the LM head and the loss only where the position counts
        count = int(sel.sum())
        stats["count"].append(float(count))
        if count == 0:  # nothing to learn here; keep every weight in the graph so that backward (and DDP) run
            total = total + 0.0 * draft.compute_logits(hidden[:, :1]).float().sum()
            stats["loss"].append(0.0)
            stats["acc"].append(0.0)
            stats["overlap"].append(0.0)
            continue
        weight = mask_all[:, window][sel]
        logits = draft.compute_logits(hidden[sel]).float()
        probs = probs_all[:, window][sel]
        lk_pos = None if kind == "ce" else acceptance_loss(probs, logits)
        if kind == "ce":
            per_pos = -(probs * logits.log_softmax(-1)).sum(-1)
        elif kind == "lk":
            per_pos = lk_pos
        else:
            per_pos = -(probs * logits.log_softmax(-1)).sum(-1) + lk_weight * lk_pos
        step_loss = (per_pos * weight).sum() / weight.sum()
        total = total + (step_decay**k) * step_loss
        with torch.no_grad():
            acc = ((logits.argmax(-1) == argmax_all[:, window][sel]).float() * weight).sum() / weight.sum()
            rejected = acceptance_loss(probs, logits) if lk_pos is None else lk_pos
            overlap = ((1.0 - rejected) * weight).sum() / weight.sum()
        stats["loss"].append(float(step_loss.detach()))
        stats["acc"].append(float(acc))
        stats["overlap"].append(float(overlap))
    return total, stats


class TTTObjective(torch.nn.Module):
    """The TTT loss as a module: data-parallel wrappers (DDP through ``accelerate``) synchronise gradients only for
    work done inside their ``forward``, and the loss calls the draft ``ttt_length`` times plus its LM head.

    Args:
        draft: the draft being trained (bound to an embedding).
        ttt_length: unrolled draft steps.
        target_temperature: temperature of the soft labels (see :func:`ttt_loss`).
        loss: the objective, one of :data:`LOSS_KINDS` (see :func:`ttt_loss`).
        lk_weight: weight of the acceptance term with ``loss="mixed"``.
    """

    def __init__(self, draft: Eagle3DraftModel, ttt_length: int, target_temperature: float = 1.0, loss: str = "ce",
                 lk_weight: float = 1.0):
        super().__init__()
        self.draft = draft
        self.ttt_length = ttt_length
        self.target_temperature = target_temperature
        self.loss = loss
        self.lk_weight = lk_weight

    def forward(self, features, input_ids, target_logits, loss_mask):
        """Return ``ttt_loss(draft, ...)``: the loss and the per-step statistics."""
        return ttt_loss(self.draft, features, input_ids, target_logits, loss_mask, self.ttt_length,
                        target_temperature=self.target_temperature, loss=self.loss, lk_weight=self.lk_weight)
