"""One rank of PyTorch DistributedDataParallel (Gloo), trained as `frugal train --nproc N` trains.

side_by_side.py --nproc N starts N of these (through its hidden `--worker ddp`), one process per
rank, with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) and OMP_NUM_THREADS=1, OPENBLAS_NUM_THREADS=1. What it mirrors of frugal
(framework/src/data/data.cpp, framework/src/distributed/data_parallel.cpp,
framework/src/core/learner*.cpp, framework/src/data/task.cpp):

- the batches: every rank draws the one seeded order (side_by_side.permutation, frugal's
  Fisher-Yates on mt19937_64 seeded run.seed + epoch); data.batch_size is the global batch, and
  rank r of N takes rows [n*r//N, n*(r+1)//N) of a batch of n (DataLoader::batch with
  set_shard). A last training batch with fewer samples than ranks is dropped
  (DataLoader::num_batches); a last validation batch is kept (a rank may have no row of it);
- the loss: each rank's mean over its rows; when a batch splits unevenly the rank's loss is
  multiplied by mine * N / n before backward (DataParallel::before_batch's batch weight,
  Learner::backward's `loss * factor`), so that the average over ranks DDP takes (each gradient
  times 1/N, summed) is the mean over the whole batch;
- the gradients: DDP's all-reduce (bucket_cap_mb 25, broadcast_buffers on: its defaults), divided
  by the world size; frugal sums then multiplies by 1/N, DDP multiplies by 1/N then sums: the
  same bits for N = 2 (a power of two scales exactly);
- BatchNorm's running statistics: rank 0's, sent to every rank after each epoch's training
  (DataParallel::after_train); DDP's broadcast_buffers also sends rank 0's before each forward,
  which leaves rank 0's own statistics as they are;
- the train loss: rank 0's, the float32 sum of its shard losses over the last epoch divided by
  the batch count (Learner::loss_sum_ is a float); validation: each rank scores its rows of every
  validation batch (data.valid_batch_size, in order, the same split), the float64 sums of loss,
  count and correct all-reduced (sum_across_ranks);
- the time: rank 0's training epoch, its first batch to its last, after a barrier (frugal's ranks
  meet at the weights' broadcast just before); the step: rank 0's forward, loss, backward (which
  waits for the all-reduce) and optimizer step.
"""
import datetime, os, statistics, time


def shard(count, rank, world):
    """Rank's rows [lo, hi) of a batch of `count` samples (DataLoader::batch)."""
    return count * rank // world, count * (rank + 1) // world


def num_batches(n, batch, world, every_sample=False):
    """DataLoader::num_batches with drop_last off: a last batch smaller than the world is
    dropped, unless every_sample (validation's loader: a rank may then have no row of it)."""
    full, rest = divmod(n, batch)
    return full + (1 if rest > 0 and (rest >= world or every_sample) else 0)


def train_ddp(c, sbs):
    """Trains c (an image config of side_by_side.read_config) on this rank; returns rank 0's
    measurements (the others return theirs too: threads, allocator, the shared validation)."""
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)  # torchrun's OMP_NUM_THREADS=1 for nproc > 1, and said again
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    torch.manual_seed(c["seed"])
    train_x, train_y = sbs.fashion_mnist(c, True)
    valid = sbs.fashion_mnist(c, False) if c["valid_samples"] >= 0 else None
    model = sbs.make_model(c)
    ddp = DDP(model, bucket_cap_mb=25, gradient_as_bucket_view=c["bucket_view"])
    Opt = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[c["opt"]]
    opt = Opt(ddp.parameters(), lr=c["lr"], betas=c["betas"], eps=c["eps"],
              weight_decay=c["weight_decay"])
    scale, shift = 1.0 / (255.0 * sbs.STD), sbs.MEAN / sbs.STD

    n, B, epoch = len(train_y), c["batch"], 0
    batches = num_batches(n, B, world)
    epoch_seconds, epoch_losses, steps, weighted = [], [], [], 0
    ddp.train()
    dist.barrier()
    for epochs in c["stages"]:
        stage_steps = []
        for _ in range(epochs):
            order = torch.tensor(sbs.permutation(n, c["seed"] + epoch)) if c["shuffle"] else None
            epoch += 1
            total, count = np.float32(0), 0
            t_epoch = time.perf_counter()
            for b in range(batches):
                start = b * B
                size = min(B, n - start)
                lo, hi = shard(size, rank, world)
                if order is None:
                    x, y = train_x[start + lo:start + hi], train_y[start + lo:start + hi]
                else:
                    idx = order[start + lo:start + hi]
                    x, y = train_x.index_select(0, idx), train_y.index_select(0, idx)
                x = x.float().mul_(scale).sub_(shift)
                mine = hi - lo
                weight = 1.0 if mine * world == size else mine * world / size
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(ddp(x), y, label_smoothing=c["smoothing"])
                (loss if weight == 1.0 else loss * weight).backward()
                opt.step()
                total += np.float32(loss.item())
                count += 1
                stage_steps.append(time.perf_counter() - t0)
                weighted += weight != 1.0
            epoch_seconds.append(time.perf_counter() - t_epoch)
            epoch_losses.append(float(total) / count)
            with torch.no_grad():  # rank 0's running statistics everywhere (after_train)
                for buf in model.buffers():
                    dist.broadcast(buf, 0)
        steps += stage_steps[c["warmup"]:] or stage_steps

    acc = valid_loss = None
    if valid is not None:
        model.eval()
        vx, vy = valid
        nv, VB = len(vy), c["valid_batch"]
        sums = torch.zeros(3, dtype=torch.float64)  # loss, count, correct
        loss_sum, seen, correct = 0.0, 0, 0
        with torch.no_grad():
            for b in range(num_batches(nv, VB, world, every_sample=True)):
                start = b * VB
                lo, hi = shard(min(VB, nv - start), rank, world)
                if hi == lo:
                    continue  # another rank scores this last batch
                x, y = vx[start + lo:start + hi], vy[start + lo:start + hi]
                logits = model(x.float().mul_(scale).sub_(shift))
                loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
                correct += (logits.argmax(1) == y).sum().item()
                seen += len(y)
        sums[0], sums[1], sums[2] = loss_sum, seen, correct
        dist.all_reduce(sums)
        acc, valid_loss = sums[2].item() / sums[1].item(), sums[0].item() / sums[1].item()
    out = dict(train_seconds=sum(epoch_seconds), step_seconds=statistics.median(steps),
               final_loss=epoch_losses[-1], valid_accuracy=acc, valid_loss=valid_loss,
               threads=torch.get_num_threads(), torch_version=torch.__version__, rank=rank,
               world=world, weighted_batches=weighted, bucket_view=c["bucket_view"],
               grads_are_bucket_views=None)
    if c["bucket_view"]:  # did DDP keep the gradients as views of its buckets?
        out["grads_are_bucket_views"] = all(
            p.grad is None or p.grad._base is not None for p in model.parameters())
    dist.barrier()
    dist.destroy_process_group()
    return out
