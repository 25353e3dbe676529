"""Greedy plain decoding of two `flashdraft bench` runs, prompt by prompt: where their tokens
first differ. For plain decoding through the CUDA graphs against the megakernel
(`--decode-kernel`): their reductions differ, so their tokens may part where two logits
nearly tie, and from there the continuations are different texts.

    python3 benchmarks/same_tokens.py RUN_A/results.json RUN_B/results.json
"""
from __future__ import annotations

import json
import sys


def plain_outputs(path: str) -> dict[str, list[int]]:
    results = json.load(open(path, encoding="utf-8"))
    entry = next(c for c in results["configurations"]
                 if c["drafter"] is None and c["temperature"] == 0)
    return {r["prompt_id"]: r["token_ids"] for r in entry["requests"]}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token that differs (or where one output ends), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.strip().splitlines()[-1].strip())
    a, b = plain_outputs(sys.argv[1]), plain_outputs(sys.argv[2])
    same, tokens_agreeing, tokens = 0, 0, 0
    for pid in a:
        if pid not in b:
            continue
        at = first_difference(a[pid], b[pid])
        same += at is None
        n = min(len(a[pid]), len(b[pid]))
        tokens_agreeing += n if at is None else at
        tokens += n
        print(f"{pid}: " + ("identical" if at is None else f"first differs at token {at} of {n}"))
    print(f"identical outputs: {same}/{len(a)}; tokens before the first difference: "
          f"{tokens_agreeing}/{tokens}")


if __name__ == "__main__":
    main()
