"""Sentence encoders, one module each (docs/design.md section 3): `model.sentence_encoder` names
a module of this package, whose `@register`ed `SentenceEncoderBase` subclass builds the encoder.

A new encoder is one new file here, its module name its config name, and its row in
`trainer.config.WHOLE_SENTENCE`; `encoder_class` imports the one module it needs.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING

from trainer.config import WHOLE_SENTENCE

if TYPE_CHECKING:
    from trainer.encoders.base import SentenceEncoderBase

# Every module of this package but `base` (the interface) is an encoder.
NAMES = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"))
if set(NAMES) != set(WHOLE_SENTENCE):
    raise ImportError(f"trainer/encoders holds {NAMES}, trainer.config.WHOLE_SENTENCE names "
                      f"{tuple(WHOLE_SENTENCE)}: give each encoder module its row there")
_CLASSES: dict[str, type[SentenceEncoderBase]] = {}


def register(cls: type[SentenceEncoderBase]) -> type[SentenceEncoderBase]:
    """Class decorator: the encoder of its module's name (`model.sentence_encoder`)."""
    name = cls.__module__.rpartition(".")[2]
    cls.whole_sentence = WHOLE_SENTENCE[name]
    _CLASSES[name] = cls
    return cls


def encoder_class(name: str) -> type[SentenceEncoderBase]:
    """The encoder class that `model.sentence_encoder = name` builds."""
    if name not in NAMES:
        raise ValueError(f"sentence encoder {name!r}: expected one of {NAMES}")
    importlib.import_module(f"{__name__}.{name}")
    return _CLASSES[name]
