"""The interface every sentence encoder implements, and what the encoders share."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor, nn

from trainer.config import ModelConfig

if TYPE_CHECKING:
    from defrag.vocab import Vocabulary
    from trainer.batch import Batch


def word_vector_parameter(word_vectors: Tensor, trainable: bool) -> nn.Parameter:
    """W_e [V, d], a copy of `word_vectors`, trained only when `trainable` (the papers keep it
    fixed)."""
    return nn.Parameter(word_vectors.detach().clone().float(), requires_grad=trainable)


def mean_by_owner(x: Tensor, owner: Tensor) -> Tensor:
    """Each row of x replaced by the mean of the rows with its owner (same shape, differentiable).

    The DeViSE-style baseline (`model.mean_pool`): every fragment of an image or a sentence
    becomes their mean, so the fragment scores of eq. 8 reduce to one mean-vs-mean score.
    """
    num_owners = int(owner.max()) + 1 if len(owner) else 0
    sums = x.new_zeros(num_owners, x.shape[1]).index_add(0, owner, x)
    counts = torch.bincount(owner, minlength=num_owners).clamp(min=1).to(x.dtype)
    return (sums / counts[:, None])[owner]


class SentenceEncoderBase(nn.Module):
    """Sentences -> rows s [Ns, embed_dim] in the joint space, with each row's sentence (s_owner).

    `inputs` names the Batch fields the encoder reads (trainer/objectives.py's glossary); they are
    `forward`'s positional arguments, then `num_sentences`. A whole-sentence encoder returns one
    row per sentence (s_owner = arange), a fragment encoder any number (eq. 1).
    """

    inputs: ClassVar[tuple[str, ...]]
    whole_sentence: ClassVar[bool]
    embed_dim: int
    word_vectors: nn.Parameter  # W_e [V, d], so named by every encoder (registry's word_dim)

    @classmethod
    def from_config(cls, cfg: ModelConfig, vocab: Vocabulary,
                    word_vectors: Tensor) -> SentenceEncoderBase:
        """The encoder of `cfg` over `vocab`, its W_e initialised to `word_vectors`; by default
        `cls(word_vectors, model.embed_dim, model.train_word_vectors)`."""
        return cls(word_vectors, cfg.embed_dim, cfg.train_word_vectors)

    def batch_inputs(self, batch: Batch) -> tuple[Tensor, ...]:
        """The Batch fields `inputs`, in order: `forward`'s positional arguments."""
        return tuple(getattr(batch, name) for name in self.inputs)

    def owners(self, inputs: tuple[Tensor, ...], num_sentences: int) -> Tensor:
        """s_owner [Ns] of `forward(*inputs, num_sentences=num_sentences)`'s rows."""
        return torch.arange(num_sentences, device=inputs[0].device)
