"""The job slurm_test.sh submits: started by srun through `membox launch
--attach` on each host, it trains on the "membox" torch.distributed backend
and checks its sums.

- all_reduce of int64 and float64 tensors of 1 element to 1 Mi elements,
  and of 12 MiB float32 tensors (split between the workers' ring and the
  nodes): every sum exact;
- 12 DDP steps of a small MLP (data differ per rank): after every step the
  weights are identical on every rank, and equal (to float rounding) to one
  process's training on the mean of every rank's gradients.
Prints one line per rank: its host, the sums and the final loss.
"""
import copy
import socket
import sys

import torch
import torch.distributed as dist

import membox.torch  # noqa: F401  (registers the "membox" backend)


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).tanh()


def main():
    dist.init_process_group("membox")
    rank, world = dist.get_rank(), dist.get_world_size()
    tri = world * (world + 1) // 2
    for n in (1, 1000, 1 << 20):
        for dtype in (torch.int64, torch.float64):
            t = torch.arange(n, dtype=dtype) * (rank + 1)
            dist.all_reduce(t)
            want = torch.arange(n, dtype=dtype) * tri
            if not torch.equal(t, want):
                sys.exit(f"rank {rank}: all_reduce of {n} {dtype} is not exact")

    # Large float32 sums: split between the workers' ring and the nodes
    # across the hosts, the share moving between calls; exact.
    for i in range(6):
        t = (torch.arange(3 << 20) % 1024).float() * (rank + 1) + i
        dist.all_reduce(t)
        want = (torch.arange(3 << 20) % 1024).float() * tri + i * world
        if not torch.equal(t, want):
            sys.exit(f"rank {rank}: split all_reduce {i} is not exact")

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                              torch.nn.Linear(32, 1))
    ref = copy.deepcopy(net)
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(12):
        x, y = batch(rank, step)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        # The reference: one process, the mean of every rank's gradients.
        ref_opt.zero_grad()
        for r in range(world):
            xr, yr = batch(r, step)
            (torch.nn.functional.mse_loss(ref(xr), yr) / world).backward()
        ref_opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        every = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(every, flat)
        if not all(torch.equal(e, flat) for e in every):
            sys.exit(f"rank {rank}: weights differ between ranks at step {step}")
        want = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
        if not torch.allclose(flat, want, rtol=1e-5, atol=1e-6):
            sys.exit(f"rank {rank}: weights differ from one process's at step "
                     f"{step} (max {(flat - want).abs().max().item():.3g})")
    print(f"slurm job: rank {rank} of {world} on host {socket.gethostname()}: "
          f"sums exact, weights equal, loss {loss.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
