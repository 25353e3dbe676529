import os
import platform

# Triton's interpreter computes tl.dot with numpy's matmul. The FMA kernels of numpy's OpenBLAS
# (Haswell, Zen) add up a row's products in an order that depends on the number of rows, so on
# those CPUs the kernels' batch invariance, which the tests check bit for bit, fails in the
# interpreter and nowhere else (a GPU computes each row alike). OpenBLAS's SSE3 kernel, which
# every x86-64 CPU runs, has no such dependence. It is chosen over any OPENBLAS_CORETYPE the
# environment sets (some set Haswell), before numpy loads OpenBLAS, which reads it once.
if platform.machine() == "x86_64":
    os.environ["OPENBLAS_CORETYPE"] = "Prescott"

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU, the Triton kernels (flashdraft.backends.kernels) are tested through Triton's
# interpreter, which must be chosen before Triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.tiny import build_model  # noqa: E402


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Tiny random checkpoints: one per architecture, plus a second qwen2 of the same
    tokenizer (a poor draft) and a llama with Llama 3 rope scaling."""
    root = tmp_path_factory.mktemp("tiny")
    paths = {arch: build_model(root / arch, arch, seed=1) for arch in ("llama", "qwen2", "qwen3")}
    paths["qwen2-draft"] = build_model(root / "qwen2-draft", "qwen2", seed=7, layers=1,
                                       tokenizer_from=paths["qwen2"])
    paths["llama3-scaled"] = build_model(
        root / "llama3-scaled", "llama", seed=3,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    paths["qwen2-tied"] = build_model(root / "qwen2-tied", "qwen2", seed=5, tie=True)
    return {k: str(v) for k, v in paths.items()}


@pytest.fixture(scope="session")
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module: matrices of tiny models gain nothing from threads, a
    busy machine makes threads that wait for each other many times slower (thousands of tiny
    requests), and a seeded training run should not depend on how work is split."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
