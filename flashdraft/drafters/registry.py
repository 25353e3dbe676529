"""Drafters by name: the one place that maps a spec string to a drafter.

    ngram             prompt lookup with the configured n-gram sizes (EngineConfig.ngram_sizes)
    ngram:4,3         prompt lookup with these sizes
    model:PATH        a draft model of the target's tokenizer: a directory, .gguf file, hub id
                      or example alias (model:example:qwen2.5-coder-0.5b)
    PATH              the same as model:PATH, as before kinds had names
    dflash:PATH       a DFlash block drafter for the target (drafters.dflash): a directory in
                      the public format, or a hub id in the local cache
    A+B               several of the above (not DFlash), one proposal a step: the one expected
                      to give the most tokens per second (drafters.combined), e.g.
                      ngram+model:example:qwen2.5-coder-0.5b

Other code asks `parse_drafter_spec` what a spec is (e.g. whether it loads a model) instead of
comparing names.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from types import SimpleNamespace

from ..config import EngineConfig
from ..loading import Loaded, load_model
from ..loading.hf import load_tokenizer, resolve_hf
from ..scheduling import weight_bytes
from .base import Drafter
from .combined import BestOfDrafters
from .dflash import make_dflash_drafter
from .draft_model import DraftModelDrafter
from .ngram import NgramDrafter

NGRAM, MODEL, DFLASH, COMBINED = "ngram", "model", "dflash", "combined"
# Each kind as a user writes it, for error messages.
KINDS = {NGRAM: "ngram[:SIZES]", MODEL: "model:PATH", DFLASH: "dflash:PATH",
         COMBINED: "A+B (e.g. ngram+model:PATH)"}
# A spec's "word:" that names no kind but is part of a model reference (loading.examples).
_MODEL_PREFIXES = ("example",)
_KIND = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")


@dataclass(frozen=True)
class DrafterSpec:
    kind: str  # one of KINDS
    arg: str  # the kind's argument: n-gram sizes ("" for the configured ones) or a model path
    parts: tuple["DrafterSpec", ...] = ()  # a combination's drafters

    @property
    def model(self) -> str | None:
        """The model reference whose weights the drafter loads, or None (n-gram lookup)."""
        if self.kind == COMBINED:
            return next((p.model for p in self.parts if p.model), None)
        return self.arg if self.kind in (MODEL, DFLASH) else None

    @property
    def builds_trees(self) -> bool:
        """Whether it proposes token trees where asked to (a draft model, DFlash)."""
        return self.kind in (MODEL, DFLASH) or any(p.builds_trees for p in self.parts)


def known_kinds() -> str:
    return ", ".join(KINDS.values())


def parse_drafter_spec(spec: str) -> DrafterSpec:
    """What `spec` asks for; a ValueError naming it where it is no drafter."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a drafter spec must be a non-empty string, got {spec!r}; "
                         f"known kinds: {known_kinds()}")
    if "+" in spec:
        parts = tuple(parse_drafter_spec(part) for part in spec.split("+"))
        if any(p.kind in (DFLASH, COMBINED) for p in parts):
            raise ValueError(f"drafter {spec!r}: a DFlash drafter reads the target's hidden "
                             f"states at every step and does not combine; use it alone")
        return DrafterSpec(COMBINED, spec, parts)
    kind, sep, arg = spec.partition(":")
    if kind == NGRAM:
        if sep:
            ngram_sizes(arg, spec)  # checked here, where the user reads the error
        return DrafterSpec(NGRAM, arg)
    if kind in KINDS:
        if not arg:
            raise ValueError(f"drafter {spec!r} names no model; write {kind}:PATH")
        return DrafterSpec(kind, arg)
    # "word:…" that is no model reference (a Windows drive letter is one letter): a typo'd or
    # unknown kind, not a path to try loading.
    if sep and _KIND.fullmatch(kind) and len(kind) > 1 and kind not in _MODEL_PREFIXES:
        raise ValueError(f"unknown drafter kind {kind!r} in {spec!r}; known kinds: "
                         f"{known_kinds()} (a draft model whose path has a colon: model:PATH)")
    return DrafterSpec(MODEL, spec)


def ngram_sizes(text: str, spec: str) -> tuple[int, ...]:
    """"4,3,2" -> (4, 3, 2), longest first."""
    try:
        sizes = tuple(int(n) for n in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or any(n < 1 for n in sizes):
        raise ValueError(f"drafter {spec!r}: n-gram sizes must be whole numbers >= 1 separated "
                         f"by commas, e.g. ngram:4,3,2, got {text!r}")
    return tuple(sorted(set(sizes), reverse=True))


def make_drafter(spec: str, target: Loaded, cfg: EngineConfig, device, dtype) -> Drafter:
    """The drafter `spec` names, for requests to `target`: cfg gives the defaults (n-gram sizes, the draft model's quantization, kernels,
    CUDA graphs, decode kernel)."""
    s = parse_drafter_spec(spec)
    if s.kind == COMBINED:
        parts = [make_drafter(p.arg if p.kind == MODEL else _spec_text(p), target, cfg, device,
                              dtype) for p in s.parts]
        return BestOfDrafters(parts, [drafting_cost(d, target.model) for d in parts])
    if s.kind == NGRAM:
        return NgramDrafter(ngram_sizes(s.arg, spec) if s.arg else cfg.ngram_sizes, device)
    if s.kind == DFLASH:  # it runs on the target's own embedding and LM head
        path = resolve_hf(s.arg)
        if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
            check_same_tokenizer(target, SimpleNamespace(tokenizer=load_tokenizer(path),
                                                         source=str(path)))
        # Its block pass as CUDA graphs wherever the device is CUDA, unless graphs are off.
        return make_dflash_drafter(path, target.model, device, dtype,
                                   cuda_graphs=None if cfg.cuda_graphs else False)
    draft = load_model(s.arg, dtype, device, cfg.draft_quant, kernel_config=cfg.kernels)
    check_same_tokenizer(target, draft)
    return DraftModelDrafter(draft.model, device, dtype, target.config.vocab_size,
                             cuda_graphs=cfg.cuda_graphs, decode_kernel=cfg.decode_kernel)


def _spec_text(s: DrafterSpec) -> str:
    return f"{s.kind}:{s.arg}" if s.arg else s.kind


def drafting_cost(drafter, target_model) -> float:
    """A drafted token's cost over the target's step: a draft model's weight bytes over the
    target's (a decode step streams its weights once); nothing for lookup."""
    model = getattr(drafter, "model", None)
    return weight_bytes(model) / weight_bytes(target_model) if model is not None else 0.0


def check_same_tokenizer(target: Loaded, draft: Loaded) -> None:
    """Refuse a draft whose tokens mean something else than the target's."""
    a, b = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if a == b:
        return
    only_t = sorted(set(a) - set(b))[:5]
    only_d = sorted(set(b) - set(a))[:5]
    moved = sorted(t for t in set(a) & set(b) if a[t] != b[t])[:5]
    details = []
    if only_t:
        details.append(f"tokens only in the target's: {only_t}")
    if only_d:
        details.append(f"tokens only in the draft's: {only_d}")
    if moved:
        details.append(f"tokens with different ids: {moved}")
    raise ValueError(
        f"the draft model {draft.source} does not share the target's tokenizer: target "
        f"{target.source} has {len(a)} tokens, draft has {len(b)}; " + "; ".join(details)
        + ". Use a draft from the same model family, or --draft ngram.")
