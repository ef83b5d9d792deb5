"""Drafters: everything that proposes tokens for the target to verify."""

from verispec.drafters.base import DraftContext, Drafter, DraftSession, Proposal
from verispec.drafters.draft_model import DraftModel

__all__ = ["DraftContext", "DraftModel", "DraftSession", "Drafter", "Proposal"]
