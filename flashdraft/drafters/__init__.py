from .base import Draft, DraftContext, Drafter
from .draft_model import DraftModelDrafter
from .ngram import NgramDrafter
from .registry import DrafterSpec, make_drafter, parse_drafter_spec

__all__ = ["Draft", "DraftContext", "Drafter", "DraftModelDrafter", "DrafterSpec",
           "NgramDrafter", "make_drafter", "parse_drafter_spec"]
