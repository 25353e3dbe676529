"""The sampling, DeltaNet and attention kernels compile for a Hopper GPU (sm90) on any machine:
Triton's front end and its PTX generation need no GPU, and they refuse what its interpreter lets through
(a name given a second type inside a branch, say). Run in a subprocess: the test session has
chosen the interpreter (conftest) before Triton was imported."""
import os
import subprocess
import sys

import pytest

CHECK = r'''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flashdraft.backends import deltanet_kernels as D
from flashdraft.backends import kernels as A
from flashdraft.backends import sampling_kernels as K

TYPES = dict(temperature="fp32", top_p="fp32", log_min_p="fp32", scale="fp32", eps="fp32",
             stream="u32",
             logits_ptr="*bf16", cand_ptr="*i64", token_ptr="*i64", rng_ptr="*i64",
             onehot_ptr="*i64", count_ptr="*i32", ncand_ptr="*i32", st_ptr="*i32",
             hcount_ptr="*i32", flag_ptr="*i32", arg_ptr="*i32", parg_ptr="*i32",
             pos_ptr="*i64", anc_ptr="*i64", read_ptr="*i64", write_ptr="*i64",
             qk_scale="fp32")
try:
    target = GPUTarget("cuda", 90, 32)
    triton.compiler.make_backend(target)
except Exception as err:
    print("NO_BACKEND", err)
    sys.exit(0)

failed = []
def compile_(fn, **consts):
    sig = {n: "constexpr" if n in consts else
           TYPES.get(n, "*fp32" if n.endswith("_ptr") else "i32") for n in fn.arg_names}
    try:
        triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target)
    except Exception as err:
        failed.append(f"{fn.__name__} {consts}: {err}")

rows = dict(CHUNK=2048, SUB=128)
modes = [dict(HAS_K=k, HAS_P=p, HAS_MIN=m) for k, p, m in
         [(False, True, False), (False, False, True), (False, True, True), (True, False, False),
          (True, True, True)]]
for flags in modes:
    for level in range(3):
        compile_(K._level_kernel, C_PAD=128, NB=64, LOG=6, LEVELS=3, LEVEL=level, CAP=512,
                 **rows, **flags)
    compile_(K._collect_kernel, LOG=6, LEVELS=3, CAP=512, **rows, **flags)
    compile_(K._exact_kernel, SUB=128, **flags)
for filt in (False, True):
    compile_(K._partials_kernel, C_PAD=128, FILTER=filt, **rows)
for mode in range(3):
    for rows_per_program in (1, 4):
        compile_(K._race_kernel, C_PAD=128, ROWS=rows_per_program, BLOCK=2048, MODE=mode)
compile_(K._uniform_kernel, BLOCK=128)
# Qwen3.5-27B's heads (three value heads a key head, 128 × 128), and a small padded shape
for norm in (False, True):
    compile_(D._delta_rule_step_kernel, GROUP=3, DK=128, DV=128, BLOCK_K=128, BLOCK_V=32,
             NORMALIZE=norm, USE_PDL=True)
compile_(D._delta_rule_step_kernel, GROUP=2, DK=8, DV=12, BLOCK_K=8, BLOCK_V=16,
         NORMALIZE=True, USE_PDL=False)
# attention over the cache, rope inside, chains and token trees (the 1.5B's heads)
for tree in (False, True):
    compile_(A._attention_kernel, GROUP=6, D=128, BLOCK_M=16, BLOCK_N=64, SPLIT=256,
             MAX_SPLITS=4, PRECISION="tf32", ROPE=True, QK_NORM=False, T_MAX=32, TREE=tree,
             USE_PDL=True)
print("\n\n".join(failed))
sys.exit(1 if failed else 0)
'''


def test_sampling_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the default, said out loud (no warning)
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True,
                          text=True, timeout=900)
    if done.stdout.startswith("NO_BACKEND"):
        pytest.skip(f"this Triton has no CUDA backend: {done.stdout}")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
