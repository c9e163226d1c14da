"""The sentence encoders against slow references written from their papers' equations (Kiros et
al. 2014: the LSTM of eqs. 1-5, the linear encoder of Section 3.2), and their registry."""

from __future__ import annotations

import pytest
import torch

from defrag.vocab import Vocabulary
from trainer.config import Config, ConfigError
from trainer.encoders import NAMES, encoder_class
from trainer.encoders.fragments import SentenceEncoder
from trainer.encoders.linear import LinearEncoder
from trainer.encoders.lstm import LSTMEncoder
from trainer.model import DeFragModel

# Hand-built sentences of word ids: one word, lengths 4, 2, 3 in one batch, and an empty one.
SENTENCES = [[3], [0, 5, 2, 5], [], [1, 4], [6, 2, 0]]


def flat(sentences):
    words = torch.tensor([w for sentence in sentences for w in sentence], dtype=torch.long)
    owner = torch.tensor([k for k, sentence in enumerate(sentences) for _ in sentence],
                         dtype=torch.long)
    return words, owner


def reference_lstm(encoder: LSTMEncoder, sentence: list[int]) -> torch.Tensor:
    """Kiros eqs. 1-5 one word at a time: X_t the word's vector, M and C start at zero."""
    K = encoder.embed_dim
    W_x = dict(zip("ifco", encoder.weight_x.split(K, 1), strict=True))
    W_h = dict(zip("ifco", encoder.weight_h.split(K, 1), strict=True))
    W_c = dict(zip("ifo", encoder.weight_c.split(K, 1), strict=True))
    b = dict(zip("ifco", encoder.bias.split(K), strict=True))
    M = C = encoder.bias.new_zeros(K)
    for word in sentence:
        X = encoder.word_vectors[word]
        I = torch.sigmoid(X @ W_x["i"] + M @ W_h["i"] + C @ W_c["i"] + b["i"])
        F = torch.sigmoid(X @ W_x["f"] + M @ W_h["f"] + C @ W_c["f"] + b["f"])
        C = F * C + I * torch.tanh(X @ W_x["c"] + M @ W_h["c"] + b["c"])
        O = torch.sigmoid(X @ W_x["o"] + M @ W_h["o"] + C @ W_c["o"] + b["o"])
        M = O * torch.tanh(C)
    return M


def reference_linear(encoder: LinearEncoder, sentence: list[int]) -> torch.Tensor:
    """v = W sum_i w_i (Kiros 3.2) with a loop over the words."""
    total = encoder.word_vectors.new_zeros(encoder.word_vectors.shape[1])
    for word in sentence:
        total = total + encoder.word_vectors[word]
    return encoder.projection.weight @ total


def make(cls, seed=0):
    torch.manual_seed(seed)
    encoder = cls(torch.randn(7, 5), embed_dim=6, train_word_vectors=True).double()
    with torch.no_grad():  # non-zero biases, so that every term of the equations counts
        for parameter in encoder.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return encoder


@pytest.mark.parametrize("cls,reference", [(LSTMEncoder, reference_lstm),
                                           (LinearEncoder, reference_linear)])
def test_encoder_matches_reference(cls, reference):
    encoder = make(cls)
    words, owner = flat(SENTENCES)
    got = encoder(words, owner, num_sentences=len(SENTENCES))
    want = torch.stack([reference(encoder, sentence) for sentence in SENTENCES])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert (got[2] == 0).all()  # a sentence without words is the zero vector
    weights = torch.randn_like(got)
    params = [p for p in encoder.parameters() if p.requires_grad]
    got_grads = torch.autograd.grad((got * weights).sum(), params)
    want_grads = torch.autograd.grad((want * weights).sum(), params)
    for got_g, want_g in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got_g, want_g, rtol=1e-10, atol=1e-12)
    # A sentence's vector does not depend on the others of its batch.
    alone = encoder(*flat(SENTENCES[1:2]), num_sentences=1)
    torch.testing.assert_close(alone[0], got[1], rtol=1e-10, atol=1e-12)


def test_lstm_reads_words_in_order_and_starts_from_kiros_init():
    encoder = LSTMEncoder(torch.randn(7, 5), embed_dim=6)
    for weight in (encoder.weight_x, encoder.weight_h, encoder.weight_c):
        assert weight.abs().max() <= 0.08  # uniform in [-0.08, 0.08] (Kiros 3.1)
    assert not encoder.word_vectors.requires_grad  # W_T fixed (Kiros 2.2)
    forward = encoder(*flat([[0, 5, 2]]), num_sentences=1)
    backward = encoder(*flat([[2, 5, 0]]), num_sentences=1)
    assert not torch.allclose(forward, backward)


def test_registry_builds_every_encoder_from_config():
    assert set(NAMES) >= {"fragments", "lstm", "linear"}
    assert encoder_class("fragments") is SentenceEncoder
    vocab = Vocabulary(words=["a", "red", "star", "blue"], relations=["amod", "det"])
    for name in NAMES:
        cfg = Config.from_dict({"model": {"sentence_encoder": name, "embed_dim": 8, "word_dim": 4,
                                          "pretrained": False, "backbone": "resnet18"},
                                "objective": {"use_fragment": name == "fragments"}})
        model = DeFragModel.from_config(cfg.model, vocab)
        assert type(model.sentence) is encoder_class(name)
        assert model.sentence.word_vectors.shape == (4, 4)
    with pytest.raises(ValueError, match="sentence encoder 'gru'"):
        encoder_class("gru")


@pytest.mark.parametrize("overrides,message", [
    (["model.sentence_encoder=gru"], "model.sentence_encoder = 'gru': expected one of"),
    (["model.sentence_encoder=lstm"], "objective.use_fragment=true .* set objective.use_fragment"),
    (["model.sentence_encoder=linear", "objective.use_fragment=false", "model.mean_pool=true"],
     "model.mean_pool is the fragments encoder's"),
    (["objective.score=dot"], "objective.score = 'dot': expected one of 'eq6', 'cosine'"),
])
def test_config_refuses_unknown_and_incoherent_choices(overrides, message):
    with pytest.raises(ConfigError, match=message):
        Config.load(overrides=overrides)
    kiros = Config.load(overrides=["model.sentence_encoder=lstm", "objective.use_fragment=false",
                                   "objective.score=cosine", "objective.margin=0.2"])
    assert (kiros.model.sentence_encoder, kiros.objective.score) == ("lstm", "cosine")
