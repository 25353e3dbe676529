from .base import Draft, DraftContext, Drafter
from .draft_model import DraftModelDrafter
from .ngram import NgramDrafter

__all__ = ["Draft", "DraftContext", "Drafter", "DraftModelDrafter", "NgramDrafter"]
