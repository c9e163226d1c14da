"""The structure-content neural language model (SC-NLM) of Kiros, Salakhutdinov & Zemel 2014,
Sections 2.4-2.5 (eqs. 9-11): a factored multiplicative log-bilinear language model whose
attribute vector mixes the coming part-of-speech tags (structure) and a content vector u (a
sentence or image embedding of the joint space), for generating captions.

The paper's names here, for vocabulary V, word dim K, attribute dim G, factors F, content dim D:
  W^fv [F, V], W^fk [F, K], W^fd [F, G]   word_factors, key_factors, attribute_factors (eq. 9)
  b_i [V]                                 output_bias (the softmax's bias)
  C^(i) [K, K]                            context_matrices[context - i] (eq. 10): entry j
                                          multiplies context_words[:, j], oldest word first
  t_i [K]                                 tag_vectors[tag], a learned lookup table (eq. 11)
  T^(i), i = n..n+k                       structure_matrices[j] [G, K] multiplies t_{n+j}
                                          (the paper writes G x G; with G = K the same)
  T^(u) [G, D], b [G]                     content_matrix, attribute_bias (eq. 11; the paper
                                          writes G x K, its u being K-dimensional)

The paper uses G = K = 300 and F = 100 (the defaults) but states neither the word context size
n-1 nor the forward tag context k: the defaults context = 5 (as in Kiros' public multimodal
log-bilinear code) and forward_tags = 3 are this project's choice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

INIT_RANGE = 0.08  # weights uniform in [-0.08, 0.08], as Kiros' LSTM (Kiros 3.1); biases zero


class SCNLM(nn.Module):
    """P(w_n | w_{n-context}..w_{n-1}, t_n..t_{n+forward_tags}, u) of eqs. 9-11.

    Weights are drawn uniformly from [-INIT_RANGE, INIT_RANGE], from a torch.Generator seeded
    with `seed` when one is given (the global generator otherwise); the biases start at zero.
    """

    def __init__(self, vocab_size: int, num_tags: int, content_dim: int, word_dim: int = 300,
                 attribute_dim: int = 300, factors: int = 100, context: int = 5,
                 forward_tags: int = 3, seed: int | None = None) -> None:
        super().__init__()
        self.context, self.forward_tags = context, forward_tags
        self.word_factors = nn.Parameter(torch.empty(factors, vocab_size))  # W^fv
        self.key_factors = nn.Parameter(torch.empty(factors, word_dim))  # W^fk
        self.attribute_factors = nn.Parameter(torch.empty(factors, attribute_dim))  # W^fd
        self.output_bias = nn.Parameter(torch.zeros(vocab_size))
        self.context_matrices = nn.Parameter(torch.empty(context, word_dim, word_dim))
        self.tag_vectors = nn.Parameter(torch.empty(num_tags, word_dim))
        self.structure_matrices = nn.Parameter(
            torch.empty(forward_tags + 1, attribute_dim, word_dim))
        self.content_matrix = nn.Parameter(torch.empty(attribute_dim, content_dim))  # T^(u)
        self.attribute_bias = nn.Parameter(torch.zeros(attribute_dim))
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        for weight in (self.word_factors, self.key_factors, self.attribute_factors,
                       self.context_matrices, self.tag_vectors, self.structure_matrices,
                       self.content_matrix):
            nn.init.uniform_(weight, -INIT_RANGE, INIT_RANGE, generator=generator)

    def sizes(self) -> dict[str, int]:
        """The constructor's sizes: SCNLM(**model.sizes()) rebuilds the model to load weights."""
        factors, vocab_size = self.word_factors.shape
        return {"vocab_size": vocab_size, "num_tags": self.tag_vectors.shape[0],
                "content_dim": self.content_matrix.shape[1], "word_dim": self.key_factors.shape[1],
                "attribute_dim": self.attribute_factors.shape[1], "factors": factors,
                "context": self.context, "forward_tags": self.forward_tags}

    def folded_words(self) -> Tensor:
        """The folded word embeddings E = (W^fk)^T W^fv of Section 2.4, transposed: [V, K]."""
        return self.word_factors.T @ self.key_factors

    def attributes(self, tags: Tensor, u: Tensor) -> Tensor:
        """Eq. 11: tags [B, forward_tags+1] (t_n..t_{n+k}), u [B, D] -> u_hat [B, G] =
        ReLU(sum_j T^(n+j) t_{n+j} + T^(u) u + b)."""
        structure = torch.einsum("bjk,jgk->bg", self.tag_vectors[tags], self.structure_matrices)
        return torch.relu(structure + u @ self.content_matrix.T + self.attribute_bias)

    def forward(self, context_words: Tensor, tags: Tensor, u: Tensor) -> Tensor:
        """Context words [B, context] (oldest first), tags [B, forward_tags+1], u [B, D] ->
        logits [B, V]: W^fv(:, i)^T f + b_i, with f = (W^fk r_hat) * (W^fd u_hat) (Section 2.4),
        r_hat of eq. 10 and u_hat of eq. 11."""
        # E(:, w) of the context words only, [B, context, K], rather than all of E.
        embedded = self.word_factors.T[context_words] @ self.key_factors
        r_hat = torch.einsum("bjk,jlk->bl", embedded, self.context_matrices)  # eq. 10
        f = (r_hat @ self.key_factors.T) * (self.attributes(tags, u) @ self.attribute_factors.T)
        return f @ self.word_factors + self.output_bias

    def log_probs(self, context_words: Tensor, tags: Tensor, u: Tensor) -> Tensor:
        """log P(w_n = i | ...) [B, V]: the log-softmax of `forward`."""
        return F.log_softmax(self(context_words, tags, u), dim=-1)

    @torch.no_grad()
    def greedy_decode(self, u: Tensor, tags: Tensor, lengths: Tensor, start_id: int,
                      pad_tag: int, banned: Sequence[int] = ()) -> Tensor:
        """Captions for content vectors u [B, D] that follow the tag sequences tags [B, L] (a
        row's tags from lengths[b] on are read as pad_tag): word ids [B, L], -1 past each row's
        length. Step n takes the most probable word given the words chosen before it (start_id
        before the first), tags t_n..t_{n+forward_tags} (pad_tag past the row's end) and u,
        never start_id nor a `banned` id; all rows step together.

        This is the per-step MAP (greedy) decode; the exact joint MAP caption would need a
        search over word sequences.
        """
        rows, steps = tags.shape
        past_end = torch.arange(steps, device=tags.device) >= lengths[:, None]
        tags = torch.cat([tags.masked_fill(past_end, pad_tag),
                          tags.new_full((rows, self.forward_tags), pad_tag)], dim=1)
        history = tags.new_full((rows, self.context + steps), start_id)
        excluded = torch.zeros(self.output_bias.shape[0], dtype=torch.bool, device=u.device)
        excluded[[start_id, *banned]] = True
        for n in range(int(lengths.max()) if rows else 0):
            logits = self(history[:, n:n + self.context], tags[:, n:n + self.forward_tags + 1], u)
            history[:, self.context + n] = logits.masked_fill(excluded, -torch.inf).argmax(dim=1)
        return history[:, self.context:].masked_fill(past_end, -1)


def training_windows(words: Sequence[int], tags: Sequence[int], context: int, forward_tags: int,
                     start_id: int, pad_tag: int) -> tuple[Tensor, Tensor, Tensor]:
    """One caption's prediction problems, built as `SCNLM.greedy_decode` builds its steps: for
    each word w_n, the `context` words before it (start_id before the first word), the tags
    t_n..t_{n+forward_tags} (pad_tag past the last) and w_n itself ->
    (context_words [N, context], tags [N, forward_tags+1], targets [N]) for N = len(words)."""
    if len(tags) != len(words):
        raise ValueError(f"{len(words)} words but {len(tags)} tags")
    history = [start_id] * context + list(words)
    padded = list(tags) + [pad_tag] * forward_tags
    count = len(words)
    context_words = [history[n:n + context] for n in range(count)]
    windows = [padded[n:n + forward_tags + 1] for n in range(count)]
    return (torch.tensor(context_words, dtype=torch.long).reshape(count, context),
            torch.tensor(windows, dtype=torch.long).reshape(count, forward_tags + 1),
            torch.tensor(list(words), dtype=torch.long))
