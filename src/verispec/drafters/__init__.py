"""Drafters: everything that proposes tokens for the target to verify."""

from verispec.drafters.base import DraftContext, Drafter, DraftSession, Proposal
from verispec.drafters.draft_model import DraftModel
from verispec.drafters.ngram import NgramDrafter

__all__ = ["DraftContext", "DraftModel", "NgramDrafter", "DraftSession", "Drafter", "Proposal"]
