"""Task generators (docs/maths.md 1.8 settings 1 and 2, MQAR, passkey, byte corpora) and the
retrieval model's memory variants."""

from __future__ import annotations

import pytest
import torch

from fastweights.models.retrieval import MEMORIES, RetrievalModel, retrieval_loss
from fastweights.tasks import (
    ByteTokenizer,
    eval_windows,
    load_corpus,
    mqar_batch,
    passkey_prompt,
    random_windows,
    retrieval_batch,
    retrieval_eval_batch,
)
from fastweights.tasks.mqar import IGNORE


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def brute_last_value(keys, values, q):
    out = -1
    for k, v in zip(keys.tolist(), values.tolist()):
        if k == q:
            out = v
    return out


def test_capacity_setting_is_a_permutation_of_keys_and_values():
    b = retrieval_batch("capacity", 9, 5, gen())
    assert b.keys.shape == b.values.shape == (5, 9)
    for row_k, row_v in zip(b.keys, b.values):
        assert sorted(row_k.tolist()) == list(range(9))  # L = S, without replacement
        assert sorted(row_v.tolist()) == list(range(9))
    for i in range(5):
        assert b.targets[i, 0] == brute_last_value(b.keys[i], b.values[i], int(b.queries[i, 0]))


def test_update_setting_samples_with_replacement_and_latest_value_counts():
    b = retrieval_batch("update", 7, 64, gen())
    assert b.keys.shape == (64, 14)  # L = 2S
    assert b.keys.max() < 7 and b.values.max() < 7
    repeated = sum(len(set(r.tolist())) < 14 for r in b.keys)
    assert repeated == 64  # 14 draws from 7 symbols always repeat
    for i in range(64):
        q = int(b.queries[i, 0])
        assert q in b.keys[i].tolist()
        assert b.targets[i, 0] == brute_last_value(b.keys[i], b.values[i], q)


@pytest.mark.parametrize("setting", ["capacity", "update"])
def test_eval_batch_queries_every_distinct_key_once(setting):
    b = retrieval_eval_batch(setting, 11, gen(3), n_sequences=20)
    assert b.keys.shape == (20, 11)  # evaluation length S in both settings
    for i in range(20):
        present = sorted(set(b.keys[i].tolist()))
        asked = b.queries[i][b.mask[i]].tolist()
        assert sorted(asked) == present and len(asked) == len(set(asked))
        for q, t in zip(asked, b.targets[i][b.mask[i]].tolist()):
            assert t == brute_last_value(b.keys[i], b.values[i], q)


def test_generators_are_reproducible_by_seed():
    a, b, c = (retrieval_batch("update", 6, 4, gen(s)) for s in (1, 1, 2))
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert not torch.equal(a.keys, c.keys)
    x1, y1 = mqar_batch(5, 3, 20, 4, gen(1))
    x2, y2 = mqar_batch(5, 3, 20, 4, gen(1))
    assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_mqar_labels_answer_the_queries():
    x, y = mqar_batch(6, 4, 24, 8, gen())
    assert x.shape == y.shape == (8, 20)
    for row_x, row_y in zip(x, y):
        pairs = dict(zip(row_x[0:12:2].tolist(), row_x[1:12:2].tolist()))
        assert len(pairs) == 6 and all(k < 12 for k in pairs) and all(v >= 12 for v in pairs.values())
        scored = (row_y != IGNORE).nonzero().flatten().tolist()
        assert scored == [12, 14, 16, 18]
        for t in scored:
            assert row_y[t] == pairs[int(row_x[t])] == row_x[t + 1]
    with pytest.raises(ValueError, match="n_queries"):
        mqar_batch(3, 4, 20, 1, gen())


def test_passkey_hides_the_key_at_the_requested_depth():
    prompt, key = passkey_prompt(10, 0.5, gen())
    assert len(key) == 5 and key.isdigit()
    assert prompt.count(key) == 2 and prompt.endswith("The pass key is ")
    start, mid, end = (passkey_prompt(10, d, gen())[0].find("pass key is") for d in (0.0, 0.5, 1.0))
    assert start < mid < end
    with pytest.raises(ValueError, match="depth"):
        passkey_prompt(10, 1.5, gen())


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo\n")
    assert ids.dtype == torch.long and ids.max() < 256 and len(ids) == 7
    assert tok.decode(ids) == "héllo\n"


