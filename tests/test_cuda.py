"""The code paths that only run on a GPU: NCCL, the pinned-memory prefetch, a trainer step on
CUDA (DDP and DeepSpeed engines) against the same step on the CPU, and bf16 autocast.

Skipped where torch sees no GPU (the CI machine); run them on a GPU machine with
`python -m pytest -q tests/test_cuda.py` (benchmarks/README.md, "GPU checks", says where they
last ran). DEFRAG_TEST_SHARDS points the tests at shards made beforehand on a machine without
spaCy (tests/conftest.py).
"""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

from tests.test_device_decode import bogus_huffman_table, encoded, photo
from tests.test_engines import PAIRS, make_config, step_parameters
from trainer.batch import batches_on_device, collate
from trainer.data.device_decode import Encoded, decode_chunk
from trainer.data.reader import SampleDecoder, decode_image, read_images
from trainer.data.shardset import load_vocabulary, locate_split
from trainer.model import DeFragModel
from trainer.objectives import gather_global_batch
from trainer.training.distributed import DistContext, init_distributed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def nccl_group():
    """A process group of one on NCCL, joined through the trainer's own init_distributed."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    ctx = init_distributed("cuda")
    assert dist.get_backend() == "nccl"
    yield ctx
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def exact_float32():
    """float32 matrix products in float32 (not TF32), so that CUDA and CPU steps compare."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_nccl_gather_of_the_global_batch(nccl_group) -> None:
    """The loss's gather (funcol all_gather with autograd) runs on NCCL: rows come back as they
    went in and the backward reaches every input row."""
    device = nccl_group.device
    v = torch.randn(7, 5, device=device, requires_grad=True)
    s = torch.randn(4, 5, device=device, requires_grad=True)
    v_owner = torch.tensor([0, 0, 1, 1, 1, 2, 2], device=device)
    s_owner = torch.tensor([0, 1, 1, 2], device=device)
    key = torch.tensor([11, 12, 13], device=device)
    batch = gather_global_batch(v, v_owner, s, s_owner, key)
    torch.testing.assert_close(batch.v, v)
    torch.testing.assert_close(batch.s_owner, s_owner)
    assert batch.own_pairs.all()
    (batch.v.sum() + 2 * batch.s.sum()).backward()
    torch.testing.assert_close(v.grad, torch.ones_like(v))
    torch.testing.assert_close(s.grad, torch.full_like(s, 2.0))


def test_prefetch_pins_and_copies_every_batch(shards) -> None:
    """batches_on_device on CUDA (a collating thread, pinned memory, asynchronous copies) gives
    the batches that the plain copy gives, in order."""
    cfg = make_config(shards, "ddp", 0)
    vocab = load_vocabulary(cfg.data)
    images = list(read_images(locate_split(cfg.data.shards, "train").shards[:2],
                              SampleDecoder.from_config(cfg, vocab)))
    batches = [collate([images[i].pairs()[0] for i in range(start, start + 4)])
               for start in range(0, len(images) - 3, 4)]
    assert batches[0].pin_memory().images.is_pinned()
    got = list(batches_on_device(iter(batches), torch.device("cuda")))
    assert len(got) == len(batches)
    for batch, on_gpu in zip(batches, got, strict=True):
        assert on_gpu.images.is_cuda and on_gpu.fragments.is_cuda
        want = batch.to("cpu")
        torch.testing.assert_close(on_gpu.images.cpu(), want.images)
        torch.testing.assert_close(on_gpu.boxes.cpu(), want.boxes)
        assert torch.equal(on_gpu.fragments.cpu(), want.fragments)


