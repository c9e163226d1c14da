"""What the featurizer and the trainer share: the shard format and its vocabulary, opening URLs,
the ImageNet backbones (box scoring and the model), and the command-line error handling.

Dependencies point one way: `trainer` imports `featurizer` (retrieval featurizes new images and
sentences as the training shards were) and `defrag`; `featurizer` imports only `defrag`.
"""
