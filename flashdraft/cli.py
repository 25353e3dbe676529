"""`flashdraft generate | chat | serve | bench | demo | models | tune | env`: the command line.

argparse lives here and nowhere else; each flag maps onto one field of EngineConfig,
KernelConfig or SamplingParams (or of the subcommand's own settings).
"""
from __future__ import annotations

import argparse
import os
import sys

from .config import AUTO_TREE_BUDGET, DECODE_KERNELS, KERNEL_BACKENDS


def add_model_args(p: argparse.ArgumentParser, draft: bool = True,
                   model_required: bool = True) -> None:
    """Flags of every command that loads a model."""
    p.add_argument("--model", required=model_required,
                   help="HF model directory, hub id in the local HF cache, .gguf file, or an "
                        "example alias (example:qwen2.5-coder-1.5b)")
    if draft:
        p.add_argument("--draft", default=None,
                       help="the drafter: ngram (or ngram:4,3,2), model:PATH, dflash:DIR (a DFlash "
                            "block drafter), or a draft model's path, id or alias (same "
                            "tokenizer as the target)")
        p.add_argument("--num-speculative-tokens", default="auto", metavar="K|auto",
                       help="the most tokens drafted per step; the cost model chooses fewer, "
                            "or plain decoding, where that is faster (default auto: up to 8)")
        p.add_argument("--ngram-sizes", default="4,3,2",
                       help="n-gram sizes for --draft ngram, tried longest first (default 4,3,2)")
        p.add_argument("--tree-widths", default="", metavar="W,W,...|auto",
                       help="verify token trees: candidates per draft position (the draft "
                            "model's best token and its next best), e.g. 3,2,2; positions past "
                            "the list take one; auto: the cost model chooses them each step "
                            "under --tree-budget (default: chains)")
        p.add_argument("--tree-budget", type=int, default=0, metavar="N",
                       help="the most nodes (spine and leaves) of a token tree whose widths "
                            "the cost model chooses each step, among a few shapes (implies "
                            "--tree-widths auto; default with auto: 16)")
        p.add_argument("--no-adaptive-speculation", dest="adaptive_speculation",
                       action="store_false",
                       help="draft K tokens at every step (default: the cost model chooses "
                            "k, or plain decoding, each step; greedy output is the same "
                            "either way)")
        p.add_argument("--no-step-cost-cache", dest="step_cost_cache", action="store_false",
                       default=None,
                       help="measure the cost model's step costs afresh, and keep nothing "
                            "(default on CUDA: they are kept in the cache directory's "
                            "step_costs.json per GPU, model and settings, and the next run "
                            "starts from them)")
    p.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (default: cuda when present)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's context)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run every step eagerly on CUDA (for debugging; slower)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the forward before graph capture (faster steps, "
                        "a minute or two of start-up)")
    p.add_argument("--decode-kernel", default="auto", choices=DECODE_KERNELS,
                   help="greedy one-token steps: auto (default) runs a draft model's through "
                        "the decode megakernel where it can (Hopper, bf16 or int4 "
                        "Qwen2/Qwen3/Llama) and plain decoding's on CUDA graphs, so that "
                        "speculative output equals plain output; megakernel also runs plain "
                        "decoding (requests without a drafter) through it: faster, but its "
                        "tokens can differ from the graphs' where two logits nearly tie; "
                        "graph: no megakernel")
    p.add_argument("--quantization", default=None, choices=["int8", "int4"],
                   help="weight-only quantization of the target, applied at load")
    p.add_argument("--draft-quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                   help="weight-only quantization of a draft model (default auto: as "
                        "--quantization)")
    add_kernel_args(p)


def add_kernel_args(p: argparse.ArgumentParser) -> None:
    """The flags of KernelConfig."""
    p.add_argument("--kernel-backend", default="triton", choices=KERNEL_BACKENDS,
                   help="triton (default): the fused kernels on CUDA; torch: PyTorch ops "
                        "only, for comparisons and debugging (slower, and greedy speculation "
                        "need not return plain decoding's tokens bit for bit)")
    p.add_argument("--no-pdl", dest="pdl", action="store_false",
                   help="no programmatic dependent launch between kernels (Hopper and later; "
                        "on by default)")
    p.add_argument("--tuned-table", default=None, metavar="JSON|off",
                   help="the product kernel's launch table (default: the shipped one with "
                        "`flashdraft tune`'s results over it); off: the shape rule")


def add_parallel_arg(p: argparse.ArgumentParser, command: str) -> None:
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help=f"spread the model over N GPUs, one process each: start it with "
                        f"`torchrun --nproc-per-node N -m flashdraft.cli {command} "
                        f"--tensor-parallel N ...` (dense models, full precision; default 1)")


