"""The SC-NLM (trainer/caption/scnlm.py) against slow references written straight from Kiros et al.
2014's eqs. 9-11 with explicit loops, its gradients, and its greedy decode against a step-by-step
decode one row at a time."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call

from trainer.caption.scnlm import SCNLM, training_windows

V, TAGS, K, G, F, D, CONTEXT, FORWARD = 7, 4, 4, 4, 3, 5, 2, 1
START, PAD = 0, 3  # the start word's id and the padding tag's


def random_model(seed: int = 0) -> SCNLM:
    """A small float64 SC-NLM with every parameter, biases included, drawn from N(0, 0.7^2): logits
    of a few units, so the distributions are far from uniform, and the ReLU of eq. 11 clips."""
    model = SCNLM(V, TAGS, D, word_dim=K, attribute_dim=G, factors=F, context=CONTEXT,
                  forward_tags=FORWARD, seed=seed).double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(0.7 * torch.randn(parameter.shape, generator=generator,
                                                    dtype=torch.float64))
    return model


def random_inputs(rows: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    context_words = torch.randint(V, (rows, CONTEXT), generator=generator)
    tags = torch.randint(TAGS, (rows, FORWARD + 1), generator=generator)
    u = torch.randn(rows, D, generator=generator, dtype=torch.float64)
    return context_words, tags, u


def matrix(tensor: torch.Tensor) -> list:
    return tensor.detach().tolist()


def reference_attribute_inputs(model: SCNLM, tags: list[int], u: list[float]) -> list[float]:
    """The argument of eq. 11's ReLU: sum_{i=n}^{n+k} T^(i) t_i + T^(u) u + b, by loops."""
    tag_vectors, structure = matrix(model.tag_vectors), matrix(model.structure_matrices)
    content, bias = matrix(model.content_matrix), matrix(model.attribute_bias)
    return [bias[g]
            + sum(structure[j][g][k] * tag_vectors[tag][k]
                  for j, tag in enumerate(tags) for k in range(K))
            + sum(content[g][d] * u[d] for d in range(D))
            for g in range(G)]


def reference_attributes(model: SCNLM, tags: list[int], u: list[float]) -> list[float]:
    """Eq. 11: u_hat = max(0, ...)."""
    return [max(x, 0.0) for x in reference_attribute_inputs(model, tags, u)]


def reference_folded(model: SCNLM) -> list[list[float]]:
    """E = (W^fk)^T W^fv [K, V] by loops."""
    w_fk, w_fv = matrix(model.key_factors), matrix(model.word_factors)
    return [[sum(w_fk[f][k] * w_fv[f][w] for f in range(F)) for w in range(V)] for k in range(K)]


def reference_probabilities(model: SCNLM, context_words: list[int], tags: list[int],
                            u: list[float]) -> list[float]:
    """P(w_n = i | ...) from the UNFACTORED tensor of eq. 9, T^u_hat = (W^fv)^T diag(W^fd u_hat)
    W^fk [V, K], and r_hat of eq. 10: exp(T^u_hat[i] . r_hat + b_i) / sum_j exp(...)."""
    w_fk, w_fd, w_fv = (matrix(model.key_factors), matrix(model.attribute_factors),
                        matrix(model.word_factors))
    u_hat = reference_attributes(model, tags, u)
    scale = [sum(w_fd[f][g] * u_hat[g] for g in range(G)) for f in range(F)]  # W^fd u_hat
    tensor = [[sum(w_fv[f][i] * scale[f] * w_fk[f][k] for f in range(F)) for k in range(K)]
              for i in range(V)]
    # r_hat = sum_{i=1}^{n-1} C^(i) E(:, w_{n-i}): w_{n-i} = context_words[CONTEXT - i], and
    # C^(i) is context_matrices[CONTEXT - i].
    folded, c = reference_folded(model), matrix(model.context_matrices)
    r_hat = [sum(c[CONTEXT - i][k][l] * folded[l][context_words[CONTEXT - i]]
                 for i in range(1, CONTEXT + 1) for l in range(K)) for k in range(K)]
    bias = matrix(model.output_bias)
    scores = [math.exp(sum(tensor[i][k] * r_hat[k] for k in range(K)) + bias[i])
              for i in range(V)]
    return [score / sum(scores) for score in scores]


