"""Drafters: everything that proposes tokens for the target to verify."""

from verispec.drafters.base import DraftContext, Drafter, DraftSession, Proposal
from verispec.drafters.by_length import LengthSwitchDrafter
from verispec.drafters.combined import CombinedDrafter, lookup_then_model
from verispec.drafters.draft_model import DraftModel, DraftModelSettings
from verispec.drafters.ngram import LookupRule, NgramDrafter

__all__ = ["CombinedDrafter", "DraftContext", "DraftModel", "DraftModelSettings", "LengthSwitchDrafter", "LookupRule", "NgramDrafter", "DraftSession", "Drafter", "Proposal", "lookup_then_model"]
