"""Where plain decoding through the megakernel parts from plain decoding through the CUDA
graphs on a real model, and whether each parting is a near tie.

For each prompt: greedy plain decoding both ways (`--decode-kernel`), the first token where
they differ, and at that step both paths' logits for the same input (the graph step replayed,
then the megakernel's step, at the same position after the same tokens): each path's top two
and their gap. A parting where both paths' top-two gaps are within the paths' difference
(reduction order, bfloat16 rounding) is a near tie; one where a path is sure of its token and
the other chose another would be a fault.

    PYTHONPATH=. python3 benchmarks/megakernel_ties.py --out ties.json \
        [--model example:qwen2.5-coder-1.5b] [--prompts humaneval --raw-prompts] [--num-prompts 8]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashdraft import LLM, SamplingParams  # noqa: E402
from benchmarks.same_tokens import first_difference  # noqa: E402
from flashdraft.tools.bench import load_prompts, prompt_ids  # noqa: E402


def top2(logits: torch.Tensor) -> dict:
    v, i = logits.float().topk(2)
    return {"ids": i.tolist(), "logits": v.tolist(), "gap": (v[0] - v[1]).item()}


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="example:qwen2.5-coder-1.5b")
    ap.add_argument("--prompts", default="humaneval")
    ap.add_argument("--raw-prompts", action="store_true")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    llm = LLM(args.model, decode_kernel="megakernel")
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rows = []
    for p in load_prompts(args.prompts, args.raw_prompts, args.num_prompts):
        ids = prompt_ids(llm, p)
        engine.decode_kernel = "megakernel"
        mk_out = llm.generate({"prompt_token_ids": ids}, params)[0].token_ids
        engine.decode_kernel = "graph"  # last: the cache holds the graphs' keys and values
        graph_out = llm.generate({"prompt_token_ids": ids}, params)[0].token_ids
        at = first_difference(graph_out, mk_out)  # or where one stopped and the other went on
        row = {"prompt": p.id, "tokens": min(len(graph_out), len(mk_out)), "first_difference": at}
        if at is not None and 0 < at < min(len(graph_out), len(mk_out)):
            pos = len(ids) + at - 1  # the step whose output is token `at`
            token = torch.tensor([[graph_out[at - 1]]], device=llm.device)
            g_logits, _ = engine.runner(token, pos, engine.cache)
            g = g_logits[0, -1].float().clone()
            at_pos = torch.tensor([pos], device=llm.device)
            m = engine.megakernel.step(token.view(1), at_pos)[0].clone()
            torch.cuda.synchronize()
            row.update(graph=top2(g), megakernel=top2(m),
                       max_logit_difference=(g - m).abs().max().item(),
                       graph_logit_of_megakernel_token=g[mk_out[at]].item(),
                       megakernel_logit_of_graph_token=m[graph_out[at]].item(),
                       graph_token=graph_out[at], megakernel_token=mk_out[at])
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps({"model": args.model, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