def test_corpus_from_folder_file_and_errors(tmp_path):
    for i in range(30):
        (tmp_path / f"f{i:02d}.txt").write_text(f"file {i} " * 20)
    c = load_corpus(str(tmp_path))
    assert c.train.dtype == torch.uint8 and c.val.numel() > 0 and c.train.numel() > c.val.numel()
    assert torch.equal(load_corpus(str(tmp_path)).val, c.val)  # deterministic split
    single = load_corpus(str(tmp_path / "f00.txt"))
    assert single.train.numel() + single.val.numel() == len("file 0 " * 20)
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(str(tmp_path / "missing"))
    x, y = random_windows(c.train, 3, 8, gen())
    assert x.shape == y.shape == (3, 8) and torch.equal(x[:, 1:], y[:, :-1])
    xe, _ = eval_windows(c.val, 8, 2)
    assert xe.shape == (2, 8) and torch.equal(xe[1, 0], c.val[8].long())


def test_stdlib_corpus_is_python_source():
    c = load_corpus("stdlib")
    assert c.train.numel() > 1_000_000 and c.val.numel() > 10_000
    assert b"def " in bytes(c.val[:100_000].tolist())


@pytest.mark.parametrize("memory,options", [
    ("linear", {}), ("dpfp", {"nu": 2}), ("favor", {"m": 8}), ("delta", {}),
    ("delta", {"feature_map": "dpfp"}), ("softmax", {}),
], ids=lambda v: str(v) if isinstance(v, str) else ",".join(f"{k}={x}" for k, x in v.items()) or "-")
def test_retrieval_model_shapes_and_gradients(memory, options):
    torch.manual_seed(0)
    model = RetrievalModel(6, memory, d_key=8, **options)
    b = retrieval_eval_batch("update", 6, gen(), n_sequences=3)
    y = model(b.keys, b.values, b.queries)
    assert y.shape == (3, 6, 6) and torch.isfinite(y).all()
    retrieval_loss(y, b.targets, b.mask).backward()
    assert all(p.grad is not None for p in model.parameters())
    assert model.state_size(6) > 0


def test_retrieval_reads_do_not_write():
    """Each query reads the memory written by the pairs only: asking more queries at once must
    not change any answer (the read passes zero keys and values)."""
    torch.manual_seed(0)
    for memory in MEMORIES:
        if memory == "favor":  # redraws its projection every call
            continue
        model = RetrievalModel(5, memory, d_key=8).double()
        b = retrieval_eval_batch("capacity", 5, gen())
        all_q = model(b.keys, b.values, b.queries)
        one_q = model(b.keys, b.values, b.queries[:, 2:3])
        assert torch.allclose(all_q[:, 2:3], one_q, atol=1e-12), memory


def test_retrieval_loss_is_half_squared_error_mean_over_real_queries():
    y = torch.zeros(1, 2, 3)
    loss = retrieval_loss(y, torch.tensor([[1, 2]]), torch.tensor([[True, False]]))
    assert loss.item() == pytest.approx(0.5)


def test_retrieval_model_rejects_bad_options():
    with pytest.raises(ValueError, match="memory"):
        RetrievalModel(4, "lstm")
    with pytest.raises(ValueError, match="feature_map"):
        RetrievalModel(4, "linear", feature_map="dpfp")


def test_retrieval_favor_uses_one_projection_for_keys_and_queries(monkeypatch):
    """phi(q).phi(k) estimates exp(q.k) only when keys and queries share a FAVOR+ draw."""
    import fastweights.models.retrieval as retrieval

    draws = []
    real = retrieval.draw_favor_projection

    def counting(*args, **kwargs):
        draws.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(retrieval, "draw_favor_projection", counting)
    model = retrieval.RetrievalModel(8, "favor", d_key=16)
    keys = torch.randint(0, 16, (2, 8))
    model(keys, torch.randint(0, 8, (2, 8)), keys[:, :3])
    assert len(draws) == 1
