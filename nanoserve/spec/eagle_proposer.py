"""The engine's EAGLE proposer: each speculating row's γ drafts from its features (eagle.py's head).

What it reads. After each forward (a hook in the model runner's `after_forward`) it keeps the
feature of *every* token the forward computed (the model's `keep_hidden = "all"`; `features`: per
sequence, chunks (first position, [n, C])), prefill and
verification included. Before drafting, a row's chunks are merged into its track: its features by
position, a later chunk overwriting from where it starts (a verification's rejected drafts are
overwritten by the next step's, and never used: only positions < num_computed_tokens count).

What it keeps, per sequence (`_Track`): the features f_first .. f_{m-1} and the head's own KV cache
over the positions it has run — head position i reads (f_i, token i + 1), both real. Drafting runs
the head over the positions it has not run yet (a prompt at once), then γ − 1 steps over its own
predictions; those positions' keys and values are dropped again when the drafts are made (next step,
they are real positions or rejected). So there is nothing to roll back after verification: the next
proposal starts from the accepted tokens.

Positions whose features this sequence never computed — a prompt prefix read from the prefix cache,
the prompt of a fork (n > 1) — are missing: the head then runs over the positions it has, from the
first one after the gap. A shorter context costs acceptance, never correctness (verification decides
every token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.sampler import probs_from_logits_batch
from .controller import Stopwatch
from .eagle import EagleHead, token_embedding


@dataclass
class _Track:
    first: int  # the position of feats[0]
    feats: torch.Tensor  # [M, C]: f_first .. f_{first + M − 1}
    # the head's cache [P, H, D] over positions first .. first + P − 1
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @property
    def cached(self) -> int:
        return 0 if self.k is None else self.k.shape[0]

    def truncate_cache(self, n: int) -> None:
        if self.k is not None and self.k.shape[0] > n:
            self.k, self.v = self.k[:n], self.v[:n]


class EagleProposer:
    # the last propose's chain: (its Stopwatch, draft steps, most positions the head ran for a row)
    timing: tuple[Stopwatch | None, int, int]

    def __init__(self, head: EagleHead, runner):
        self.head, self.runner, self.model = head, runner, runner.model
        self.embed = token_embedding(self.model)
        # the model keeps every computed token's feature (models/base.py)
        runner.model.keep_hidden = "all"
        self.features: dict[int, list] = {}  # seq_id -> [(first position, [n, C]), ...] until read
        runner.after_forward.append(self.keep_features)
        self.tracks: dict[int, _Track] = {}  # seq_id -> its features and the head's cache
        self.timing = (None, 0, 0)

    def _absorb(self, seq_id: int) -> _Track | None:
        """Merge the runner's new chunks of features into the sequence's track."""
        track = self.tracks.get(seq_id)
        for start, h in self.features.pop(seq_id, []):
            if track is None or not track.first <= start <= track.first + track.feats.shape[0]:
                # the first chunk, or one after a gap (or a recomputation from earlier)
                track = _Track(start, h)
            else:
                keep = start - track.first
                track.feats = torch.cat([track.feats[:keep], h])
                # head positions ≥ keep read features that were just replaced
                track.truncate_cache(keep)
        if track is not None:
            self.tracks[seq_id] = track
        return track

    @torch.inference_mode()
    def propose(self, rows, matchers=None):
        """rows: (seq, γ, params, generator) -> (draft ids, q [γ, V] or None) each. Drafts ignore a
        grammar (the verification masks the target's logits, and the rejection sampler keeps the
        masked law for any q)."""
        drafts: list[tuple] = [([], None) for _ in rows]
        state = []  # (row, track, real feature count n, its next head input: (feature, token))
        for i, (seq, _, _, _) in enumerate(rows):
            track = self._absorb(seq.seq_id)
            # features f_first .. f_{m−1}
            n = 0 if track is None else seq.num_computed_tokens - track.first
            # and x_m, uncomputed
            if 1 <= n <= track.feats.shape[0] and len(seq) == seq.num_computed_tokens + 1:
                # (a verification's features past the accepted tokens)
                track.feats = track.feats[:n]
                track.truncate_cache(n)
                state.append((i, track, n))
        self.timing = (None, 0, 0)
        if not state:
            return drafts
        gammas = {i: rows[i][1] for i, _, _ in state}
        new_k: dict[int, list] = {i: [] for i, _, _ in state}
        ids: dict[int, list[int]] = {i: [] for i, _, _ in state}
        qs: dict[int, list[torch.Tensor]] = {i: [] for i, _, _ in state}
        last: dict[int, torch.Tensor] = {}  # row -> its latest predicted feature f̂ [C]
        watch, most = Stopwatch(self.runner.device), 1
        for step in range(max(gammas.values())):
            active = [(i, t, n) for i, t, n in state if step < gammas[i]]
            logits = []
            for i, track, n in active:
                seq = rows[i][0]
                # the head's positions not run yet (at least the last): real features and tokens
                if step == 0:
                    track.truncate_cache(n - 1)
                    p = track.cached
                    feats = track.feats[p:n]
                    toks = seq.token_ids[track.first + p + 1: track.first + n + 1]
                    most = max(most, n - p)
                else:  # its own prediction, and the draft drawn from it
                    p, feats, toks = n + step - 1, last[i][None], ids[i][-1:]
                pos = torch.arange(track.first + p, track.first + p + len(toks),
                                   device=feats.device)
                past = self._past(track, new_k[i])
                emb = self.embed(torch.tensor(toks, device=feats.device)).to(feats.dtype)
                out, (k, v) = self.head(feats, emb, pos, past)
                if step == 0:
                    track.k = k if track.k is None else torch.cat([track.k, k])
                    track.v = v if track.v is None else torch.cat([track.v, v])
                else:
                    new_k[i].append((k, v))
                last[i] = out[-1]
                logits.append(self.model.lm_logits(out[-1:]).float())  # 1, V
            self._draw(torch.cat(logits), [rows[i] for i, _, _ in active],
                       [ids[i] for i, _, _ in active],
                       [qs[i] for i, _, _ in active])
        watch.stop()
        self.timing = (watch, max(gammas.values()), most)
        for i, _, _ in state:
            drafts[i] = (ids[i], torch.stack(qs[i]) if qs[i] else None)
        return drafts

    @staticmethod
    def _past(track: _Track, drafted: list) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The head's cache: the real positions', then this proposal's draft positions' (dropped
        afterwards)."""
        if track.k is None:
            return None
        if not drafted:
            return track.k, track.v
        return torch.cat([track.k, *(k for k, _ in drafted)]), torch.cat(
            [track.v, *(v for _, v in drafted)]
        )

    @staticmethod
    def _draw(logits: torch.Tensor, rows, ids: list[list[int]],
              qs: list[list[torch.Tensor]]) -> None:
        """One draft per row of logits [A, V]: the argmax (greedy), or a draw from q at the
        request's settings."""
        tokens = logits.argmax(-1).tolist()
        sampled = [j for j, (_, _, params, _) in enumerate(rows) if not params.greedy]
        if sampled:
            q = probs_from_logits_batch(
                logits[sampled],
                *zip(
                    *[(rows[j][2].temperature, rows[j][2].top_k, rows[j][2].top_p) for j in sampled]
                ),
            )  # S, V
            for m, j in enumerate(sampled):
                tokens[j] = int(torch.multinomial(q[m], 1, generator=rows[j][3]))
                qs[j].append(q[m])
        for j, t in enumerate(tokens):
            ids[j].append(t)

    def rollback(self, seq, num_valid: int, row: int | None = None) -> None:
        """Nothing to undo: the next proposal reads the accepted tokens and their features."""

    def keep_features(self, seqs, num_new: list[int], num_logits: list[int]) -> None:
        """After each target forward: every new token's feature, kept until the head reads it."""
        for i, (seq, n) in enumerate(zip(seqs, num_new)):
            chunk = (seq.num_computed_tokens, self.model.last_hidden[i, :n].clone())  # n, C
            self.features.setdefault(seq.seq_id, []).append(chunk)

    def free(self, seq) -> None:
        self.tracks.pop(seq.seq_id, None)
        self.features.pop(seq.seq_id, None)
