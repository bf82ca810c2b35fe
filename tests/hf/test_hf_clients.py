"""The Hugging Face integration driven by transformers' own clients: packed batches
from DataCollatorWithFlattening, the Trainer (packing, gradient accumulation, reentrant gradient
checkpointing, right padding), resize_token_embeddings, hidden states, keyword handling, and
native_to_hf on a training run folder."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")

from transformers import DataCollatorWithFlattening, TrainingArguments

from fastweights.hf import CACHE_FIELD, FastWeightsForCausalLM, native_to_hf
from fastweights.models.config import LMConfig
from fastweights.models.lm import LanguageModel
from tests.helpers import assert_close64

from .test_hf import MIXERS, PAD, V, prompt, tiny_model

DOC_LENGTHS = (5, 7, 3)


def documents(seed: int = 20) -> list[list[int]]:
    return [prompt(n, seed + i)[0].tolist() for i, n in enumerate(DOC_LENGTHS)]


def doc_losses(model: FastWeightsForCausalLM, docs: list[list[int]]) -> tuple[torch.Tensor, int]:
    """Sum of next-token cross-entropies over every document run on its own, and their count."""
    total, count = 0.0, 0
    for doc in docs:
        ids = torch.tensor([doc])
        logits = model(ids, use_cache=False).logits[0, :-1]
        total = total + F.cross_entropy(logits, ids[0, 1:], reduction="sum")
        count += len(doc) - 1
    return total, count


COLLATORS = {
    "position_ids": {},
    "flash_kwargs": {"return_position_ids": False, "return_flash_attn_kwargs": True},
    "all": {"return_flash_attn_kwargs": True, "return_seq_idx": True},
}


@pytest.mark.parametrize("mixer", ["delta", "mixed", "ttt-linear"])
@pytest.mark.parametrize("collator", COLLATORS, ids=COLLATORS.keys())
def test_flattening_collator_packed_loss_equals_per_document_losses(mixer, collator):
    model = tiny_model(MIXERS.get(mixer, mixer))
    docs = documents()
    batch = DataCollatorWithFlattening(**COLLATORS[collator])([{"input_ids": d} for d in docs])
    out = model(**batch, use_cache=False, output_hidden_states=True)
    total, count = doc_losses(model, docs)
    assert_close64(out.loss, total / count, what="packed loss")
    per_doc = torch.cat([model(torch.tensor([d])).logits[0] for d in docs])
    assert_close64(out.logits[0], per_doc, what="packed logits")
    # The same tokens as one sequence (state carried across the documents) give another loss:
    # the comparison above would catch a leak.
    leaked = model(batch["input_ids"], labels=batch["labels"], use_cache=False).loss
    assert (leaked - out.loss).abs() > 1e-6  # far above the 1e-10 tolerance above


def test_packed_boundaries_need_no_separator_labels():
    # cu_seqlens given directly with labels = input_ids: no document's first token is a target
    # of the previous document.
    model = tiny_model("delta")
    docs = documents(seed=30)
    ids = torch.tensor([[t for d in docs for t in d]])
    cu = torch.tensor([0, 5, 12, 15])
    total, count = doc_losses(model, docs)
    assert_close64(model(ids, labels=ids, cu_seqlens=cu, use_cache=False).loss, total / count,
                   what="loss")


def test_packed_batches_are_refused_where_they_cannot_be_honoured():
    model = tiny_model("delta")
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": d} for d in documents()])
    with pytest.raises(ValueError, match="use_cache=False"):
        model(**batch)  # config.use_cache is True: a packed state cannot be continued
    ids = torch.cat([prompt(6, 1), prompt(6, 2)])
    with pytest.raises(ValueError, match="batch of one"):
        model(ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]] * 2), use_cache=False)
    with pytest.raises(ValueError, match="position_ids disagree"):
        model(ids, position_ids=torch.tensor([[3, 4, 5, 6, 7, 8]] * 2), use_cache=False)
    with pytest.raises(ValueError, match="restart at 0"):
        model(ids[:1], position_ids=torch.tensor([[0, 1, 2, 0, 2, 3]]), use_cache=False)
    with pytest.raises(ValueError, match="cu_seq_lens_q marks"):
        model(ids[:1], cu_seqlens=torch.tensor([0, 3, 6]), cu_seq_lens_q=torch.tensor([0, 2, 6]),
              use_cache=False)
    with pytest.raises(ValueError, match="max_length_q"):
        model(ids[:1], cu_seq_lens_q=torch.tensor([0, 2, 6]), max_length_q=3, use_cache=False)
    # Positions the model uses are accepted, with left padding and with a cache.
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    pos = (mask.cumsum(1) - 1).masked_fill(mask == 0, 1)
    out = model(ids, attention_mask=mask, position_ids=pos)
    nxt = out.logits[:, -1:].argmax(-1)
    model(nxt, attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1),
          position_ids=torch.tensor([[4], [6]]), cache=out[CACHE_FIELD])


def test_unknown_keywords_are_errors_and_generate_keywords_are_honoured():
    model = tiny_model("delta")
    ids = prompt(6, 3)
    with pytest.raises(TypeError, match="foo"):
        model(ids, foo=1)
    with pytest.raises(ValueError, match="foo"):
        model.generate(ids, max_new_tokens=2, foo=1)
    with pytest.raises(ValueError, match="output_attentions"):
        model(ids, output_attentions=True)
    with pytest.raises(ValueError, match="cache_position"):
        model(ids, cache_position=torch.arange(1, 7))
    full = model(ids, cache_position=torch.arange(6), output_attentions=False).logits
    assert_close64(model(ids, logits_to_keep=2).logits, full[:, -2:], what="logits_to_keep")
    assert_close64(model(ids, logits_to_keep=torch.tensor([0, 3])).logits, full[:, [0, 3]],
                   what="logits_to_keep indices")
    # num_items_in_batch (the Trainer's count over accumulated batches) divides the summed loss
    total = model(ids, labels=ids).loss * 5
    assert_close64(model(ids, labels=ids, num_items_in_batch=torch.tensor(7)).loss, total / 7,
                   what="loss / num_items_in_batch")
    # return_dict=False gives the tuple
    loss, logits = model(ids, labels=ids, return_dict=False, use_cache=False)
    assert_close64(logits, full, what="tuple logits")
    assert_close64(loss, total / 5, what="tuple loss")


@pytest.mark.parametrize("mixer", ["delta", "softmax"])
def test_output_hidden_states_are_llamas_convention(mixer):
    model = tiny_model(mixer)
    short, long = prompt(4, 40), prompt(7, 41)
    ids = torch.cat([torch.cat([torch.full((1, 3), PAD), short], 1), long])
    out = model(ids, attention_mask=(ids != PAD).long(), output_hidden_states=True)
    hs = out.hidden_states
    assert len(hs) == model.config.n_layers + 1
    lm = model.model
    for row, seq, p in ((0, short, 3), (1, long, 0)):
        x = lm.embed(seq)
        assert_close64(hs[0][row, p:], x[0], what="embeddings")
        for i, block in enumerate(lm.blocks[:-1]):
            x = block(x)[0]
            assert_close64(hs[i + 1][row, p:], x[0], what=f"block {i} output")
        x = lm.norm(lm.blocks[-1](x)[0])  # the last one is after the final norm
        assert_close64(hs[-1][row, p:], x[0], what="final norm output")
    assert all(h[0, :3].abs().max() == 0 for h in hs)
    assert_close64(lm.head(hs[-1]), out.logits, what="head(last hidden state)")
    chosen = model(ids, attention_mask=(ids != PAD).long(), output_hidden_states=[0, -1]).hidden_states
    assert chosen[1] is None and torch.equal(chosen[0], hs[0]) and torch.equal(chosen[-1], hs[-1])
    res = model.generate(ids, attention_mask=(ids != PAD).long(), max_new_tokens=3, do_sample=False,
                         output_hidden_states=True, return_dict_in_generate=True)
    assert len(res.hidden_states) == 3 and all(len(step) == 3 for step in res.hidden_states)
    assert torch.equal(res.hidden_states[0][0], hs[0])
    model.config.output_hidden_states = True  # the config's flag is the default
    assert torch.equal(model(ids, attention_mask=(ids != PAD).long()).hidden_states[-1], hs[-1])


@pytest.mark.parametrize("mixer", ["delta", "softmax"])
def test_right_padding_in_training_forwards(mixer):
    model = tiny_model(mixer)
    short, long = prompt(4, 42), prompt(7, 43)
    ids = torch.cat([torch.cat([short, torch.full((1, 3), PAD)], 1), long])
    mask = (ids != PAD).long()
    labels = ids.masked_fill(mask == 0, -100)
    out = model(ids, attention_mask=mask, labels=labels, use_cache=False)
    assert_close64(out.logits[0, :4], model(short).logits[0], what="right-padded row")
    assert_close64(out.logits[1], model(long).logits[0], what="full row")
    assert out.logits[0, 4:].abs().max() == 0
    total, count = doc_losses(model, [short[0].tolist(), long[0].tolist()])
    assert_close64(out.loss, total / count, what="loss")
    # labels = input_ids (pads not set to -100): pads are still no targets
    assert_close64(model(ids, attention_mask=mask, labels=ids, use_cache=False).loss, out.loss,
                   what="loss with pad labels")
    # A cache would hold a state no later forward could continue: refused, also in generate.
    with pytest.raises(ValueError, match="only left padding"):
        model(ids, attention_mask=mask, use_cache=True)
    with pytest.raises(ValueError, match="only left padding"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.generate(ids, attention_mask=mask, max_new_tokens=2)


def _grads(model, ids):
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids, use_cache=False).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mixer", ["delta", "mixed", "ttt-linear", "infini"])
def test_reentrant_gradient_checkpointing_gives_the_same_gradients(mixer):
    model = tiny_model(MIXERS.get(mixer, mixer)).train()
    ids = torch.cat([prompt(9, 50), prompt(9, 51)])
    plain = _grads(model, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old name is deprecated in 5.x
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert model.model.gradient_checkpointing
    recomputed = _grads(model, ids)
    assert plain.keys() == recomputed.keys() and plain
    for n in plain:
        assert_close64(recomputed[n], plain[n], what=n)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_keeps_gradients_through_a_carried_state(reentrant):
    # The layer states travel through the checkpoint as flat tensors: truncated-BPTT users who
    # carry the state un-detached get the gradient of the whole sequence.
    torch.manual_seed(0)
    lm = LanguageModel(LMConfig(vocab_size=V, d_model=12, n_layers=2, n_heads=2,
                                mixer=["delta", "ttt-linear"])).double().train()
    ids = prompt(10, 52)

    def grads():
        lm.zero_grad(set_to_none=True)
        a, state = lm(ids[:, :6])
        b, _ = lm(ids[:, 6:], state)
        (a.square().sum() + b.square().sum()).backward()
        return [p.grad.clone() for p in lm.parameters()]

    plain = grads()
    lm.set_gradient_checkpointing(True)
    lm._gradient_checkpointing_func = lambda fn, *args: torch.utils.checkpoint.checkpoint(
        fn, *args, use_reentrant=reentrant)
    for got, want in zip(grads(), plain):
        assert_close64(got, want, what="gradient")


def test_resize_token_embeddings_grow_and_shrink(tmp_path):
    for tie in (True, False):
        torch.manual_seed(0)
        model = tiny_model("delta")
        if not tie:
            model = FastWeightsForCausalLM(type(model.config)(**{**model.config.to_dict(),
                                                                  "tie_embeddings": False}))
            model = model.double().eval()
        for new in (V + 6, V - 9):
            model.resize_token_embeddings(new)
            assert model.config.vocab_size == model.model.config.vocab_size == new
            ids = torch.tensor([[1, new - 1, 3, new - 2]])  # the new last ids work at once
            logits = model(ids).logits
            assert logits.shape == (1, 4, new)
            out = model.generate(ids, max_new_tokens=3, do_sample=False)
            assert out.shape == (1, 7) and out.max() < new
            folder = tmp_path / f"tie{tie}-{new}"
            model.save_pretrained(folder)
            loaded = FastWeightsForCausalLM.from_pretrained(folder).eval()
            assert torch.equal(loaded(ids).logits, logits)
            assert torch.equal(loaded.generate(ids, max_new_tokens=3, do_sample=False), out)


def test_native_to_hf_accepts_a_training_run_folder(tmp_path):
    from transformers import AutoModelForCausalLM

    from fastweights.train.checkpoint import save_checkpoint

    torch.manual_seed(0)
    lm = LanguageModel(LMConfig(vocab_size=V, d_model=12, n_layers=2, n_heads=2)).eval()
    save_checkpoint(tmp_path / "run", 3, lm, {"x": torch.ones(1)}, {"step": 3})
    native_to_hf(tmp_path / "run", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = prompt(6, 60)
    assert torch.equal(hf(ids).logits, lm(ids)[0])
    with pytest.raises(ValueError, match="src_dir"):
        native_to_hf(tmp_path / "nothing", tmp_path / "hf2")


# ---------------------------------------------------------------------------------------------
# The Trainer

def _trainer(model, tmp_path, train, collator, **args):
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
    from transformers import Trainer, TrainingArguments

    # plain SGD: Adam's first step would hide a wrong gradient scale
    defaults = {"per_device_train_batch_size": 3, "per_device_eval_batch_size": 3, "max_steps": 2,
                "learning_rate": 0.5, "optim": "sgd"}
    targs = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                              save_strategy="no", logging_strategy="no", dataloader_num_workers=0,
                              seed=0, **{**defaults, **args})
    return Trainer(model=model, args=targs, train_dataset=train, eval_dataset=train,
                   data_collator=collator)


def test_trainer_evaluates_packed_batches_per_document(tmp_path):
    model = tiny_model(MIXERS["mixed"]).float()
    docs = documents(seed=70)
    trainer = _trainer(model, tmp_path, [{"input_ids": d} for d in docs],
                       DataCollatorWithFlattening())
    metrics = trainer.evaluate()
    with torch.no_grad():
        total, count = doc_losses(model, docs)
    assert abs(metrics["eval_loss"] - (total / count).item()) < 1e-5
    trainer.train()  # and trains on them


class RightPadCollator:
    """Pads on the right with labels -100 at pads, as DataCollatorForLanguageModeling does."""

    def __call__(self, features):
        n = max(len(f["input_ids"]) for f in features)
        ids = torch.tensor([f["input_ids"] + [PAD] * (n - len(f["input_ids"])) for f in features])
        mask = torch.tensor([[1] * len(f["input_ids"]) + [0] * (n - len(f["input_ids"]))
                             for f in features])
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_trainer_with_right_padding(tmp_path):
    model = tiny_model("delta").float()
    docs = documents(seed=80)
    trainer = _trainer(model, tmp_path, [{"input_ids": d} for d in docs], RightPadCollator())
    with torch.no_grad():
        total, count = doc_losses(model, docs)
    assert abs(trainer.evaluate()["eval_loss"] - (total / count).item()) < 1e-5
    trainer.train()


def _trained(tmp_path, docs, collator, **args):
    model = tiny_model(MIXERS["mixed"]).float().train()
    _trainer(model, tmp_path, [{"input_ids": d} for d in docs], collator, **args).train()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("reentrant", [True, False])
def test_trainer_with_gradient_checkpointing_matches_plain_training(tmp_path, reentrant):
    docs = documents(seed=90) * 2
    collator = DataCollatorWithFlattening()
    plain = _trained(tmp_path / "plain", docs, collator)
    # TrainingArguments' name for it: activation_checkpointing in later 5.x, the old one warns
    name = ("activation_checkpointing" if "activation_checkpointing" in
            {f.name for f in dataclasses.fields(TrainingArguments)} else "gradient_checkpointing")
    ckpt = _trained(tmp_path / "ckpt", docs, collator,
                    **{name: True, f"{name}_kwargs": {"use_reentrant": reentrant}})
    for n in plain:
        assert torch.allclose(ckpt[n], plain[n], atol=1e-6), n
    assert any(not torch.equal(p, q) for p, q in zip(plain.values(),
                                                     tiny_model(MIXERS["mixed"]).float().parameters()))


def test_trainer_gradient_accumulation_uses_num_items_in_batch(tmp_path):
    # 2 accumulated batches of 3 documents == 1 batch of 6: the loss is normalised by the count
    # of targets over both (num_items_in_batch), not averaged per batch.
    docs = documents(seed=100) + documents(seed=110)
    collator = DataCollatorWithFlattening()
    one = _trained(tmp_path / "one", docs, collator, per_device_train_batch_size=6, max_steps=1)
    acc = _trained(tmp_path / "acc", docs, collator, gradient_accumulation_steps=2, max_steps=1)
    for n in one:
        assert torch.allclose(acc[n], one[n], atol=1e-6), n
