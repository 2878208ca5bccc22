"""Trainer and distillation smoke tests: a few dozen steps on a small slice must make progress."""

from __future__ import annotations

import pytest
import torch

from nanoserve.models.loader import load_model
from nanoserve.tools.train import PRESETS, estimate, lr_at, train


@pytest.fixture()
def corpus(tmp_path):
    # a small, repetitive English-like corpus: learnable in a few dozen steps
    words = (
        "the king and the queen rode to the castle while the people sang of war and peace".split()
    )
    g = torch.Generator().manual_seed(0)
    text = " ".join(words[i] for i in torch.randint(len(words), (3000,), generator=g).tolist())
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    return path


def test_training_lowers_the_loss_and_saves_a_loadable_checkpoint(corpus, tmp_path):
    cfg, tc = PRESETS["tiny"]
    model, log = train(cfg, tc, corpus, tmp_path / "tiny", progress=False)
    first, last = log["evals"][0]["val_loss"], log["evals"][-1]["val_loss"]
    before = torch.log(torch.tensor(257.0)).item()  # an untrained model predicts ~uniformly
    assert last < first < before
    loaded, lcfg, tok = load_model(tmp_path / "tiny")
    x = torch.tensor([tok.encode("the king")])
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_distillation_lowers_kl_to_the_teacher(corpus):
    cfg, tc = PRESETS["tiny"]
    teacher, _ = train(cfg, tc, corpus, progress=False)
    teacher.requires_grad_(False)
    student_cfg, student_tc = PRESETS["tiny"]
    from dataclasses import replace

    student_tc = replace(student_tc, steps=30, seed=5)
    untrained, _ = train(student_cfg, replace(student_tc, steps=1, lr=1e-9, warmup=1), corpus,
                         progress=False)
    student, log = train(student_cfg, student_tc, corpus, teacher=teacher, progress=False)
    from nanoserve.tools.train import load_bytes

    _, val = load_bytes(corpus)
    kl_before = estimate(untrained, val, student_tc, teacher)["kl"]
    kl_after = estimate(student, val, student_tc, teacher)["kl"]
    assert kl_after < 0.5 * kl_before


def test_lr_schedule_warms_up_then_decays_to_min():
    _, tc = PRESETS["demo"]
    assert lr_at(0, tc) < lr_at(tc.warmup - 1, tc) == pytest.approx(tc.lr)
    assert lr_at(tc.steps, tc) == pytest.approx(tc.min_lr)
    assert lr_at(tc.warmup + (tc.steps - tc.warmup) // 2,
                 tc) == pytest.approx((tc.lr + tc.min_lr) / 2)
