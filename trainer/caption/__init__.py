"""Captioning (paper 5.2): the SC-NLM conditioned on DeFrag's image vectors, its trigram baseline,
training, the caption command and its BLEU / CIDEr / METEOR evaluation. Only the command line
imports it."""
