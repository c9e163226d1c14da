"""Fragment encoders (eq. 1, eq. 2), word vector files and DeFragModel, on the real
EfficientNet-Lite0 with its packaged ImageNet weights (no mocks)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torchvision

from defrag.backbones import build_backbone
from defrag.vocab import Vocabulary
from trainer.config import ModelConfig
from trainer.model import (
    DeFragModel,
    ImageEncoder,
    SentenceEncoder,
    cnn_batch_size,
    pooled_roi_align,
)
from trainer.wordvecs import embedding_matrix, load_word_vectors

# ---------------------------------------------------------------- sentence fragments (eq. 1)


def reference_sentence(encoder: SentenceEncoder, fragments: torch.Tensor) -> torch.Tensor:
    """Eq. 1 one fragment at a time, written straight from the paper."""
    rows = []
    for relation, w1, w2 in fragments.tolist():
        x = torch.cat([encoder.word_vectors[w1], encoder.word_vectors[w2]])
        rows.append(torch.relu(encoder.weight[relation] @ x + encoder.bias[relation]))
    return torch.stack(rows)


def make_sentence_encoder(train_word_vectors: bool = False, num_relations: int = 5,
                          vocab_size: int = 12, word_dim: int = 6,
                          embed_dim: int = 16) -> SentenceEncoder:
    torch.manual_seed(0)
    encoder = SentenceEncoder(torch.randn(vocab_size, word_dim), num_relations, embed_dim,
                              train_word_vectors=train_word_vectors)
    with torch.no_grad():
        encoder.bias.normal_()  # non-zero biases, so a wrong relation's b_R shows
    return encoder


def random_fragments(n: int, num_relations: int = 5, vocab_size: int = 12) -> torch.Tensor:
    generator = torch.Generator().manual_seed(n)
    return torch.stack([torch.randint(num_relations - 1, (n,), generator=generator),  # last unused
                        torch.randint(vocab_size, (n,), generator=generator),
                        torch.randint(vocab_size, (n,), generator=generator)], dim=1)


def gradients(encoder: SentenceEncoder, output: torch.Tensor) -> dict[str, torch.Tensor]:
    encoder.zero_grad(set_to_none=True)
    weights = torch.linspace(-1, 1, output.numel()).view_as(output)  # not a plain sum
    (output * weights).sum().backward()
    return {n: p.grad.clone() for n, p in encoder.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("train_word_vectors", [False, True])
def test_sentence_encoder_matches_per_fragment_reference(train_word_vectors: bool) -> None:
    encoder = make_sentence_encoder(train_word_vectors)
    fragments = random_fragments(40)
    assert len(fragments[:, 0].unique()) == 4  # several relation types (and one unused)
    fast = encoder(fragments)
    slow = reference_sentence(encoder, fragments)
    assert fast.shape == (40, 16)
    assert (fast == 0).any() and (fast > 0).any()  # the ReLU is really exercised
    torch.testing.assert_close(fast, slow)
    fast_grads, slow_grads = gradients(encoder, fast), gradients(encoder, slow)
    assert fast_grads.keys() == slow_grads.keys()
    for name in fast_grads:
        torch.testing.assert_close(fast_grads[name], slow_grads[name])
    assert fast_grads["weight"][4].abs().sum() == 0  # unused relation: zero gradient, not None
    assert fast_grads["weight"][:4].abs().sum(dim=(1, 2)).min() > 0


def test_sentence_encoder_word_vectors_frozen_or_trainable() -> None:
    frozen = make_sentence_encoder(train_word_vectors=False)
    frozen(random_fragments(10)).sum().backward()
    assert not frozen.word_vectors.requires_grad and frozen.word_vectors.grad is None
    assert frozen.weight.grad is not None

    trainable = make_sentence_encoder(train_word_vectors=True)
    fragments = random_fragments(10)
    trainable(fragments).sum().backward()
    grad = trainable.word_vectors.grad
    used = fragments[:, 1:].unique()
    assert grad[used].abs().sum(dim=1).min() > 0
    unused = torch.ones(len(grad), dtype=torch.bool)
    unused[used] = False
    assert grad[unused].abs().sum() == 0


def test_sentence_encoder_no_fragments_is_empty_and_differentiable() -> None:
    encoder = make_sentence_encoder()
    s = encoder(torch.zeros(0, 3, dtype=torch.long))
    assert s.shape == (0, 16) and s.requires_grad
    s.sum().backward()
    assert encoder.weight.grad is not None and encoder.weight.grad.abs().sum() == 0


def test_sentence_encoder_rejects_unknown_relation() -> None:
    encoder = make_sentence_encoder(num_relations=3)
    with pytest.raises(ValueError, match="relation id 3"):
        encoder(torch.tensor([[3, 0, 1]]))


@pytest.mark.parametrize("mode", ["bow", "bigram"])
def test_bow_and_bigram_fragments_use_one_relation(mode: str) -> None:
    vocab = Vocabulary(words=["a", "dog", "runs", "fast"], relations=["amod", "nsubj"])
    caption = {"text": "A dog runs fast", "tokens": ["a", "dog", "zebra", "runs", "fast"],
               "triplets": [["nsubj", "runs", "dog"]]}
    fragments = vocab.encode(caption, mode)
    expected = {"bow": [[0, 0, 0], [0, 1, 1], [0, 2, 2], [0, 3, 3]],
                "bigram": [[0, 0, 1], [0, 2, 3]]}[mode]  # "zebra" is dropped
    assert fragments.tolist() == expected
    torch.manual_seed(0)
    encoder = SentenceEncoder(torch.randn(4, 6), vocab.num_relations(mode), 8)
    assert encoder.weight.shape == (1, 8, 12)
    torch.testing.assert_close(encoder(fragments), reference_sentence(encoder, fragments))


# ---------------------------------------------------------------- word vector files


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_load_glove_text(tmp_path: Path) -> None:
    path = write(tmp_path / "glove.txt", "the 0.1 0.2 -0.3\ndog 1 2 3\nthe 9 9 9\n\n")
    words, vectors = load_word_vectors(path)
    assert words == ["the", "dog"]  # duplicate "the": the first row wins
    torch.testing.assert_close(vectors, torch.tensor([[0.1, 0.2, -0.3], [1.0, 2.0, 3.0]]))
    words, vectors = load_word_vectors(path, only={"dog", "cat"})
    assert words == ["dog"] and vectors.tolist() == [[1.0, 2.0, 3.0]]


def test_load_word2vec_text_with_header(tmp_path: Path) -> None:
    path = write(tmp_path / "w2v.txt", "2 3\ncat 0.5 -1 2e-1 \ndog 1 2 3\n")
    words, vectors = load_word_vectors(path)
    assert words == ["cat", "dog"]
    torch.testing.assert_close(vectors, torch.tensor([[0.5, -1.0, 0.2], [1.0, 2.0, 3.0]]))
    truncated = write(tmp_path / "short.txt", "3 3\ncat 0.5 -1 2e-1\n")
    with pytest.raises(ValueError, match="announces 3 words.*has 1"):
        load_word_vectors(truncated)


@pytest.mark.parametrize(("text", "line", "message"), [
    ("a 1 2 3\nb 1 2\n", 2, "expected a word and 3 values, got 2"),
    ("a 1 2 3\nb 1 2 3\nc 1 two 3\n", 3, "not a number"),
    ("2 3\na 1 2 3\nb 1 2 3 4\n", 3, "expected a word and 3 values, got 4"),
    ("a\n", 1, "got 0 values"),
])
def test_bad_word_vector_rows_name_file_and_line(tmp_path: Path, text: str, line: int,
                                                 message: str) -> None:
    path = write(tmp_path / "bad.txt", text)
    with pytest.raises(ValueError, match=rf"bad\.txt:{line}: .*{message}"):
        load_word_vectors(path)
    with pytest.raises(ValueError, match=rf"bad\.txt:{line}:"):  # also rows outside `only`
        load_word_vectors(path, only={"zzz"})


def test_embedding_matrix_aligns_rows_with_the_vocabulary(tmp_path: Path) -> None:
    path = write(tmp_path / "glove.txt", "dog 1 2 3 4\nzebra 5 6 7 8\ncat -1 -2 -3 -4\n")
    words = ["cat", "unknown", "dog"]
    matrix = embedding_matrix(words, path, dim=200, seed=3)  # the file's dimension wins
    assert matrix.shape == (3, 4)
    assert matrix[0].tolist() == [-1, -2, -3, -4] and matrix[2].tolist() == [1, 2, 3, 4]
    again = embedding_matrix(words, path, dim=200, seed=3)
    other = embedding_matrix(words, path, dim=200, seed=4)
    assert torch.equal(matrix, again) and not torch.equal(matrix[1], other[1])
    assert 0 < matrix[1].abs().max() < 20  # random, at the file's scale

    with pytest.raises(ValueError, match="none of the 2 vocabulary words"):
        embedding_matrix(["x", "y"], path, dim=4)


def test_embedding_matrix_without_file_is_seeded_random() -> None:
    matrix = embedding_matrix(["a", "b", "c"], None, dim=50, seed=1)
    assert matrix.shape == (3, 50)
    assert torch.equal(matrix, embedding_matrix(["a", "b", "c"], None, dim=50, seed=1))
    assert not torch.equal(matrix, embedding_matrix(["a", "b", "c"], None, dim=50, seed=2))
    assert 0.5 < matrix.norm(dim=1).mean() < 1.5  # about unit norm


# ---------------------------------------------------------------- image fragments (eq. 2)


@pytest.fixture(scope="module")
def lite0():
    """The real EfficientNet-Lite0 with its packaged ImageNet weights (copy before changing)."""
    return build_backbone("efficientnet_lite0", pretrained=True)


def images(batch: int, size: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


BOXES = torch.tensor([[0, 0, 64, 64], [8, 4, 40, 60], [0, 0, 64, 64], [20, 16, 63, 50],
                      [5, 5, 30, 30]], dtype=torch.float)
BOX_IMAGE = torch.tensor([1, 0, 0, 1, 2])


@pytest.mark.parametrize("mode", ["roi", "crop"])
def test_image_encoder_batched_boxes_land_on_their_image(lite0, mode: str) -> None:
    encoder = ImageEncoder(lite0, 24, region_mode=mode, crop_size=64).eval()
    batch = images(3, 64)
    with torch.no_grad():
        v = encoder(batch, BOXES, BOX_IMAGE)
        assert v.shape == (5, 24)
        for index, (box, image) in enumerate(zip(BOXES, BOX_IMAGE.tolist(), strict=True)):
            alone = encoder(batch[image:image + 1], box[None], torch.zeros(1, dtype=torch.long))
            torch.testing.assert_close(v[index], alone[0], atol=1e-4, rtol=1e-4)
        # the same whole-image box on images 1 and 0 must differ (the batch index is used)
        assert (v[0] - v[2]).abs().max() > 1e-2
        features = encoder.region_features(batch, BOXES, BOX_IMAGE)
        assert features.shape == (5, lite0.feature_dim)
        torch.testing.assert_close(encoder.project(features, BOX_IMAGE), v)


def test_crop_mode_whole_image_equals_backbone_on_full_image(lite0) -> None:
    encoder = ImageEncoder(lite0, 16, region_mode="crop", crop_size=96).eval()
    batch = images(2, 96, seed=1)
    whole = torch.tensor([[0, 0, 96, 96]] * 2, dtype=torch.float)
    with torch.no_grad():
        features = encoder.region_features(batch, whole, torch.tensor([0, 1]))
        torch.testing.assert_close(features, lite0(batch), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("size", [128, 224])
def test_roi_mode_whole_image_is_close_to_global_pooling(lite0, size: int) -> None:
    encoder = ImageEncoder(lite0, 16, region_mode="roi").eval()
    batch = images(2, size, seed=2)
    whole = torch.tensor([[0, 0, size, size]] * 2, dtype=torch.float)
    with torch.no_grad():
        features = encoder.region_features(batch, whole, torch.tensor([0, 1]))
        pooled = lite0(batch)
        error = (features - pooled).norm(dim=1) / pooled.norm(dim=1)
        assert error.max() < 0.02  # 4x4 map sampled on a 7x7 grid: bilinear, not exact
        smaller = encoder.region_features(batch, whole / 2, torch.tensor([0, 1]))
        assert ((smaller - pooled).norm(dim=1) / pooled.norm(dim=1)).min() > 0.1


def test_set_cnn_trainable_false_gives_head_gradients_only(lite0) -> None:
    encoder = ImageEncoder(copy.deepcopy(lite0), 16).train()
    encoder.set_cnn_trainable(False)
    encoder(images(2, 64), BOXES[:3], BOX_IMAGE[:3]).pow(2).sum().backward()
    assert all(p.grad is None for p in encoder.backbone.parameters())
    assert encoder.projection.weight.grad.abs().sum() > 0
    assert encoder.projection.bias.grad.abs().sum() > 0

    encoder.set_cnn_trainable(True)
    encoder.zero_grad(set_to_none=True)
    encoder(images(2, 64), BOXES[:3], BOX_IMAGE[:3]).pow(2).sum().backward()
    conv = encoder.backbone.features[0].weight
    assert conv.grad is not None and conv.grad.abs().sum() > 0
    assert len(encoder.cnn_parameters()) < len(list(encoder.backbone.parameters()))


@pytest.mark.parametrize("freeze", [True, False])
def test_freeze_batchnorm_keeps_statistics_in_train_mode(lite0, freeze: bool) -> None:
    encoder = ImageEncoder(copy.deepcopy(lite0), 16, freeze_batchnorm=freeze)
    encoder.eval().train()  # train() must re-apply the freeze
    bn = encoder.backbone.features[1]
    assert isinstance(bn, torch.nn.BatchNorm2d)
    before = bn.running_mean.clone()
    encoder(images(2, 64), BOXES[:3], BOX_IMAGE[:3]).sum().backward()
    assert torch.equal(bn.running_mean, before) == freeze
    assert bn.training != freeze
    assert (bn.weight.grad is None) == freeze and bn.weight.requires_grad != freeze
    encoder.set_cnn_trainable(True)  # unfreezing the CNN leaves frozen BatchNorm frozen
    assert bn.weight.requires_grad != freeze


def test_frozen_cnn_keeps_batchnorm_statistics(lite0) -> None:
    encoder = ImageEncoder(copy.deepcopy(lite0), 16, freeze_batchnorm=False).train()
    encoder.set_cnn_trainable(False)
    bn = encoder.backbone.features[1]
    before = bn.running_mean.clone()
    with torch.no_grad():
        encoder(images(2, 64), BOXES[:3], BOX_IMAGE[:3])
    assert torch.equal(bn.running_mean, before)


def test_cnn_batch_sizes_are_few_and_waste_little() -> None:
    sizes = [cnn_batch_size(rows) for rows in range(1, 5000)]
    assert all(size >= rows and size <= rows * 1.125 for rows, size in enumerate(sizes, 1))
    assert sizes == sorted(sizes)
    assert len({cnn_batch_size(rows) for rows in range(61, 89)}) == 4  # images of 100 pairs
    assert len({cnn_batch_size(rows) for rows in range(1025, 2049)}) == 8  # crops


@pytest.mark.parametrize("mode,freeze", [("roi", True), ("crop", True), ("roi", False)])
def test_padded_cnn_passes_change_nothing(lite0, mode: str, freeze: bool) -> None:
    """The CNN batch padded with zero images (on CUDA) gives the unpadded features and
    gradients; with BatchNorm on batch statistics (freeze_batchnorm off) nothing is padded."""
    torch.manual_seed(0)
    boxes = torch.rand(41, 4) * 32
    boxes[:, 2:] += 32
    box_image = torch.arange(41) % 19  # 19 images (padded to 20), 41 crops (to 44)
    results = []
    for pad in (False, True):
        torch.manual_seed(1)  # the same W_m
        encoder = ImageEncoder(copy.deepcopy(lite0), 16, region_mode=mode, crop_size=32,
                               freeze_batchnorm=freeze).train()
        encoder.pad_batches = pad
        seen: list[int] = []
        hook = encoder.backbone.features[0].register_forward_hook(
            lambda module, args, out, seen=seen: seen.append(len(args[0])))
        v = encoder(images(19, 64), boxes, box_image)
        hook.remove()
        (v * torch.linspace(-1, 1, v.numel()).view_as(v)).sum().backward()
        results.append((v, [p.grad for p in encoder.parameters() if p.grad is not None], seen))
    (v, grads, seen), (v_pad, grads_pad, seen_pad) = results
    assert seen == [19 if mode == "roi" else 41]
    assert seen_pad == [seen[0] if not freeze else 20 if mode == "roi" else 44]
    torch.testing.assert_close(v_pad, v, rtol=1e-4, atol=1e-5)
    assert len(grads) == len(grads_pad) > 40
    for a, b in zip(grads_pad, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode,k", [("roi", 1), ("roi", 3), ("crop", 2), ("roi", 18)])
def test_top_blocks_on_the_trunk_maps_are_the_whole_cnn(lite0, mode: str, k: int) -> None:
    """`top_features(trunk(x))` is `region_features(x)` of the uncut CNN (the same layers in the
    same order), and close to it from the maps rounded to fp16 as the trunk cache keeps them."""
    whole = ImageEncoder(lite0, 16, region_mode=mode, crop_size=64).eval()
    cut = ImageEncoder(lite0, 16, region_mode=mode, crop_size=64, finetune_blocks=k).eval()
    batch = images(3, 64)
    with torch.no_grad():
        expected = whole.region_features(batch, BOXES, BOX_IMAGE)
        maps = cut.trunk(batch, BOXES, BOX_IMAGE)
        assert len(maps) == (3 if mode == "roi" else 5)  # one per image, or per crop
        assert maps.shape[1] == {1: 320, 2: 192, 3: 192, 18: 3}[k]  # the input of the top
        torch.testing.assert_close(cut.top_features(maps, BOXES, BOX_IMAGE), expected,
                                   rtol=0, atol=0)
        torch.testing.assert_close(cut.top_features(maps.half(), BOXES, BOX_IMAGE), expected,
                                   rtol=0, atol=2e-3)


@pytest.mark.parametrize("freeze", [True, False])
def test_phase_two_with_finetune_blocks_trains_the_top_blocks_only(lite0, freeze: bool) -> None:
    encoder = ImageEncoder(copy.deepcopy(lite0), 16, finetune_blocks=2,
                           freeze_batchnorm=freeze).train()
    encoder.set_cnn_trainable(True)
    encoder(images(2, 64), BOXES[:3], BOX_IMAGE[:3]).pow(2).sum().backward()
    blocks = encoder.backbone.blocks()  # the stem, 16 MBConv blocks, the head conv
    top = {id(p) for block in blocks[-2:] for layer in block for p in layer.parameters()}
    learned = {id(p) for p in encoder.backbone.parameters() if p.grad is not None}
    assert learned and learned <= top  # the last MBConv block and the head conv
    assert learned == {id(p) for p in encoder.cnn_parameters()}
    # the block's expand, depthwise and project convs, the head conv (+ 4 BatchNorms' weight,
    # bias)
    assert len(learned) == (4 if freeze else 12)
    norms = [m for m in encoder.backbone.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    lower = {id(m) for block in blocks[:-2] for layer in block for m in layer.modules()}
    # the cached lower blocks keep their statistics even when the top's BatchNorm trains
    assert all(not m.training for m in norms if id(m) in lower)
    assert all(m.training != freeze for m in norms if id(m) not in lower)
    encoder.set_cnn_trainable(False)
    assert not any(p.requires_grad for p in encoder.backbone.parameters())
    with pytest.raises(ValueError, match="finetune_blocks=19: efficientnet_lite0 has 18 blocks"):
        ImageEncoder(lite0, 16, finetune_blocks=19)


def test_image_encoder_rejects_unknown_region_mode(lite0) -> None:
    with pytest.raises(ValueError, match="region mode 'warp'"):
        ImageEncoder(lite0, 16, region_mode="warp")


# ---------------------------------------------------------------- the whole model


def test_defrag_model_from_config_end_to_end(tmp_path: Path) -> None:
    vocab = Vocabulary(words=["a", "dog", "runs", "black", "grass"],
                       relations=["det", "nsubj", "amod"])
    write(tmp_path / "glove.txt", "dog 1 0 0 0 0 0.5\nblack 0 1 0 0 0 0\nruns 0 0 1 0 0 0\n")
    cfg = ModelConfig(embed_dim=16, word_vectors=str(tmp_path / "glove.txt"), word_dim=200,
                      region_mode="roi", image_size=64)
    state = torch.random.get_rng_state()
    model = DeFragModel.from_config(cfg, vocab, seed=7)
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    assert model.sentence.word_vectors.shape == (5, 6)  # the file's dimension wins
    assert model.sentence.word_vectors[1].tolist() == [1, 0, 0, 0, 0, 0.5]
    assert model.sentence.weight.shape == (3, 16, 12)

    captions = [{"tokens": ["a", "black", "dog", "runs"],
                 "triplets": [["det", "dog", "a"], ["amod", "dog", "black"],
                              ["nsubj", "runs", "dog"], ["punct", "runs", "."]]},
                {"tokens": ["grass"], "triplets": []}]
    fragments = torch.cat([vocab.encode(c) for c in captions])
    assert fragments.tolist() == [[0, 1, 0], [2, 1, 3], [1, 2, 1]]
    model.train()
    v, s = model(images(2, 64), BOXES[:3], BOX_IMAGE[:3], fragments, torch.tensor([0, 0, 0]))
    assert v.shape == (3, 16) and s.shape == (3, 16)
    (v @ s.T).sum().backward()

    cnn, head = model.cnn_parameters(), model.head_parameters()
    assert {id(p) for p in cnn}.isdisjoint(id(p) for p in head)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in cnn + head}
    assert all(p.grad is not None for p in head)
    assert all(p is not model.sentence.word_vectors for p in head)  # fixed W_e (paper 3.1)
    assert model.image.backbone.features[0].weight.grad.abs().sum() > 0

    twin = DeFragModel.from_config(cfg, vocab, seed=7)
    other = DeFragModel.from_config(cfg, vocab, seed=8)
    assert torch.equal(twin.sentence.weight, model.sentence.weight)
    assert torch.equal(twin.image.projection.weight, model.image.projection.weight)
    assert not torch.equal(other.sentence.weight, model.sentence.weight)
    trained = DeFragModel.from_config(
        ModelConfig(embed_dim=16, fragment_mode="bow", train_word_vectors=True, word_dim=8,
                    region_mode="crop", crop_size=64), vocab)
    assert trained.sentence.weight.shape == (1, 16, 16)
    assert any(p is trained.sentence.word_vectors for p in trained.head_parameters())


def test_mean_pool_is_the_devise_style_baseline(lite0) -> None:
    """model.mean_pool: v = W_m mean(CNN(I_b)) + b_m per image; s = W [e; e] + b (linear) of
    the mean word vector e per sentence (BoW fragments), each repeated for its fragments."""
    torch.manual_seed(0)
    words = torch.randn(6, 4)
    sentence = SentenceEncoder(words, 1, 8, mean_pool=True)
    fragments = torch.tensor([[0, 1, 1], [0, 2, 2], [0, 5, 5], [0, 3, 3]])
    owner = torch.tensor([0, 0, 1, 0])
    s = sentence(fragments, owner)
    for row in range(len(fragments)):
        mean = words[fragments[owner == owner[row], 1]].mean(0)
        expected = sentence.weight[0] @ torch.cat([mean, mean]) + sentence.bias[0]
        torch.testing.assert_close(s[row], expected)
    with pytest.raises(ValueError, match="sentence"):
        sentence(fragments)
    encoder = ImageEncoder(lite0, 8, mean_pool=True).eval()
    features = torch.randn(5, lite0.feature_dim)
    v = encoder.project(features, BOX_IMAGE)
    for row, image in enumerate(BOX_IMAGE.tolist()):
        mean = features[BOX_IMAGE.eq(image)].mean(0)
        torch.testing.assert_close(v[row], encoder.projection(mean))


def test_pooled_roi_align_is_roi_align_then_the_mean_forward_and_backward() -> None:
    """The cell-weight form of RoIAlign + average pooling equals torchvision's, values and
    gradients: boxes of every size (inside one cell, across the border, the whole image),
    images with 0, 1 and 3 boxes, listed out of image order."""
    generator = torch.Generator().manual_seed(0)
    fmap = torch.randn(4, 6, 7, 9, generator=generator, dtype=torch.float64)
    boxes = torch.tensor([[0, 0, 287, 223], [40, 30, 41, 33], [-20, 100, 150, 260],
                          [100.5, 3.2, 280.7, 90.1], [10, 10, 70, 200]], dtype=torch.float64)
    box_image = torch.tensor([2, 0, 2, 3, 2])  # image 1 has no box
    weights = torch.randn(len(boxes), 6, generator=generator, dtype=torch.float64)
    grads = []
    for pool in (lambda m: pooled_roi_align(m, boxes, box_image, 7, 1 / 32),
                 lambda m: torchvision.ops.roi_align(
                     m, torch.cat([box_image[:, None].double(), boxes], 1), 7,
                     spatial_scale=1 / 32, aligned=True).mean((2, 3))):
        leaf = fmap.clone().requires_grad_()
        out = pool(leaf)
        (out * weights).sum().backward()
        grads.append((out.detach(), leaf.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-6, atol=1e-7)