def kernel_config_from(args):
    from .config import KernelConfig

    return KernelConfig(backend=args.kernel_backend, pdl=args.pdl, tuned_table=args.tuned_table)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1 is off")
    p.add_argument("--top-k", type=int, default=0, help="0 is off")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="keep tokens with p >= MIN_P x the top token's p; 0 is off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def parse_ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"error: {flag} takes comma-separated whole numbers, got {text!r}")


def tree_widths_from(text: str) -> tuple[int, ...] | str:
    """--tree-widths: W,W,... or auto."""
    return "auto" if text.strip() == "auto" else parse_ints(text, "--tree-widths")


def build_llm(args):
    from .api import LLM

    return LLM(model=args.model, draft=getattr(args, "draft", None),
               num_speculative_tokens=getattr(args, "num_speculative_tokens", "auto"),
               ngram_sizes=parse_ints(getattr(args, "ngram_sizes", "4,3,2"), "--ngram-sizes"),
               dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
               cuda_graphs=args.cuda_graphs, compile=args.compile,
               quantization=args.quantization, draft_quantization=args.draft_quantization,
               adaptive_speculation=getattr(args, "adaptive_speculation", True),
               decode_kernel=args.decode_kernel, kernels=kernel_config_from(args),
               tree_widths=tree_widths_from(getattr(args, "tree_widths", "")),
               tree_budget=getattr(args, "tree_budget", 0),
               tensor_parallel=getattr(args, "tensor_parallel", 1),
               step_cost_cache=getattr(args, "step_cost_cache", None))


def sampling_from(args):
    from .config import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          min_p=args.min_p, max_tokens=args.max_tokens, seed=args.seed, stop=args.stop,
                          ignore_eos=args.ignore_eos)


def stats_line(m) -> str:
    line = (f"[{m.generated_tokens} tokens, {m.decode_tokens_per_s:.1f} tokens/s decode, "
            f"TTFT {m.ttft_s * 1000:.0f} ms, tau {m.tau:.2f}")
    if m.drafted_tokens:
        line += f", acceptance {m.acceptance_rate:.1%} ({m.accepted_tokens}/{m.drafted_tokens})"
    return line + "]"


def cmd_generate(args) -> None:
    params = sampling_from(args)
    llm = build_llm(args)
    if llm.rank != 0:  # every rank generates the same text: rank 0 prints it
        sys.stdout = sys.stderr = open(os.devnull, "w")
    for prompt in args.prompt:
        if args.chat:
            ids = llm.chat_prompt_ids([{"role": "user", "content": prompt}])
            stream = llm.stream({"prompt_token_ids": ids}, params)
        else:
            stream = llm.stream(prompt, params)
        for delta in stream:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            if delta.output is not None:
                print()
                print(stats_line(delta.output.metrics), file=sys.stderr)
    llm.close()
    if llm.parallel is not None:
        llm.parallel.leave()