def test_probabilities_equal_the_unfactored_tensor_reference():
    model = random_model()
    context_words, tags, u = random_inputs(rows=6)
    probabilities = model.log_probs(context_words, tags, u).exp()
    expected = torch.tensor([reference_probabilities(model, *row)
                             for row in zip(matrix(context_words), matrix(tags), matrix(u),
                                           strict=True)],
                            dtype=torch.float64)
    torch.testing.assert_close(probabilities, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(probabilities.sum(1), torch.ones(6, dtype=torch.float64))
    assert probabilities.max() > 0.5  # a peaked distribution, not a near-uniform one


def test_folded_words_and_attributes_equal_the_equations():
    model = random_model()
    torch.testing.assert_close(model.folded_words(),
                               torch.tensor(reference_folded(model), dtype=torch.float64).T)
    _, tags, u = random_inputs(rows=8)
    rows = list(zip(matrix(tags), matrix(u), strict=True))
    inputs = [reference_attribute_inputs(model, *row) for row in rows]
    assert any(x < 0 for row in inputs for x in row) and any(x > 0 for row in inputs for x in row)
    expected = [reference_attributes(model, *row) for row in rows]
    torch.testing.assert_close(model.attributes(tags, u),
                               torch.tensor(expected, dtype=torch.float64))


class LogProbs(nn.Module):
    """`SCNLM.log_probs` as a module's forward, so that functional_call can swap its parameters."""

    def __init__(self, model: SCNLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, context_words, tags, u):
        return self.model.log_probs(context_words, tags, u)


def test_log_probs_gradients_match_finite_differences():
    model = random_model()
    context_words, tags, u = random_inputs(rows=3)
    wrapped = LogProbs(model)
    names, parameters = zip(*[(name, p.detach().clone().requires_grad_())
                              for name, p in wrapped.named_parameters()], strict=True)

    def log_probs(u, *parameters):
        parameters = dict(zip(names, parameters, strict=True))
        return functional_call(wrapped, parameters, (context_words, tags, u))

    assert torch.autograd.gradcheck(log_probs, (u.requires_grad_(), *parameters))


def hand_set_model() -> SCNLM:
    """Words <s>=0, dog=1, cat=2, runs=3; tags NOUN=0, VERB=1, PAD=2; u = (1, 0) means a dog,
    (0, 1) a cat. One factor per word; every word folds to E(:, w) = 1 and C = 1, so r_hat = 1
    and the word's logit is its factor's attribute. u_hat = ReLU(T^(n) t_n + T^(u) u):
    (dog noun, cat noun, verb), t_NOUN = 1, t_VERB = -1, T^(n) = (1, 1, -1), T^(u) rows
    (1, -1), (-1, 1), (0, 0). So the caption is a noun named by u where the tag is NOUN and
    `runs` where it is VERB."""
    model = SCNLM(4, 3, 2, word_dim=1, attribute_dim=3, factors=4, context=1, forward_tags=1)
    with torch.no_grad():
        model.word_factors.copy_(torch.tensor([[0.0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1],
                                               [1, 0, 0, 0]]))  # factor 3: <s>, no attribute
        model.key_factors.fill_(1.0)
        model.attribute_factors.copy_(torch.tensor([[1.0, 0, 0], [0, 1, 0], [0, 0, 1],
                                                    [0, 0, 0]]))
        model.output_bias.zero_()
        model.context_matrices.fill_(1.0)
        model.tag_vectors.copy_(torch.tensor([[1.0], [-1.0], [0.0]]))
        model.structure_matrices.zero_()
        model.structure_matrices[0] = torch.tensor([[1.0], [1.0], [-1.0]])
        model.content_matrix.copy_(torch.tensor([[1.0, -1.0], [-1.0, 1.0], [0.0, 0.0]]))
        model.attribute_bias.zero_()
    return model


def test_greedy_decode_finds_the_hand_set_caption():
    noun, verb, pad = 0, 1, 2
    u = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    tags = torch.tensor([[noun, verb, pad], [noun, verb, noun], [verb, noun, noun]])
    lengths = torch.tensor([2, 3, 1])
    decoded = hand_set_model().greedy_decode(u, tags, lengths, start_id=0, pad_tag=pad)
    assert decoded.tolist() == [[1, 3, -1], [2, 3, 2], [3, -1, -1]]


def reference_decode(model: SCNLM, u: torch.Tensor, tags: list[int],
                     banned: list[int]) -> tuple[list[int], float]:
    """One row, one step at a time through log_probs: the caption and its log-likelihood."""
    words, total = [], 0.0
    padded = tags + [PAD] * FORWARD
    for n in range(len(tags)):
        history = [START] * CONTEXT + words
        log_probs = model.log_probs(torch.tensor([history[n:n + CONTEXT]]),
                                    torch.tensor([padded[n:n + FORWARD + 1]]), u[None])[0].detach()
        log_probs[[START, *banned]] = -math.inf
        words.append(int(log_probs.argmax()))
        total += float(log_probs.max())
    return words, total


@pytest.fixture
def decode_case():
    """A random model whose <s> outscores every word (bias +100) and whose padding tag weighs
    heavily, four rows of lengths 5, 1, 0, 3; the tags past a row's length are not padding but
    are to be read as padding."""
    model = random_model(seed=2)
    with torch.no_grad():
        model.output_bias[START] += 100.0
        model.tag_vectors[PAD] *= 5.0
    generator = torch.Generator().manual_seed(3)
    u = torch.randn(4, D, generator=generator, dtype=torch.float64)
    tags = torch.randint(TAGS - 1, (4, 5), generator=generator)  # no PAD
    lengths = torch.tensor([5, 1, 0, 3])
    return model, u, tags, lengths


def test_greedy_decode_equals_a_step_by_step_reference(decode_case):
    model, u, tags, lengths = decode_case
    assert (model(torch.full((4, CONTEXT), START), tags[:, :FORWARD + 1], u).argmax(1)
            == START).all()  # so <s> must be excluded, not merely unlikely
    unbanned = model.greedy_decode(u, tags, lengths, START, PAD)
    favourites = unbanned[unbanned >= 0].bincount().topk(2).indices.tolist()  # then banned
    for banned in ([], favourites):
        decoded = model.greedy_decode(u, tags, lengths, START, PAD, banned=banned)
        for row, length in enumerate(lengths.tolist()):
            words, _ = reference_decode(model, u[row], tags[row, :length].tolist(), banned)
            assert decoded[row].tolist() == words + [-1] * (5 - length)
            alone = model.greedy_decode(u[row:row + 1], tags[row:row + 1], lengths[row:row + 1],
                                        START, PAD, banned=banned)
            assert torch.equal(alone[0], decoded[row])
        assert not torch.isin(decoded, torch.tensor([START, *banned])).any()


def test_training_windows_feed_the_model_what_the_decode_does(decode_case):
    assert [t.tolist() for t in training_windows([5, 6, 4], [1, 2, 0], 2, 1, START, PAD)] == [
        [[0, 0], [0, 5], [5, 6]], [[1, 2], [2, 0], [0, 3]], [5, 6, 4]]
    assert [tuple(t.shape) for t in training_windows([], [], 2, 1, START, PAD)] == [
        (0, 2), (0, 2), (0,)]
    model, u, tags, lengths = decode_case
    decoded = model.greedy_decode(u, tags, lengths, START, PAD, banned=[6])
    for row, length in enumerate(lengths.tolist()):
        words = decoded[row, :length].tolist()
        context_words, windows, targets = training_windows(
            words, tags[row, :length].tolist(), CONTEXT, FORWARD, START, PAD)
        log_probs = model.log_probs(context_words, windows, u[row].expand(length, D))
        likelihood = log_probs.gather(1, targets[:, None]).sum()
        _, expected = reference_decode(model, u[row], tags[row, :length].tolist(), [6])
        assert likelihood.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_same_seed_same_model_and_decode():
    def build(seed):
        return SCNLM(V, TAGS, D, word_dim=K, attribute_dim=G, factors=F, context=CONTEXT,
                     forward_tags=FORWARD, seed=seed)

    state = torch.get_rng_state()
    first, second, other = build(7), build(7), build(8)
    assert torch.equal(torch.get_rng_state(), state)  # a seeded model leaves the global RNG
    for name, parameter in first.named_parameters():
        assert torch.equal(parameter, dict(second.named_parameters())[name])
    assert not torch.equal(first.word_factors, other.word_factors)
    assert first.word_factors.abs().max() <= 0.08 and first.output_bias.abs().max() == 0
    u, tags = torch.randn(3, D), torch.randint(TAGS, (3, 4))
    lengths = torch.tensor([4, 2, 3])
    assert torch.equal(first.greedy_decode(u, tags, lengths, START, PAD),
                       second.greedy_decode(u, tags, lengths, START, PAD))


def test_sizes_rebuild_the_model():
    model = random_model()
    rebuilt = SCNLM(**model.sizes()).double()
    rebuilt.load_state_dict(model.state_dict())
    context_words, tags, u = random_inputs(rows=3)
    assert torch.equal(rebuilt(context_words, tags, u), model(context_words, tags, u))
