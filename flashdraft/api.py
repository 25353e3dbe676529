"""The Python API, in the style users know from vLLM.

    from flashdraft import LLM, SamplingParams
    llm = LLM(model="example:qwen2.5-coder-1.5b", draft="example:qwen2.5-coder-0.5b")
    out = llm.generate("def fib(n):", SamplingParams(temperature=0.0, max_tokens=64))[0]
    print(out.text, out.metrics.tau)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable, Iterator

import torch

from .config import EngineConfig, KernelConfig, SamplingParams, speculative_tokens
from .drafters import Drafter, make_drafter, parse_drafter_spec
from .engine import Engine, RequestMetrics
from .loading import load_model
from .parallel import TensorParallel, load_shard
from .scheduling import StepCostCache, device_kind, weight_bytes

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
_DEFAULT = object()  # "the drafter this LLM was created with"


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS, a stop token or a stop string) or "length"
    metrics: RequestMetrics


@dataclass
class StreamDelta:
    text: str  # text added since the previous delta
    token_ids: list[int]  # tokens added since the previous delta
    finish_reason: str | None = None
    output: RequestOutput | None = None  # the whole result, on the last delta only


def pick_device_dtype(device: str | None, dtype: str | None) -> tuple[torch.device, torch.dtype]:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but this PyTorch sees no CUDA GPU; "
                         f"use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported; use cpu or cuda[:N]")
    if dtype is None:
        dtype = "bfloat16" if dev.type == "cuda" else "float32"
    return dev, DTYPES[dtype]


class Detokenizer:
    """Incremental decoding: text grows by whole characters only (no half UTF-8 sequences).
    Tokens are taken one at a time, so the text follows from the tokens alone, never from how
    steps grouped them (a speculative step's several tokens read as plain decoding's one by
    one: where a step ended in half a character, the whole step's text would wait for the rest,
    and be lost where the request ended there)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # decode windows start here, so merges across steps stay right
        self._read = 0

    def add(self, ids: list[int]) -> str:
        return "".join([self._add(t) for t in ids])

    def _add(self, token: int) -> str:
        self.ids.append(token)
        decode = lambda a, b: self.tokenizer.decode(self.ids[a:b], skip_special_tokens=True)
        before = decode(self._prefix, self._read)
        window = decode(self._prefix, len(self.ids))
        if window.endswith("\ufffd"):
            return ""  # a character split across tokens: wait for the rest
        new = window[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += new
        return new


class LLM:
    def __init__(self, model: str, draft: str | None = None,
                 num_speculative_tokens: int | str = "auto",
                 dtype: str | None = None, device: str | None = None,
                 max_model_len: int | None = None, ngram_sizes: Iterable[int] = (4, 3, 2),
                 cuda_graphs: bool = True, compile: bool = False,
                 quantization: str | None = None, draft_quantization: str | None = "auto",
                 adaptive_speculation: bool = True, decode_kernel: str = "auto",
                 kernels: KernelConfig = KernelConfig(), tree_widths: Iterable[int] | str = (),
                 tree_budget: int = 0, tensor_parallel: int = 1,
                 step_cost_cache: bool | None = None):
        self.config = EngineConfig(model=model, draft=draft,
                                   num_speculative_tokens=num_speculative_tokens,
                                   ngram_sizes=tuple(ngram_sizes), dtype=dtype, device=device,
                                   max_model_len=max_model_len, cuda_graphs=cuda_graphs,
                                   compile=compile, quantization=quantization,
                                   draft_quantization=draft_quantization,
                                   adaptive_speculation=adaptive_speculation,
                                   decode_kernel=decode_kernel, kernels=kernels,
                                   tree_widths=(tree_widths if isinstance(tree_widths, str)
                                                else tuple(tree_widths)),
                                   tree_budget=tree_budget,
                                   tensor_parallel=tensor_parallel,
                                   step_cost_cache=step_cost_cache)
        # tensor parallelism: this process is one rank, all of which run every request alike
        self.parallel = (TensorParallel.join(tensor_parallel, device) if tensor_parallel > 1
                         else None)
        self.rank = 0 if self.parallel is None else self.parallel.rank  # rank 0 prints
        if self.parallel is not None:
            device = self.parallel.device(device)
        self.device, self.dtype = pick_device_dtype(device, dtype)
        if self.parallel is not None:
            self.target = load_shard(model, self.dtype, self.device, self.parallel, kernels)
            self.parallel.agree_on_seed(self.device)
        else:  # quantized as it loads: the device never holds the full-precision model
            self.target = load_model(model, self.dtype, self.device, quantization,
                                     kernel_config=kernels)
        self.tokenizer = self.target.tokenizer
        limit = self.target.config.max_position_embeddings
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} is beyond the model's context of "
                             f"{limit} tokens; use at most {limit}")
        self.max_model_len = max_model_len or limit
        self.engine = Engine(self.target.model, self.device, self.dtype, self.max_model_len,
                             self.target.config.eos_token_ids, cuda_graphs=cuda_graphs,
                             compile=compile,
                             adaptive=adaptive_speculation and self.parallel is None,
                             decode_kernel=decode_kernel, tree_widths=self.config.tree_widths,
                             tree_budget=self.config.tree_budget,
                             step_cost_cache=self._step_cost_cache())
        self._drafters: dict[str, Drafter] = {}
        self.num_speculative_tokens = self.config.num_speculative_tokens
        self.drafter = self.get_drafter(draft) if draft else None

    def _step_cost_cache(self) -> StepCostCache | None:
        """Where the engine's step costs are kept across runs (EngineConfig.step_cost_cache),
        under what makes them this setup's: the GPU, the target, its dtype, quantization and
        every setting of how its steps run. None: not kept (nor with tensor parallelism, whose
        choices are not timed)."""
        on = self.config.step_cost_cache
        if not (self.device.type == "cuda" if on is None else on) or self.parallel is not None:
            return None
        c = self.config
        return StepCostCache({
            "device": device_kind(self.device), "torch": torch.__version__,
            "model": self.target.source, "weight_bytes": weight_bytes(self.target.model),
            "dtype": str(self.dtype), "quantization": c.quantization,
            "kernels": asdict(c.kernels), "decode_kernel": c.decode_kernel,
            "cuda_graphs": c.cuda_graphs, "compile": c.compile})

    def get_drafter(self, name: str) -> Drafter:
        """A drafter by its spec (drafters.registry: "ngram", "model:PATH", or a draft model's
        path / id / alias), made once."""
        if name not in self._drafters:
            drafter = make_drafter(name, self.target, self.config, self.device, self.dtype)
            model = getattr(drafter, "model", None)
            # its step costs, kept under its spec and the weights it streams
            self.engine.costs.identify(drafter, {
                "spec": name, "kind": parse_drafter_spec(name).kind,
                "weight_bytes": weight_bytes(model) if model is not None else 0,
                "quantization": self.config.draft_quant if model is not None else None})
            self._drafters[name] = drafter
        return self._drafters[name]

    def close(self) -> None:
        """Save what the cost model measured (EngineConfig.step_cost_cache); the LLM stays
        usable."""
        self.engine.close()

    # -- prompts ---------------------------------------------------------------------------
    def encode(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty; give at least one character")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = [int(t) for t in prompt["prompt_token_ids"]]
            bad = [t for t in ids if not 0 <= t < self.target.config.vocab_size]
            if not ids or bad:
                raise ValueError(f"prompt_token_ids must be a non-empty list of ids in "
                                 f"[0, {self.target.config.vocab_size}); bad: {bad[:5] or 'empty'}")
            return None, ids
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self.encode(prompt["prompt"])
        raise TypeError(f"a prompt is a str, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, "
                        f"got {type(prompt).__name__}")

    def chat_prompt_ids(self, messages: list[dict]) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"the model {self.target.source} has no chat template; "
                             f"use generate() with a plain prompt")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_fits(self, prompt_ids: list[int]) -> None:
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens but max_model_len is "
                             f"{self.max_model_len}: at most {self.max_model_len - 1} prompt "
                             f"tokens fit (one position is needed to generate). Shorten the "
                             f"prompt or raise --max-model-len.")

    # -- generation --------------------------------------------------------------------------
    def stream(self, prompt, params: SamplingParams | None = None, draft=_DEFAULT,
               num_speculative_tokens: int | None = None) -> Iterator[StreamDelta]:
        """Generate for one prompt, yielding text as it is committed.

        draft: None for plain decoding, a drafter name, or (default) the one the LLM was built
        with. Closing the iterator stops the generation between two steps.
        """
        yield from self._stream(*self._encode_checked(prompt), params or SamplingParams(),
                                draft, num_speculative_tokens)

    def _encode_checked(self, prompt) -> tuple[str | None, list[int]]:
        text_prompt, ids = self.encode(prompt)
        self.check_fits(ids)
        return text_prompt, ids

    def _stream(self, text_prompt: str | None, ids: list[int], params: SamplingParams, draft,
                num_speculative_tokens: int | None) -> Iterator[StreamDelta]:
        drafter = self.drafter if draft is _DEFAULT else self.get_drafter(draft) if draft else None
        k = (speculative_tokens(num_speculative_tokens) if num_speculative_tokens is not None
             else self.num_speculative_tokens)
        metrics = RequestMetrics()
        detok = Detokenizer(self.tokenizer)
        longest_stop = max((len(s) for s in params.stop), default=0)
        emitted = 0  # characters of detok.text already handed out
        out_ids: list[int] = []
        steps = self.engine.run(ids, params, drafter, k if drafter else 0, metrics)
        try:
            for step in steps:
                out_ids.extend(step.token_ids)
                detok.add(step.token_ids)
                text, finish = detok.text, step.finish_reason
                if params.stop:
                    # Look only where a stop string could newly end.
                    lo = max(0, emitted - longest_stop)
                    hits = [(i, s) for s in params.stop if (i := text.find(s, lo)) >= 0]
                    if hits:
                        text, finish = text[:min(hits)[0]], "stop"
                if finish is None:
                    # Hold back a tail that might be the start of a stop string.
                    safe = len(text) - max((n for s in params.stop for n in range(len(s), 0, -1)
                                            if text.endswith(s[:n])), default=0)
                    delta, emitted = text[emitted:safe], max(emitted, safe)
                    if delta or step.token_ids:
                        yield StreamDelta(delta, step.token_ids)
                    continue
                steps.close()  # a stop string may end the request before the engine would
                out = RequestOutput(text_prompt, ids, text, out_ids, finish, metrics)
                yield StreamDelta(text[emitted:], step.token_ids, finish, out)
                return
        finally:
            steps.close()

    def generate(self, prompts,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 *, draft=_DEFAULT, num_speculative_tokens: int | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """prompts: a str, a list of str, or {"prompt_token_ids": [...]} items (or a list of
        them)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = (sampling_params if isinstance(sampling_params, list)
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        # Encode and check every prompt before spending time on any of them.
        encoded = [self._encode_checked(p) for p in prompts]
        outputs = []
        iterator = encoded
        if use_tqdm:
            from tqdm import tqdm
            iterator = tqdm(encoded, desc="generate")
        for (text_prompt, ids), sp in zip(iterator, params):
            *_, last = self._stream(text_prompt, ids, sp or SamplingParams(), draft,
                                    num_speculative_tokens)
            outputs.append(last.output)
        return outputs

    def chat(self, messages, sampling_params: SamplingParams | None = None,
             **kwargs) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"}) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.chat_prompt_ids(c)} for c in conversations]
        return self.generate(prompts, sampling_params, **kwargs)
