"""The sentence encoders against slow references written from their papers' equations (Kiros et
al. 2014: the LSTM of eqs. 1-5, the linear encoder of Section 3.2; Socher et al. 2014: the DT-RNN
and SDT-RNN of eq. 4, by recursion over the tree; VSE++'s GRU from Cho et al.'s gate equations),
and their registry."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from defrag.vocab import Vocabulary
from trainer.batch import tree_fields
from trainer.config import Config, ConfigError
from trainer.encoders import NAMES, encoder_class
from trainer.encoders.dtrnn import DTRNNEncoder
from trainer.encoders.fragments import SentenceEncoder
from trainer.encoders.gru import GRUEncoder
from trainer.encoders.linear import LinearEncoder
from trainer.encoders.lstm import LSTMEncoder
from trainer.encoders.sdtrnn import SDTRNNEncoder
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


def reference_gru(encoder: GRUEncoder, sentence: list[int]) -> torch.Tensor:
    """Cho et al. 2014's GRU one word at a time (r, z gates; the candidate n resets W_hn h + b_hn),
    h starting at zero; the sentence vector is the last h."""
    rnn = encoder.rnn
    W_i = dict(zip("rzn", rnn.weight_ih_l0.split(encoder.embed_dim), strict=True))
    W_h = dict(zip("rzn", rnn.weight_hh_l0.split(encoder.embed_dim), strict=True))
    b_i = dict(zip("rzn", rnn.bias_ih_l0.split(encoder.embed_dim), strict=True))
    b_h = dict(zip("rzn", rnn.bias_hh_l0.split(encoder.embed_dim), strict=True))
    h = rnn.bias_ih_l0.new_zeros(encoder.embed_dim)
    for word in sentence:
        x = encoder.word_vectors[word]
        r = torch.sigmoid(W_i["r"] @ x + b_i["r"] + W_h["r"] @ h + b_h["r"])
        z = torch.sigmoid(W_i["z"] @ x + b_i["z"] + W_h["z"] @ h + b_h["z"])
        n = torch.tanh(W_i["n"] @ x + b_i["n"] + r * (W_h["n"] @ h + b_h["n"]))
        h = (1 - z) * n + z * h
    return h


def make(cls, seed=0):
    torch.manual_seed(seed)
    encoder = cls(torch.randn(7, 5), embed_dim=6, train_word_vectors=True).double()
    with torch.no_grad():  # non-zero biases, so that every term of the equations counts
        for parameter in encoder.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return encoder


@pytest.mark.parametrize("cls,reference", [(LSTMEncoder, reference_lstm),
                                           (LinearEncoder, reference_linear),
                                           (GRUEncoder, reference_gru)])
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
    assert set(NAMES) >= {"fragments", "lstm", "linear", "dtrnn", "sdtrnn", "gru"}
    assert encoder_class("fragments") is SentenceEncoder
    vocab = Vocabulary(words=["a", "red", "star", "blue"], relations=["amod", "det"])
    for name in NAMES:
        cfg = Config.from_dict({"model": {"sentence_encoder": name, "embed_dim": 8, "word_dim": 4,
                                          "pretrained": False, "backbone": "resnet18"},
                                "objective": {"use_fragment": name == "fragments"}})
        model = DeFragModel.from_config(cfg.model, vocab)
        assert type(model.sentence) is encoder_class(name)
        assert model.sentence.word_vectors.shape == (4, 4)
    with pytest.raises(ValueError, match="sentence encoder 'transformer'"):
        encoder_class("transformer")


@pytest.mark.parametrize("overrides,message", [
    (["model.sentence_encoder=transformer"],
     "model.sentence_encoder = 'transformer': expected one of"),
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


# ---------------------------------------------------------------------------------------------
# Socher et al.'s DT-RNN and SDT-RNN (Socher 2014, Sections 3.2-3.3, eq. 4)

# Hand-built trees: (word ids, heads within the sentence (-1: root), relation ids).
TREES = [
    ([3], [-1], [0]),  # a single word
    ([0, 5, 2, 6], [1, 2, 3, -1], [1, 1, 1, 2]),  # a chain, root last
    # a node with left children at distances 1 and 2 and right children at 1 and 2 (and a
    # grandchild): "Students ride bikes at night"-like, with one more left child
    ([1, 4, 2, 0, 5, 6], [2, 2, -1, 2, 2, 4], [0, 1, 2, 0, 1, 3]),
    ([], [], []),  # no word
    ([2, 2, 4, 1], [1, -1, 1, 1], [0, 0, 0, 0]),  # one relation type throughout
    ([6, 0, 3, 1, 2], [1, -1, -1, 2, 2], [1, 2, 2, 0, 3]),  # a forest of two trees
    ([0, 1, 2, 3, 4], [4, 4, 4, 4, -1], [0, 1, 2, 0, 1]),  # 4 left children: beyond max_children
]


def flat_trees(trees):
    words, owner = flat([t[0] for t in trees])
    head, relation = tree_fields([np.array(list(zip(t[1], t[2], strict=True)),
                                           dtype=np.int64).reshape(-1, 2) for t in trees])
    return words, owner, head, relation


def reference_tree(encoder, tree, matrix_of) -> torch.Tensor:
    """Eq. 4 by recursion, one node at a time: h_i = tanh((W_v x_i + sum_j l(j) W_pos(i,j) h_j)
    / l(i)); the sentence is the root's h (the mean of the roots' for a forest)."""
    words, heads, relations = tree

    def node(i):  # (h_i, l(i))
        total, leaves = encoder.word_matrix @ encoder.word_vectors[words[i]], 1
        for j in (c for c in range(len(words)) if heads[c] == i):
            h_j, l_j = node(j)
            total = total + l_j * matrix_of(encoder, tree, i, j) @ h_j
            leaves += l_j
        return torch.tanh(total / leaves), leaves

    roots = [i for i in range(len(words)) if heads[i] == -1]
    if not roots:
        return encoder.word_matrix.new_zeros(encoder.embed_dim)
    return torch.stack([node(r)[0] for r in roots]).mean(0)


def position_matrix(encoder, tree, i, j):
    """W_l1, W_l2, ... / W_r1, ...: j's rank among i's children on its side, nearest first."""
    heads = tree[1]
    side = [c for c in range(len(heads)) if heads[c] == i and (c < i) == (j < i)]
    rank = sorted(side, key=lambda c: abs(c - i)).index(j)
    if rank >= encoder.max_children:
        return torch.eye(encoder.embed_dim, dtype=encoder.word_matrix.dtype)
    return encoder.child_matrices[rank + (encoder.max_children if j > i else 0)]


def relation_matrix(encoder, tree, i, j):
    return encoder.child_matrices[tree[2][j]]


def make_tree(name, seed=0):
    torch.manual_seed(seed)
    if name == "dtrnn":
        encoder = DTRNNEncoder(torch.randn(7, 5), embed_dim=6, max_children=3,
                               train_word_vectors=True)
    else:
        encoder = SDTRNNEncoder(torch.randn(7, 5), embed_dim=6, num_relations=4,
                                train_word_vectors=True)
    encoder = encoder.double()
    with torch.no_grad():  # away from the identities, so that a wrong matrix shows
        for parameter in encoder.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    return encoder


@pytest.mark.parametrize("name,matrix_of", [("dtrnn", position_matrix),
                                            ("sdtrnn", relation_matrix)])
def test_tree_encoder_matches_reference(name, matrix_of):
    encoder = make_tree(name)
    got = encoder(*flat_trees(TREES), num_sentences=len(TREES))
    want = torch.stack([reference_tree(encoder, tree, matrix_of) for tree in TREES])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert (got[3] == 0).all()  # a sentence without words is the zero vector
    weights = torch.randn_like(got)
    params = [p for p in encoder.parameters() if p.requires_grad]
    got_grads = torch.autograd.grad((got * weights).sum(), params)
    want_grads = torch.autograd.grad((want * weights).sum(), params, allow_unused=True)
    for got_g, want_g in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got_g, torch.zeros_like(got_g) if want_g is None else want_g,
                                   rtol=1e-10, atol=1e-12)
    for k, tree in enumerate(TREES):  # a sentence alone equals it in the batch
        alone = encoder(*flat_trees([tree]), num_sentences=1)
        torch.testing.assert_close(alone[0], got[k], rtol=1e-10, atol=1e-12)


def test_dtrnn_positions_and_sdtrnn_relations_change_the_sentence():
    """The DT-RNN tells left from right and near from far; the SDT-RNN reads the relation."""
    dtrnn, sdtrnn = make_tree("dtrnn"), make_tree("sdtrnn")
    left = ([0, 1], [1, -1], [0, 0])
    right = ([1, 0], [-1, 0], [0, 0])
    far = ([0, 2, 1], [2, 2, -1], [0, 0, 0])  # word 0 is the second child on the left
    near = ([2, 0, 1], [2, 2, -1], [0, 0, 0])
    one = dtrnn(*flat_trees([left, right, far, near]), num_sentences=4)
    assert not torch.allclose(one[0], one[1]) and not torch.allclose(one[2], one[3])
    other = ([0, 1], [1, -1], [2, 0])
    two = sdtrnn(*flat_trees([left, other]), num_sentences=2)
    assert not torch.allclose(two[0], two[1])


def test_tree_encoders_start_from_block_identities_and_refuse_a_batch_without_trees():
    encoder = DTRNNEncoder(torch.randn(7, 5), embed_dim=8)  # W_v [8, 5]: [I_5; I_3 0]
    assert encoder.child_matrices.shape == (12, 8, 8)  # W_l1..W_l6, W_r1..W_r6
    torch.testing.assert_close(encoder.child_matrices[3], torch.eye(8), atol=0.1, rtol=0)
    assert (encoder.word_matrix[5:, :3] - torch.eye(3)).abs().max() < 0.1
    assert not encoder.word_vectors.requires_grad  # not finetuned (Socher 6.1)
    words, owner = flat([[0, 1]])
    with pytest.raises(ValueError, match="dtrnn sentence encoder needs the captions' dependency"):
        encoder(words, owner, None, None, num_sentences=1)


def test_encode_tree_reattaches_children_of_dropped_words_and_maps_unknown_relations():
    vocab = Vocabulary(words=["a", "dog", "runs", "grass"], relations=["det", "nsubj"])
    caption = {"tokens": ["a", "dog", "runs", "on", "the", "grass"],
               "tree": {"heads": [1, 2, -1, 2, 5, 3],
                        "relations": ["det", "nsubj", "root", "prep", "det", "pobj"],
                        "pos": ["DET", "NOUN", "VERB", "ADP", "DET", "NOUN"]}}
    # "on" and "the" are dropped: "grass" hangs on "runs", the nearest kept ancestor.
    assert vocab.encode_tree(caption).tolist() == [[1, 0], [2, 1], [-1, 2], [2, 2]]
    assert vocab.other_relation == 2
    rootless = {"tokens": ["dog", "a"], "tree": {"heads": [-1, 0], "relations": ["x", "det"]}}
    assert vocab.encode_tree({**rootless, "tokens": ["on", "a"]}).tolist() == [[-1, 0]]
    with pytest.raises(ValueError, match="cycle"):
        vocab.encode_tree({"tokens": ["a", "dog"],
                           "tree": {"heads": [1, 0], "relations": ["det", "det"]}})
    with pytest.raises(ValueError, match="2 heads"):
        vocab.encode_tree({"tokens": ["a"], "tree": {"heads": [-1, 0], "relations": ["x"]}})
