"""Speculative decoding: draft γ tokens cheaply, verify them in one target forward, keep the
target's law.

    rejection_sampler.py  the algorithm: accept with min(1, p/q), resample from the residual, the
                          exact law
    proposers.py          where drafts come from: n-gram lookup, a draft model with its own paged
                          cache
    medusa.py             Medusa heads: drafts from the target's own hidden states (trained:
                          tools/train_medusa.py)
    reference.py          the whole loop for one sequence over toy models (for reading and for
                          tests)
    spec_decode.py        the engine's path: per-request γ, batched proposals, verification,
                          rollback

Taught in notebooks/08_*.
"""