def cmd_chat(args) -> None:
    params = sampling_from(args)
    llm = build_llm(args)
    messages = []
    print("flashdraft chat: an empty line or Ctrl-D ends the conversation", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        reply = ""
        for delta in llm.stream({"prompt_token_ids": llm.chat_prompt_ids(messages)}, params):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            reply += delta.text
            if delta.output is not None:
                print()
                print(stats_line(delta.output.metrics), file=sys.stderr)
        messages.append({"role": "assistant", "content": reply})
    llm.close()


def cmd_models(args) -> None:
    from .loading import examples as models

    if args.models_cmd == "pull":
        for name in args.names:
            for path in models.pull(name, progress=not args.quiet):
                print(path)
    else:
        print(models.format_list())


def cmd_bench(args) -> None:
    import shlex

    from .parallel import TensorParallel, torchrun_command
    from .tools.bench import BenchSettings, run_bench

    if args.random_weights:
        if args.tensor_parallel > 1:
            raise SystemExit("error: --random-weights times one GPU's steps; leave "
                             "--tensor-parallel out")
        from .tools.shapes import SHAPES, format_shape_bench, run_shape_bench

        if args.shape not in SHAPES:
            raise SystemExit(f"error: --random-weights needs --shape, one of {', '.join(SHAPES)}")
        print("random weights: this measures speed only; acceptance is not measured")
        print(format_shape_bench(run_shape_bench(
            args.shape, args.dtype or "bfloat16", args.quantization, args.device or "cuda",
            context=args.context, cuda_graphs=args.cuda_graphs, compile=args.compile,
            decode_kernel=args.decode_kernel, kernel_config=kernel_config_from(args))))
        return
    if not args.model:
        raise SystemExit("error: --model is required (or --random-weights --shape NAME)")

    try:
        temperatures = tuple(float(t) for t in args.temperature.split(",") if t.strip())
    except ValueError:
        raise SystemExit(f"error: --temperature takes comma-separated numbers, e.g. 0,0.7; "
                         f"got {args.temperature!r}")
    trees = [w.strip() for w in args.tree_widths or ()]  # W,W,... or auto
    settings = BenchSettings(
        model=args.model, drafts=tuple(args.draft or ()),
        num_speculative_tokens=parse_ints(args.num_speculative_tokens, "--num-speculative-tokens"),
        prompts=args.prompts, raw_prompts=args.raw_prompts, num_prompts=args.num_prompts,
        max_tokens=args.max_tokens, temperatures=temperatures, top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, seed=args.seed,
        warmup=args.warmup, output=args.output, peer=args.peer,
        ngram_sizes=parse_ints(args.ngram_sizes, "--ngram-sizes"), device=args.device,
        dtype=args.dtype, max_model_len=args.max_model_len, note=args.note,
        cuda_graphs=args.cuda_graphs, compile=args.compile, quantization=args.quantization,
        adaptive_speculation={"on": (True,), "off": (False,), "both": (True, False)}[
            args.adaptive_speculation],
        draft_quantization=args.draft_quantization, decode_kernel=args.decode_kernel,
        kernels=kernel_config_from(args),
        command=(torchrun_command(args.tensor_parallel, sys.argv[1:]) if args.tensor_parallel > 1
                 else shlex.join(sys.argv)),
        step_curve=parse_ints(args.step_curve, "--step-curve"), progress=not args.no_progress,
        tree_widths=tuple(parse_ints(w, "--tree-widths") for w in trees if w != "auto"),
        tree_budget=args.tree_budget or (AUTO_TREE_BUDGET if "auto" in trees else 0),
        step_cost_cache=args.step_cost_cache, tensor_parallel=args.tensor_parallel)
    run_bench(settings)
    if settings.tensor_parallel > 1:  # the group run_bench's ranks joined, as generate leaves it
        TensorParallel.join(settings.tensor_parallel, settings.device).leave()


def cmd_serve(args) -> None:
    import os

    from .serving.server import ServerSettings, serve

    settings = ServerSettings(served_model_name=args.served_model_name or args.model,
                              api_key=args.api_key or os.environ.get("FLASHDRAFT_API_KEY") or None,
                              max_queue=args.max_queue)
    llm = build_llm(args)
    serve(llm, settings, host=args.host, port=args.port)  # rank 0 serves, the others follow
    if llm.parallel is not None:
        llm.parallel.leave()


def cmd_tune(args) -> None:
    from .backends.tune import run_tune

    run_tune(args.model, args.shape, args.seconds, args.output)


def cmd_env(args) -> None:
    from .tools.environment import describe

    print(describe(kernel_config_from(args)))


def cmd_demo(args) -> None:
    from .tools.demo import DemoSettings, run_demo

    run_demo(DemoSettings(
        num_speculative_tokens=parse_ints(args.num_speculative_tokens, "--num-speculative-tokens"),
        num_humaneval=args.num_humaneval, max_tokens=args.max_tokens, device=args.device,
        dtype=args.dtype, output=args.output, dflash=args.dflash))


def cmd_train_drafter(args) -> None:
    from .tools.train_drafter import TrainSettings, train_drafter

    train_drafter(TrainSettings(
        target=args.target, output=args.output, data=args.data, source=args.source,
        layers=args.layers, block_size=args.block_size, minutes=args.minutes,
        max_steps=args.max_steps, gamma=args.gamma,
        target_layer_ids=(parse_ints(args.target_layer_ids, "--target-layer-ids")
                          if args.target_layer_ids else None),
        mask_token_id=args.mask_token_id, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, responses_per_prompt=args.responses_per_prompt,
        generation_batch=args.generation_batch,
        max_len=args.max_len, batch_size=args.batch_size, anchors=args.anchors, lr=args.lr,
        heldout=args.heldout, seed=args.seed, device=args.device, dtype=args.dtype,
        keep_features=not args.recompute_features, progress=not args.no_progress))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashdraft", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    add_model_args(g)
    add_sampling_args(g)
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    add_parallel_arg(g, "generate")
    g.add_argument("prompt", nargs="+")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="an interactive chat on the terminal")
    add_model_args(c)
    add_sampling_args(c)
    c.set_defaults(func=cmd_chat)

    m = sub.add_parser("models", help="the example models: pull, list")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    pull = msub.add_parser("pull", help="download, assemble and verify example models")
    pull.add_argument("names", nargs="+", help="qwen2.5-coder, or an alias such as "
                                               "example:qwen2.5-coder-1.5b")
    pull.add_argument("--quiet", action="store_true", help="no progress bars")
    msub.add_parser("list", help="what is in the cache")
    m.set_defaults(func=cmd_models)

    b = sub.add_parser("bench", help="plain decoding vs speculative configurations on the same "
                                     "prompts: tokens/s, TTFT, TPOT, tau, acceptance, speedup")
    add_model_args(b, draft=False, model_required=False)
    b.add_argument("--random-weights", action="store_true",
                   help="synthetic weights of a real model's shape (--shape): step cost curve "
                        "and roofline fraction; speed only, no acceptance")
    b.add_argument("--shape", default=None, help="with --random-weights: qwen2.5-1.5b, "
                                                 "qwen3-8b, qwen3-32b, dense-27b, ...")
    b.add_argument("--context", type=int, default=512,
                   help="with --random-weights: tokens in the cache while timing (default 512)")
    b.add_argument("--draft", action="append", default=None, metavar="DRAFT",
                   help="a drafter spec (ngram, ngram:SIZES, model:PATH, dflash:DIR, or a "
                        "path / id / alias); repeatable")
    b.add_argument("--num-speculative-tokens", default="5", metavar="K[,K...]",
                   help="values of k to sweep, e.g. 1,3,5,7,10,16 (default 5)")
    b.add_argument("--step-curve", default="", metavar="N[,N...]",
                   help="also time the target's pass over N tokens (the cost of verifying N - 1 "
                        "drafts), e.g. 1,2,4,8,16,32,64; a table and step-curve.png")
    b.add_argument("--ngram-sizes", default="4,3,2",
                   help="n-gram sizes for --draft ngram, tried longest first (default 4,3,2)")
    b.add_argument("--tree-widths", action="append", default=None, metavar="W,W,...|auto",
                   help="also run each draft model × k with token trees of these candidates "
                        "per draft position (e.g. 3,2,2), beside its chain; auto: trees the "
                        "cost model shapes each step under --tree-budget; repeatable")
    b.add_argument("--tree-budget", type=int, default=0, metavar="N",
                   help="the node budget of --tree-widths auto's trees (default 16)")
    b.add_argument("--no-step-cost-cache", dest="step_cost_cache", action="store_false",
                   default=None,
                   help="every configuration measures the cost model's step costs afresh "
                        "(default on CUDA: from the cache directory's step_costs.json)")
    b.add_argument("--adaptive-speculation", default="on", choices=["on", "off", "both"],
                   help="decode plainly while drafts keep failing (on, the default, as "
                        "generate and serve do), draft at every step (off), or run each "
                        "drafter × k both ways (both; the second is named '... every step')")
    b.add_argument("--prompts", default="humaneval", metavar="humaneval|seed|FILE.jsonl",
                   help="HumanEval through the chat template (default), the shipped seed "
                        "prompts, or a JSONL file of {\"prompt\": ...} or {\"messages\": [...]}")
    b.add_argument("--raw-prompts", action="store_true",
                   help="send HumanEval prompts as raw text, without the chat template (as "
                        "BENCHMARKS.md's reference figures were measured)")
    b.add_argument("--num-prompts", type=int, default=None, metavar="N",
                   help="the first N prompts of the set (default: all)")
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument("--temperature", default="0", metavar="T[,T...]",
                   help="temperatures to run, e.g. 0,0.7 (default 0: greedy)")
    b.add_argument("--top-k", type=int, default=0, help="at T > 0; 0 is off")
    b.add_argument("--top-p", type=float, default=1.0, help="at T > 0; 1 is off")
    b.add_argument("--min-p", type=float, default=0.0, help="at T > 0; 0 is off")
    b.add_argument("--seed", type=int, default=0, help="sampling seed of prompt i is SEED + i")
    b.add_argument("--warmup", type=int, default=1, metavar="N",
                   help="untimed requests before each configuration (default 1); when >= 1, "
                        "also one request per CUDA-graph shape the timed ones would meet first")
    b.add_argument("--output", default="results", metavar="DIR",
                   help="write results.json, results.md and PNG plots here (default results/)")
    b.add_argument("--peer", default=None, choices=["transformers"],
                   help="also time transformers' generate on the same weights and prompts "
                        "(plain, assisted with each draft model, prompt lookup)")
    add_parallel_arg(b, "bench")
    b.add_argument("--note", default=None,
                   help="a line recorded with the results, e.g. 'random weights: speed only'")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.set_defaults(func=cmd_bench)

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, "
                                     "streaming, /metrics)")
    add_model_args(s)
    s.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on every /v1 route (default: "
                        "$FLASHDRAFT_API_KEY, else no key)")
    s.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients send and /v1/models lists (default: --model)")
    s.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests that may wait behind the running one; more get 503 "
                        "(default 64)")
    add_parallel_arg(s, "serve")
    s.set_defaults(func=cmd_serve)

    t = sub.add_parser("tune", help="measure the product kernel's launch parameters for a "
                                    "model's matrices on this GPU (CUDA); later runs use them")
    t.add_argument("--model", default=None,
                   help="the model whose matrix shapes to tune (path, hub id, .gguf or alias; "
                        "only its config is read)")
    t.add_argument("--shape", default=None,
                   help="or a synthetic shape: qwen2.5-1.5b, qwen3-8b, ...")
    t.add_argument("--seconds", type=float, default=120.0,
                   help="time to spend, split evenly over the matrices (default 120)")
    t.add_argument("--output", default=None, metavar="JSON",
                   help="the table to merge into (default: skinny_tuned.json in the model "
                        "cache, which flashdraft reads at start)")
    t.set_defaults(func=cmd_tune)

    d = sub.add_parser("demo", help="plain vs speculative decoding on the real example pair")
    d.add_argument("--num-speculative-tokens", default="5", metavar="K[,K...]",
                   help="draft lengths to run, e.g. 3,5,8 (default 5)")
    d.add_argument("--num-humaneval", type=int, default=None,
                   help="HumanEval prompts before the seed prompts (default 4 on CUDA, 2 on CPU)")
    d.add_argument("--max-tokens", type=int, default=None,
                   help="new tokens per prompt (default 128 on CUDA, 48 on CPU)")
    d.add_argument("--device", default=None)
    d.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    d.add_argument("--output", default=None, help="directory for results.json")
    d.add_argument("--dflash", default=None, metavar="DIR",
                   help="also run this DFlash drafter of the target (a directory, e.g. one "
                        "train-drafter wrote, or a hub id in the cache); it drafts its whole "
                        "block a step")
    d.set_defaults(func=cmd_demo)

    e = sub.add_parser("env", help="what flashdraft sees: versions, GPU, the kernel "
                                   "configuration the flags give, where models are cached")
    add_kernel_args(e)
    e.set_defaults(func=cmd_env)

    tr = sub.add_parser("train-drafter", help="train a DFlash drafter for a target by "
                                              "self-distillation (its own responses)")
    tr.add_argument("--target", required=True,
                    help="the target model (directory, hub id in the cache, .gguf or alias)")
    tr.add_argument("--output", required=True, metavar="DIR",
                    help="where the drafter goes (public DFlash format; load it as dflash:DIR)")
    tr.add_argument("--data", default="builtin", metavar="builtin|stdlib|FILE|DIR",
                    help="prompts: the shipped set, requests for the functions of Python's "
                         "standard library (thousands, made from its docstrings), a .jsonl "
                         "({\"prompt\"} or {\"messages\"} a line) or .txt file, or a directory "
                         "of them; several joined by commas (default builtin)")
    tr.add_argument("--source", default="generate", choices=["generate", "text"],
                    help="generate: train on the target's responses to the prompts; text: on "
                         "the supplied text as it is (cheaper); labels are the target's argmax")
    tr.add_argument("--layers", type=int, default=1, help="drafter layers (default 1)")
    tr.add_argument("--block-size", type=int, default=16,
                    help="B: drafts up to B - 1 tokens a step (default 16)")
    tr.add_argument("--minutes", type=float, default=10.0,
                    help="training time, data generation not included (default 10)")
    tr.add_argument("--max-steps", type=int, default=None, help="or stop after this many steps")
    tr.add_argument("--gamma", type=float, default=7.0,
                    help="the loss weight of block position j is exp(-(j-1)/gamma) (default 7)")
    tr.add_argument("--target-layer-ids", default=None, metavar="J[,J...]",
                    help="0-based target layers the drafter reads (default: spread as the "
                         "reference does)")
    tr.add_argument("--mask-token-id", type=int, default=None,
                    help="default: the first embedding row past the tokenizer's tokens")
    tr.add_argument("--max-new-tokens", type=int, default=256,
                    help="of each generated response (default 256)")
    tr.add_argument("--temperature", type=float, default=0.0,
                    help="of the generated responses (default 0, greedy)")
    tr.add_argument("--responses-per-prompt", type=int, default=1,
                    help="responses sampled per prompt (needs --temperature > 0)")
    tr.add_argument("--generation-batch", type=int, default=32,
                    help="responses generated together (default 32; more is faster where the "
                         "GPU's memory holds their caches)")
    tr.add_argument("--max-len", type=int, default=1024, help="tokens a training sequence")
    tr.add_argument("--batch-size", type=int, default=8, help="sequences a step (default 8)")
    tr.add_argument("--anchors", type=int, default=16, help="blocks a sequence a step (default 16)")
    tr.add_argument("--lr", type=float, default=6e-4)
    tr.add_argument("--heldout", type=float, default=0.05,
                    help="share of sequences kept for the tau estimate (default 0.05)")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--device", default=None)
    tr.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    tr.add_argument("--recompute-features", action="store_true",
                    help="compute the target's hidden states again each step instead of keeping "
                         "them from the labelling pass (less memory, slower; chosen by itself "
                         "where they would not fit)")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar (logs, CI)")
    tr.set_defaults(func=cmd_train_drafter)

    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from .loading.examples import ModelError

    try:
        if hasattr(args, "tensor_parallel"):
            from .parallel import check_launch

            check_launch(args.tensor_parallel, sys.argv[1:] if argv is None else argv)
        args.func(args)
    except (ValueError, FileNotFoundError, ModelError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
