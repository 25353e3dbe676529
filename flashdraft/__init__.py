"""flashdraft: lossless speculative decoding for one large language model on one GPU."""
from importlib import import_module

__version__ = "0.1.0"
# Loaded on first use, so that commands which need no model (`flashdraft models list`)
# start without importing torch.
_EXPORTS = {"LLM": "api", "RequestOutput": "api", "StreamDelta": "api",
            "SamplingParams": "config", "EngineConfig": "config", "ModelConfig": "config",
            "RequestMetrics": "engine"}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'flashdraft' has no attribute {name!r}")
