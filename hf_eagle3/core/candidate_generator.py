"""EAGLE-3 chain drafting as a Transformers ``CandidateGenerator`` (Transformers' assisted-decoding loop runs it).

The ``generate`` hook that selects it lives in ``generate_hook.py``.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig
from transformers.generation import CandidateGenerator

from .budget import RoundOutcome, chain_budget
from .cost_model import Stopwatch
from .draft_state import Eagle3DraftState
from .draft_steps import chain_step
from .feature_capture import Eagle3OutputFeatures
from .logits_process import Eagle3D2TLogitsProcessor
from .settings import DEFAULT_DRAFT_LENGTH, SCHEDULES
from .stats import Eagle3Stats, publish_stats


class Eagle3CandidateGenerator(CandidateGenerator):
    r"""
    `CandidateGenerator` that proposes a chain of tokens with an EAGLE-3 draft fed by the target's own hidden states.

    The target's features arrive through an [`Eagle3FeatureCapture`] installed for the ``generate`` call. Each round
    the draft first consumes the features of the positions the target verified since it last ran (paired with the
    token that followed each), then drafts ``num_assistant_tokens`` tokens, feeding its own pre-norm output forward.
    The draft keeps its KV cache across rounds and crops the drafted (speculative) part at the start of the next round.

    The first round has no features yet, so it proposes nothing: the target's prefill produces the first token.

    Args:
        draft (`Eagle3DraftModel`): the draft, already bound to the target.
        capture (`Eagle3FeatureCapture`): hooks on the target.
        input_ids (`torch.LongTensor`): the prompt.
        generation_config (`GenerationConfig`): the target's generation config for this call.
        logits_processor (`LogitsProcessorList`): the target's processors; applied to the draft's scores (over the
            target vocabulary) when sampling, so that the returned candidate logits are the distribution the
            candidates were sampled from.
        num_assistant_tokens (`int`): draft tokens per round (initial value for the heuristic schedules, the longest
            draft for ``"auto"``).
        num_assistant_tokens_schedule (`str`): ``"constant"``, ``"heuristic"`` (+2 after a fully accepted round,
            -1 otherwise, kept on the draft's generation config after the call), ``"heuristic_transient"`` (same,
            not kept) or ``"auto"`` (each round the length, 0 included, with the most expected tokens per second
            under the round costs of this machine and the acceptance seen so far; see
            :class:`~hf_eagle3.core.budget.ChainBudget`).
        assistant_confidence_threshold (`float`): stop drafting in a round once the draft's probability of its own
            token falls below this (0 disables it; when set, each draft step reads one value back from the device).
        target (`PreTrainedModel`, *optional*): the target, whose costs ``"auto"`` looks up (required for it).
        recurrent_target (`bool`, *optional*): the target has recurrent / linear-attention layers, whose roll-back
            history Transformers sizes once per call by :attr:`num_drafting_tokens`: no round then drafts more than
            the initial ``num_assistant_tokens`` (the heuristic schedules grow up to it, not beyond).

    With an :class:`~hf_eagle3.core.feature_capture.Eagle3OutputFeatures` as ``capture``, the generator follows
    Transformers' public protocol for drafters that read the target: ``requires_model_outputs`` is set, the target is
    called with :attr:`model_kwargs_overrides` (the selected hidden states) and each round's ``get_candidates``
    receives its outputs.
    """

    def __init__(
        self,
        draft,
        capture,
        input_ids: torch.LongTensor,
        generation_config: GenerationConfig,
        logits_processor=None,
        num_assistant_tokens: int = DEFAULT_DRAFT_LENGTH,
        num_assistant_tokens_schedule: str = "constant",
        assistant_confidence_threshold: float | None = 0.0,
        target=None,
        recurrent_target: bool = False,
    ):
        if num_assistant_tokens_schedule not in SCHEDULES:
            raise ValueError(
                f"num_assistant_tokens_schedule={num_assistant_tokens_schedule!r}: EAGLE-3 supports "
                f"{', '.join(repr(s) for s in SCHEDULES)}."
            )
        if int(num_assistant_tokens) < 1:
            raise ValueError(f"num_assistant_tokens must be >= 1, got {num_assistant_tokens}")
        if num_assistant_tokens_schedule == "auto" and target is None:
            raise ValueError("num_assistant_tokens_schedule='auto' needs the target (to price its forwards).")
        self.draft = draft
        self.step = draft.step_call(chain_step)  # eager, or compiled (the draft's generation config)
        self.capture = capture
        self.target = target
        self.device = draft.fc.weight.device
        self.dtype = draft.fc.weight.dtype
        self.d2t = Eagle3D2TLogitsProcessor(draft.d2t, draft.config.vocab_size)
        self.logits_processor = logits_processor if logits_processor is not None else []
        self.do_sample = bool(generation_config.do_sample)
        # Static-ensemble verification (Transformers 5.24+) weighs the draft's distribution in, greedy too: the
        # candidate logits are then returned whether sampling or not.
        self.ensemble = getattr(generation_config, "assistant_ensemble_weight", None) is not None
        self.max_length = generation_config.max_length
        self.num_assistant_tokens = int(num_assistant_tokens)
        self.schedule = num_assistant_tokens_schedule
        self.confidence_threshold = float(assistant_confidence_threshold or 0.0)
        self.max_draft_tokens = self.num_assistant_tokens if recurrent_target else None
        self.requires_model_outputs = isinstance(capture, Eagle3OutputFeatures)
        self.model_kwargs_overrides = (capture.model_kwargs_overrides(generation_config)
                                       if self.requires_model_outputs else {})
        # the draft's cache, fed positions and pending verified positions
        self.state = Eagle3DraftState(draft, capacity=generation_config.max_length + 1)
        self.stats = Eagle3Stats()
        self.budget = (chain_budget(target, draft, input_ids, self.num_assistant_tokens, masked=False,
                                    horizon=self.max_length - input_ids.shape[1])
                       if num_assistant_tokens_schedule == "auto" else None)
        self.stopwatch = Stopwatch(self.device) if self.budget is not None else None
        self._last_len = input_ids.shape[1]  # length of the sequence handed to the target last round
        self._last_k = 0  # tokens drafted last round
        self._round = None  # "auto": the round's plan, positions fed and marks (started, fed, drafted)
        self._round_from = None  # "auto": the end mark of the last round (where this round's time starts)

    @property
    def num_drafting_tokens(self) -> int:
        """The most tokens a round drafts (Transformers >= 5.25 keeps that many recurrent states of a hybrid target)."""
        return self.num_assistant_tokens if self.max_draft_tokens is None else self.max_draft_tokens

    def get_candidates(
        self, input_ids: torch.LongTensor, model_outputs=None, **kwargs
    ) -> tuple[torch.LongTensor, torch.FloatTensor | None]:
        """
        Fetches the candidates to be tried for the current input.

        Args:
            input_ids (`torch.LongTensor` of shape `(1, sequence_length)`): the sequence so far.
            model_outputs (`ModelOutput`, *optional*): the target's outputs of the last round (``None`` before the
                prefill), handed over by Transformers when :attr:`requires_model_outputs` is set.

        Return:
            `(candidate_input_ids, candidate_logits)`: the sequence followed by the drafted tokens, and (when
            sampling, or with ``assistant_ensemble_weight``) the processed draft scores over the target vocabulary
            `(1, k, vocab_size)`, else `None`.
        """
        started = self._mark()
        cur_len = input_ids.shape[1]
        if self.requires_model_outputs:
            self.capture.receive(model_outputs)
        self._collect_features(input_ids)
        self._last_len, self._last_k, self._round = cur_len, 0, None
        if not self.state.num_pending and self.state.fed == 0:  # first round: the target has not run yet
            return input_ids, None
        k = min(self.num_assistant_tokens, self.max_length - cur_len - 1)
        feed = cur_len - 1 - self.state.fed
        if self.budget is not None:
            plan = self.budget.plan(feed=feed, room=k)
            self._round = [plan, feed, started, None, started]
            k = plan.total
        if k <= 0:  # max_length reached, or "auto" drafts nothing: a plain target step, the feed waits
            return input_ids, None
        ids = input_ids.to(self.device)
        out = self.state.feed()
        if self._round is not None:
            self._round[3] = self._mark()
        tokens, scores = [], []
        seq = ids
        for step in range(k):
            token, processed = self._select(seq, out.logits[:, -1])
            tokens.append(token)
            if processed is not None:
                scores.append(processed)
            seq = torch.cat([seq, token[:, None]], dim=-1)
            if self.confidence_threshold > 0 and step < k - 1:
                probs = (processed if processed is not None else self.d2t(seq, out.logits[:, -1].float())).softmax(-1)
                if probs[0, token[0]].item() < self.confidence_threshold:
                    break
            if step == k - 1:
                break
            out = self.state.step(self.step, token[:, None], out.hidden_states[:, -1:], cur_len - 1 + step)
        self._last_k = len(tokens)
        if self._round is not None:
            self._round[4] = self._mark()
        candidate_logits = torch.stack(scores, dim=1) if scores else None
        return seq, candidate_logits

    def _collect_features(self, input_ids: torch.LongTensor) -> None:
        """Keep the verified part of the target's last forward (positions ``< cur_len - 1``) for the next feed."""
        known = self.state.fed + self.state.num_pending
        # The target's last forward ended at the previous length + the previous k; what it verified is followed by
        # the tokens ``known + 1 .. cur_len - 1`` of the sequence.
        self.state.collect(self.capture, input_ids[0, known + 1 :], end=self._last_len + self._last_k)

    def _mark(self):
        """A mark on the device's timeline for ``"auto"`` (``None`` otherwise)."""
        return self.stopwatch.mark() if self.stopwatch is not None else None

    def _observe(self, accepted: int) -> None:
        """``"auto"``: hand the finished round to the budget (its plan, acceptance and times; the round's time runs
        from the previous round's end to this one's, so Transformers' bookkeeping is counted once)."""
        ended, watch = self._mark(), self.stopwatch
        if self._round is not None:
            plan, feed, started, fed_at, drafted_at = self._round
            drafted = self._last_k > 0
            self.budget.observe(RoundOutcome(
                plan._replace(depth=self._last_k, total=self._last_k), [self._last_k], [accepted], feed,
                self._last_k + 1, watch.seconds(self._round_from or started, ended),
                verify_seconds=watch.seconds(drafted_at, ended),
                draft_seconds=watch.seconds(started, drafted_at) if drafted else 0.0,
                feed_seconds=watch.seconds(started, fed_at) if drafted else 0.0, levels=self._last_k))
        self._round_from = ended

    def _select(self, seq: torch.LongTensor, draft_scores: torch.FloatTensor):
        """Pick the next draft token (target id) from draft-vocabulary scores; return it and the processed scores
        (``None`` when greedy without ``assistant_ensemble_weight``: Transformers' loop then compares tokens only)."""
        if not self.do_sample and not self.logits_processor and not self.ensemble:
            return self.d2t.map_tokens(draft_scores.argmax(-1)), None
        scores = self.d2t(seq, draft_scores.float())
        for processor in self.logits_processor:  # greedy too, as Transformers' assisted decoding does
            scores = processor(seq, scores)
        if not self.do_sample:
            return scores.argmax(-1), (scores if self.ensemble else None)
        token = torch.multinomial(scores.softmax(-1), num_samples=1)[:, 0]
        return token, scores

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        """
        Records the round's acceptance and adapts the draft length for the heuristic schedules.

        Args:
            input_ids (`torch.LongTensor`): the sequence after this round.
            scores (`torch.FloatTensor`): the target's processed scores of this round.
            num_matches (`int`): how many drafted tokens were accepted.
        """
        num_matches = int(num_matches)
        self.stats.record(self._last_k, num_matches)
        if self.budget is not None:
            self._observe(num_matches)
        if self._last_k and self.schedule in ("heuristic", "heuristic_transient"):
            if num_matches == self._last_k:
                self.num_assistant_tokens += 2
            else:
                self.num_assistant_tokens = max(1, self.num_assistant_tokens - 1)
            if self.max_draft_tokens is not None:
                self.num_assistant_tokens = min(self.num_assistant_tokens, self.max_draft_tokens)

    def finish(self) -> Eagle3Stats:
        """End of the call: persist the heuristic draft length and publish the statistics on the draft."""
        if self.schedule == "heuristic":
            self.draft.generation_config.num_assistant_tokens = self.num_assistant_tokens
        return publish_stats(self.draft, [self.stats], self.budget)
