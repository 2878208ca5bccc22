"""Shared test fixtures and options: tiny random HF checkpoints, threads, Triton interpreter,
--impl.

Plain helpers (paths to ../shared, the HF configs, synthetic quantization data) live in testdata.py
and chi2.py, imported by name: two conftest.py files exist (this one and tests/exercises/), so
`from conftest import ...` would be ambiguous.
"""

from __future__ import annotations

import os

# Kernels run in Triton's interpreter on machines without CUDA; it must be set before any
# @triton.jit function is defined (docs/ARCHITECTURE.md, section 'Triton on CPU and GPU').
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def one_thread():
    """For tests of thousands of tiny tensor ops (samplers, column loops): a second thread only adds
    wake-up latency, 10× and more on a busy machine. Use with
    `pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

from testdata import hf_configs  # noqa: E402

# --------------------------------------------------------------------------- exercises
# (tests/exercises)
IMPLS = ("reference", "exercises")


def pytest_addoption(parser):
    # here, not in tests/exercises/conftest.py: pytest reads options only from the root conftest
    parser.addoption("--impl", choices=IMPLS, default=os.environ.get("NANOSERVE_IMPL", "reference"),
                     help="what tests/exercises check: the reference (nanoserve) or your code in "
                          "exercises/ (default: $NANOSERVE_IMPL, else reference)")
    parser.addoption("--expect-stubs", action="store_true",
                     help="CI: exercises/ holds the untouched stubs, so every exercise test must "
                          "fail with NotImplementedError (strict xfail: a test that passes on a "
                          "stub proves nothing)")


# --------------------------------------------------------------------------- tiny HF checkpoints
@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """{name: (directory, HF model)} for tiny random checkpoints saved offline with save_pretrained.

    Norm weights and biases are randomised too (testdata.tiny_hf_checkpoint): HF's init leaves
    them at 1 and 0, where a wrong norm epsilon or a dropped bias changes nothing."""
    import transformers
    from testdata import tiny_hf_checkpoint

    transformers.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("hf")
    return {name: (root / name, tiny_hf_checkpoint(cfg, root / name, seed=i))
            for i, (name, cfg) in enumerate(hf_configs().items())}


@pytest.fixture(scope="session")
def self_distilled():
    """(demo LLM, ids [160, 64]): sequences the demo wrote itself
    (tools/train_medusa.self_distill_data), the training data of the draft heads (the first 128) and
    their held-out set (the rest)."""
    from nanoserve import LLM
    from nanoserve.tools.train_medusa import self_distill_data

    llm = LLM("demo", dtype="float32")
    return llm, self_distill_data(llm, num_seqs=160, length=64, seed=0)


@pytest.fixture(scope="session")
def medusa_trained(tmp_path_factory, self_distilled):
    """(heads dir, demo LLM, held-out ids, trained heads): 3 Medusa heads trained 300 steps on 128
    sequences the demo wrote itself (tools/train_medusa.py); shared by tests/test_medusa.py and
    tests/test_medusa_tree.py."""
    from nanoserve.spec.medusa import save_medusa
    from nanoserve.tools.train_medusa import train_medusa

    llm, ids = self_distilled
    heads = train_medusa(llm.model, ids[:128], num_heads=3, steps=300, seed=0)
    path = save_medusa(heads, tmp_path_factory.mktemp("medusa") / "heads", "demo")
    return path, llm, ids[128:], heads


@pytest.fixture(scope="session")
def eagle_trained(tmp_path_factory, self_distilled):
    """(head dir, demo LLM, held-out ids, trained head): EAGLE's head trained 200 steps on the same
    128 sequences (tools/train_eagle.py); tests/test_eagle.py."""
    from nanoserve.spec.eagle import save_eagle
    from nanoserve.tools.train_eagle import train_eagle

    llm, ids = self_distilled
    head = train_eagle(llm.model, ids[:128], steps=200, seed=0)
    return save_eagle(head, tmp_path_factory.mktemp("eagle") / "head", "demo"), llm, ids[128:], head


def pytest_runtest_setup(item):
    """Tests marked `gpu` need CUDA: skipped without it (the GPU pass runs them with `-m gpu`)."""
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
