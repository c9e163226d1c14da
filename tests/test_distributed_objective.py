"""Global negatives across real gloo processes: gradients equal one process on the whole batch."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.distributed import end_process, gather_global_batch, sum_over_ranks
from trainer.objectives import DeFragLoss

# Seven pairs split unevenly over the ranks; pairs 1 and 4 (and 0 and 5) share an image,
# pair 2's sentence has no fragments, fragment counts differ per pair.
IMAGE_FRAGS = [3, 2, 4, 1, 2, 5, 2]
SENTENCE_FRAGS = [2, 3, 0, 4, 1, 2, 3]
IMAGE_KEY = [10, 11, 12, 13, 11, 10, 14]
SPLITS = {2: [3, 4], 3: [2, 4, 1]}  # pairs per rank


def make_model_and_inputs():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"image": torch.nn.Linear(5, 8), "sentence": torch.nn.Linear(4, 8)})
    model = model.double()
    image_inputs = [torch.randn(n, 5, dtype=torch.float64) for n in IMAGE_FRAGS]
    sentence_inputs = [torch.randn(n, 4, dtype=torch.float64) for n in SENTENCE_FRAGS]
    return model, image_inputs, sentence_inputs


def local_batch(model, image_inputs, sentence_inputs, pairs):
    v = model["image"](torch.cat([image_inputs[p] for p in pairs]))
    s = model["sentence"](torch.cat([sentence_inputs[p] for p in pairs]))
    v_owner = torch.cat([torch.full((IMAGE_FRAGS[p],), i) for i, p in enumerate(pairs)])
    s_owner = torch.cat([torch.full((SENTENCE_FRAGS[p],), i) for i, p in enumerate(pairs)])
    return v, v_owner, s, s_owner, torch.tensor([IMAGE_KEY[p] for p in pairs])


def worker(rank, world_size, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    for mil, hardest_negative in ((True, False), (False, False), (True, True)):
        check_gradients(rank, world_size,
                        DeFragLoss(mil=mil, beta=0.5, hardest_negative=hardest_negative))
    end_process(0)  # destroys the group; gloo may abort at interpreter exit otherwise


def check_gradients(rank, world_size, loss_fn):
    model, image_inputs, sentence_inputs = make_model_and_inputs()

    full = loss_fn(*local_batch(model, image_inputs, sentence_inputs, range(len(IMAGE_KEY))))
    want = torch.autograd.grad(full["loss"], list(model.parameters()))

    start = sum(SPLITS[world_size][:rank])
    pairs = range(start, start + SPLITS[world_size][rank])
    batch = gather_global_batch(*local_batch(model, image_inputs, sentence_inputs, pairs))
    assert batch.image_key.tolist() == IMAGE_KEY
    mine = loss_fn(batch.v, batch.v_owner, batch.s, batch.s_owner, batch.image_key,
                   own_pairs=batch.own_pairs, sum_over_ranks=sum_over_ranks)
    grads = torch.autograd.grad(mine["loss"], list(model.parameters()))
    total_loss = sum_over_ranks(mine["loss"])
    torch.testing.assert_close(total_loss, full["loss"].detach())
    for got, expected in zip(grads, want, strict=True):
        torch.testing.assert_close(sum_over_ranks(got), expected)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_gathered_loss_gradients_equal_single_process(tmp_path, world_size):
    mp.spawn(worker, args=(world_size, str(tmp_path / "store")), nprocs=world_size)
