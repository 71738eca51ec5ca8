"""Speculative-decoding proposers: after a step samples, they guess each decoding request's next
tokens (drafts), which the scheduler schedules as extra new tokens and the runner verifies in the
next step's forward pass (tessera/sampling/rejection_sampler.py)."""

from tessera.worker.spec_decode.draft_model import DraftModelProposer, DraftRequest
from tessera.worker.spec_decode.ngram import NgramProposer

__all__ = ["DraftModelProposer", "DraftRequest", "NgramProposer"]