@pytest.mark.parametrize("engine,stage", [("ddp", 0), ("deepspeed", 1)])
def test_cuda_step_equals_cpu_step(nccl_group, shards, engine, stage) -> None:
    """One trainer step (real EfficientNet-Lite0 with RoIAlign regions, objective, optimizer) on
    the GPU gives the parameters the same step gives on the CPU, in both phases: cached frozen
    features with C_0, then MIL with the CNN finetuned."""
    cfg = make_config(shards, engine, stage)
    cfg.run.bf16 = False
    cpu_cfg = copy.deepcopy(cfg)
    cpu_cfg.run.engine = "ddp"
    for epoch in (0, 1):
        want = step_parameters(cpu_cfg, DistContext(0, 1, 0, torch.device("cpu")), PAIRS, epoch)
        got = step_parameters(cfg, nccl_group, PAIRS, epoch)
        for a, b in zip(got, want, strict=True):
            assert a.is_cuda
            torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("epoch,part,min_cosine", [(0, "all", 0.99), (1, "outside the CNN", 0.85)])
def test_bf16_step_follows_the_float32_step(nccl_group, shards, epoch, part, min_cosine) -> None:
    """With run.bf16 the step runs under bf16 autocast on CUDA, and its parameter update points
    the way the float32 update does. Phase 1 (cached features): every parameter. Phase 2: the
    finetuned CNN's own update differs (its first convolution's gradient sums many bf16 terms:
    cosine 0.40 over all parameters on an H200, 0.43 with CPU autocast), so the parameters
    outside the CNN (0.92 with CPU autocast)."""
    cfg = make_config(shards, "ddp", 0)
    vocab = load_vocabulary(cfg.data)
    model = DeFragModel.from_config(cfg.model, vocab, seed=0)
    compared = [part == "all" or not name.startswith("image.backbone")
                for name, _ in model.named_parameters()]
    before = [p.detach().to(nccl_group.device) for p in model.parameters()]
    updates = {}
    for bf16 in (False, True):
        cfg.run.bf16 = bf16
        after = step_parameters(cfg, nccl_group, PAIRS, epoch)
        assert all(torch.isfinite(p).all() for p in after)
        updates[bf16] = torch.cat([(a - b).double().flatten() for a, b, keep
                                   in zip(after, before, compared, strict=True) if keep])
    full, half = updates[False], updates[True]
    assert torch.nn.functional.cosine_similarity(full, half, dim=0) > min_cosine
    assert 0.8 < half.norm() / full.norm() < 1.2


def test_device_decoding_on_the_gpu(shards) -> None:
    """data.decode=device with nvJPEG: pixels close to the loader's (500x375 JPEGs at 224 px),
    a JPEG nvJPEG refuses is decoded by the loader's decoder or reported, and a batch of pixels
    decoded on the GPU goes through the pinned-memory prefetch where it is."""
    sources = [encoded(photo((500, 375), seed=seed)) for seed in range(8)]
    chunk = [Encoded(data, f"image {n}") for n, data in enumerate(sources)]
    chunk.append(Encoded(bogus_huffman_table(sources[0]), "damaged"))
    pixels, failed = decode_chunk(chunk, 224, torch.device("cuda"))
    assert list(failed) == [8] and "damaged" in failed[8]
    for data, image in zip(sources, pixels, strict=False):
        assert image.is_cuda and image.shape == (224, 224, 3)
        loader = torch.tensor(decode_image(data, 224)[0], device="cuda")
        assert (image.int() - loader.int()).abs().float().mean() < 3.0
    cfg = make_config(shards, "ddp", 0)
    vocab = load_vocabulary(cfg.data)
    images = list(read_images(locate_split(cfg.data.shards, "train").shards[:1],
                              SampleDecoder.from_config(cfg, vocab)))[:4]
    on_gpu = [dataclasses.replace(image, pixels=torch.from_numpy(image.pixels).cuda())
              for image in images]
    (batch,) = batches_on_device(iter([collate([i.pairs()[0] for i in on_gpu])]),
                                 torch.device("cuda"))
    want = collate([i.pairs()[0] for i in images]).to("cpu")
    assert batch.images.is_cuda and batch.images.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(batch.images.cpu(), want.images)
